"""Forked workers start and compute although the parent had busy threads (torch's
intra-op pool, a user thread holding a lock) at the fork.

Every wait runs under `deadline` (SIGALRM) or a subprocess timeout, and
faulthandler_timeout (pyproject) dumps stacks if all else fails.
"""
import threading

import pytest
import torch

from fastloader import DataLoader
from tests.support import datasets as ds
from tests.support.fault_helpers import QUIET_WORKER_COUNT_WARNING, STRATEGIES
from tests.support.helpers import assert_same_batch_lists, clone_batch, collect, deadline

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


def _use_inherited_channels(channels, conn):
    """In a child forked from the main process: try to drive the parent's channels
    (they are not this process's), then close them; report what each call did."""
    from fastloader import _core

    outcome = []
    for call in (lambda: channels[0].put_index(10_000, [0]),
                 lambda: _core.recv(channels, 0, 0.1)):
        try:
            call()
            outcome.append("done")
        except ValueError as exc:
            outcome.append(str(exc))
    for ch in channels:
        ch.close()   # must leave the parent's fds, ring and named segments alone
    conn.send(outcome)
    conn.close()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_process_forked_from_the_main_process_cannot_drive_its_loader(strategy):
    """The C core asks "am I the process that made this channel?" on every call. A
    process forked while an epoch runs must be refused (not send a task to the
    parent's worker, not take its results, not unlink its segments), and the
    parent's epoch goes on unchanged. The pid it compares with is kept in memory
    and refreshed at fork, so a stale one would let the child through."""
    import multiprocessing

    expected = [clone_batch(b) for b in torch.utils.data.DataLoader(
        ds.TensorLabelDataset(n=40), batch_size=4)]
    loader = DataLoader(ds.TensorLabelDataset(n=40), batch_size=4, num_workers=2,
                        multiprocessing_context="fork", sharing_strategy=strategy)
    with deadline(60):
        it = iter(loader)
        got = [clone_batch(next(it))]
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_use_inherited_channels, args=(it._channels, child))
        proc.start()
        child.close()
        assert parent.poll(30), "the child did not answer"
        outcome = parent.recv()
        proc.join(30)
        assert proc.exitcode == 0
        assert outcome == ["fastloader: channel is closed"] * 2, outcome
        got += [clone_batch(b) for b in it]
    assert_same_batch_lists(expected, got, strategy)
