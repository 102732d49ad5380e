"""Batches past the fast path: 5,000 held batches under `ulimit -n 1024` (torch's
loader, the reference point, fails there), memory exhausted while a worker creates a
segment (a MemoryError naming the size, no dead worker), and a ring grown while the
consumer holds every batch (overflow segments, replaced arenas, every value right).

Every wait runs under `deadline` (SIGALRM) or a subprocess timeout, and
faulthandler_timeout (pyproject) dumps stacks if all else fails.
"""
import re
import resource
import subprocess
import sys
import textwrap

import pytest
import torch

from fastloader import DataLoader, WorkerError
from tests.support import reliability_datasets as rd
from tests.support.fault_helpers import (
    QUIET_WORKER_COUNT_WARNING, STRATEGIES, _assert_no_shm_of, _my_shm, _reaped_later,
)
from tests.support.helpers import deadline, is_gone, run_python

pytestmark = [QUIET_WORKER_COUNT_WARNING]

_HOLD_SCRIPT = """
    import resource, sys
    import torch
    from fastloader import DataLoader
    from tests.support.reliability_datasets import SmallDataset

    kind, strategy = sys.argv[1], sys.argv[2]
    count = 5000
    dataset = SmallDataset(n=2 * count, width=4)
    print("nofile", resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
    if kind == "fastloader":
        loader = DataLoader(dataset, batch_size=2, num_workers=2,
                            multiprocessing_context="fork", sharing_strategy=strategy)
    else:
        torch.multiprocessing.set_sharing_strategy(strategy)
        loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=2,
                                             multiprocessing_context="fork")
    held = []
    try:
        for batch in loader:
            held.append(batch)
    except Exception as exc:
        print("FAILED", len(held), type(exc).__name__, " ".join(str(exc).split())[:400],
              flush=True)
        sys.exit(3)
    assert len(held) == count, len(held)
    for k, (x, y) in enumerate(held):
        idx = torch.arange(2 * k, 2 * k + 2)
        assert torch.equal(y, idx), (k, y)
        assert torch.equal(x, idx[:, None] * 10 + torch.arange(4)), (k, x)
    import psutil
    print("OK", len(held), psutil.Process().num_fds(), flush=True)
"""


def _low_nofile():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))


def _run_hold(kind, strategy, env):
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(_HOLD_SCRIPT), kind, strategy],
        env=env, capture_output=True, text=True, timeout=120, preexec_fn=_low_nofile,
        start_new_session=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_5000_held_batches_with_ulimit_1024(strategy, subprocess_env):
    result = _run_hold("fastloader", strategy, subprocess_env)
    assert "nofile 1024" in result.stdout, (result.stdout, result.stderr)
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    ok = [line for line in result.stdout.splitlines() if line.startswith("OK ")]
    assert ok, result.stdout
    _, count, fds = ok[0].split()
    assert int(count) == 5000
    assert int(fds) < 100, f"{fds} fds open while holding 5,000 batches"
    assert result.stderr == "", result.stderr


