"""Forked workers start and compute although the parent had busy threads (torch's
intra-op pool, a user thread holding a lock) at the fork.

Every wait runs under `deadline` (SIGALRM) or a subprocess timeout, and
faulthandler_timeout (pyproject) dumps stacks if all else fails.
"""
import threading

import torch

from fastloader import DataLoader
from tests.support import datasets as ds
from tests.support.fault_helpers import QUIET_WORKER_COUNT_WARNING, STRATEGIES
from tests.support.helpers import assert_same_batch_lists, clone_batch, collect

pytestmark = [QUIET_WORKER_COUNT_WARNING]


def test_fork_while_other_threads_run():
    """torch's intra-op pool is warm and a user thread holds a lock most of the time:
    forked workers must still start, run matmuls, and finish."""
    a = torch.randn(256, 256)
    (a @ a).sum().item()  # start the intra-op pool
    stop = threading.Event()
    lock = threading.Lock()

    def busy():
        while not stop.is_set():
            with lock:
                (a @ a).sum()

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        expected = [clone_batch(b) for b in torch.utils.data.DataLoader(
            ds.MatmulDataset(), batch_size=4)]
        for strategy in STRATEGIES:
            loader = DataLoader(ds.MatmulDataset(), batch_size=4, num_workers=2,
                                multiprocessing_context="fork", sharing_strategy=strategy)
            assert_same_batch_lists(expected, collect(loader, seconds=60), strategy)
    finally:
        stop.set()
        thread.join()