def test_torch_fails_the_same_hold(subprocess_env):
    """The reference point: torch's DataLoader (file_descriptor strategy) cannot hold
    5,000 batches with 1,024 fds."""
    result = _run_hold("torch", "file_descriptor", subprocess_env)
    assert "nofile 1024" in result.stdout, (result.stdout, result.stderr)
    if result.returncode == 0:
        pytest.xfail(f"torch held 5,000 batches with ulimit -n 1024 here: {result.stdout!r}")
    text = result.stdout + result.stderr
    assert re.search(r"Too many open files|received 0 items of ancdata", text), text


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_segment_creation_failure_is_memory_error_naming_size(strategy):
    """8 MiB batches while the worker may not create files over 1 MiB (shared segments
    included): a MemoryError (or OSError) naming the byte size, never SIGBUS or a dead
    worker, and nothing left in /dev/shm."""
    assert not _my_shm()
    batch_bytes = 2 * (1 << 20) * 4
    loader = DataLoader(rd.BigDataset(n=8, numel=1 << 20), batch_size=2, num_workers=1,
                        worker_init_fn=rd.limit_file_size_init, multiprocessing_context="fork",
                        sharing_strategy=strategy)
    with deadline(30):
        it = iter(loader)
        pids = list(it.worker_pids)
        with pytest.raises((MemoryError, OSError)) as info:
            next(it)
    error = info.value
    message = str(error)
    assert not isinstance(error, WorkerError), message
    assert "SIGBUS" not in message, message
    sizes = [int(s) for s in re.findall(r"(\d+)[- ]byte", message)]
    assert any(s >= batch_bytes for s in sizes), f"no size >= {batch_bytes} named: {message}"
    assert "in DataLoader worker process 0 (batch 0, index [0, 1])" in message, message
    assert all(not is_gone(p) for p in pids), "the worker died instead of reporting"
    del it, loader, info, error
    _reaped_later(pids)
    _assert_no_shm_of()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_worker_that_cannot_create_even_a_segment_for_its_error_says_so_per_batch(
        strategy):
    """No segment can be created at all (RLIMIT_FSIZE 0): the error the worker got
    needs one too. It used to escape and kill the worker, and the main process
    said only "exited unexpectedly with exit code 1". Now each batch raises in its
    turn, saying why, the worker lives on, and its stderr has the cause."""
    assert not _my_shm()
    loader = DataLoader(rd.SmallDataset(n=8), batch_size=4, num_workers=1,
                        worker_init_fn=rd.no_files_init, multiprocessing_context="fork",
                        sharing_strategy=strategy)
    errors = []
    with deadline(60):
        it = iter(loader)
        pids = list(it.worker_pids)
        for _ in range(2):
            with pytest.raises(RuntimeError) as info:
                next(it)
            errors.append(info.value)
        alive = [not is_gone(p) for p in pids]
        with pytest.raises(StopIteration):
            next(it)
    for seq, error in enumerate(errors):
        assert not isinstance(error, WorkerError), error
        assert (f"DataLoader worker process 0 could not send batch {seq}'s result, nor the "
                f"error it got") in str(error), error
    assert alive == [True], "the worker died instead of reporting"
    del it, loader, info, errors
    _reaped_later(pids)
    _assert_no_shm_of()


def test_the_error_no_segment_could_carry_is_on_the_workers_stderr():
    """The dataset's own error, and why it could not be sent, are on the worker's
    stderr (a pipe here: to a file, the same limit refuses them too)."""
    run = run_python(textwrap.dedent("""
        import fastloader
        from tests.support import reliability_datasets as rd

        class Raises(rd.SmallDataset):
            def __getitem__(self, i):
                raise ValueError("the dataset's own error")

        for dataset in (rd.SmallDataset(n=4), Raises(n=4)):
            loader = fastloader.DataLoader(dataset, batch_size=4, num_workers=1,
                                           worker_init_fn=rd.no_files_init,
                                           multiprocessing_context="fork")
            try:
                next(iter(loader))
            except RuntimeError as error:
                print(type(error).__name__, "could not send batch 0" in str(error))
    """), timeout=120)
    assert run.stdout.split() == ["RuntimeError", "True"] * 2, (run.stdout, run.stderr)
    assert run.stderr.count("MemoryError: fastloader: creating a") >= 2, run.stderr
    assert "ValueError: the dataset's own error" in run.stderr, run.stderr


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ring_grows_while_consumer_holds_batches(strategy):
    """Batches grow 4x and 9x over the epoch (the arena is replaced) while the consumer
    holds every batch (slots run out: overflow segments): every value right, checked
    as it arrives and again at the end, when the old arenas are long replaced."""
    dataset = rd.GrowingDataset(n=144, step=48)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork",
                        sharing_strategy=strategy)

    def check(k, batch):
        x, y = batch
        idx = torch.arange(4 * k, 4 * k + 4)
        assert torch.equal(y, idx), (k, y)
        assert x.shape == (4, dataset.numel(4 * k)), (k, x.shape)
        assert torch.equal(x, idx[:, None].expand_as(x)), f"batch {k}: wrong values"

    held = []
    with deadline(60):
        it = iter(loader)
        for k, batch in enumerate(it):
            check(k, batch)
            held.append(batch)
        stats = loader.stats(memory=False)
    assert len(held) == 36
    for k, batch in enumerate(held):
        check(k, batch)
    arenas = [w["arenas"] for w in stats["workers"]]
    assert all(a > 1 for a in arenas), f"arenas per worker: {arenas}"
    assert stats["overflow_batches"] > 0, stats
