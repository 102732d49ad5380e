"""A worker that dies (SIGKILL from outside, SIGSEGV, SIGBUS, os._exit) is reported with
its number, pid and cause: within 2 s when the main process is blocked waiting for it,
even while a sibling is busy; and no batch delivered before the error is torn, whatever
moment of a publish the worker died at.

Every wait runs under `deadline` (SIGALRM) or a subprocess timeout, and
faulthandler_timeout (pyproject) dumps stacks if all else fails.
"""
import collections
import os
import random
import re
import signal
import threading
import time

import pytest
import torch

from fastloader import DataLoader, WorkerError
from tests.support import datasets as ds
from tests.support import reliability_datasets as rd
from tests.support.fault_helpers import (
    CONTEXTS, LOOSE_BOUND_S, QUIET_WORKER_COUNT_WARNING, STRATEGIES, _reaped_later,
    _strategy_for,
)
from tests.support.helpers import (
    assert_names_dead_worker, assert_no_shm_left, deadline, is_reaped, settle, shm_names,
    wait_until,
)

pytestmark = [QUIET_WORKER_COUNT_WARNING]

DEATH_BOUND_S = 2.0


def next_until_error(it, seconds=30):
    """Consume until the loader raises; return (exception, batches consumed)."""
    consumed = 0
    with deadline(seconds, "waiting for the worker's death to be reported"):
        try:
            for _ in it:
                consumed += 1
        except Exception as error:  # noqa: BLE001 - the test inspects it
            return error, consumed
    pytest.fail(f"the loader finished normally after {consumed} batches; no error raised")


@pytest.mark.parametrize("ctx,strategy", [
    ("fork", "file_descriptor"), ("fork", "file_system"),
    ("spawn", "file_descriptor"), ("forkserver", "file_system"),
])
def test_worker_killed_from_outside(ctx, strategy):
    shm_before = shm_names()
    loader = DataLoader(ds.SlowDataset(n=10_000, delay=0.02), batch_size=1,
                        num_workers=2 if ctx == "fork" else 1,
                        multiprocessing_context=ctx, sharing_strategy=strategy)
    with deadline(60):
        it = iter(loader)
        for _ in range(3):
            next(it)
    victim = it.worker_pids[0]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    error, _ = next_until_error(it)
    elapsed = time.monotonic() - killed_at
    assert_names_dead_worker(error, 0, victim, "SIGKILL")
    assert elapsed < LOOSE_BOUND_S, f"death reported {elapsed:.1f} s after SIGKILL"
    others = list(it.worker_pids)
    del it, loader, error
    settle()
    assert wait_until(lambda: all(is_reaped(p) for p in others), 5), "workers left behind"
    if strategy == "file_system":
        assert_no_shm_left(shm_before)


@pytest.mark.parametrize("how,cause", [
    ("SIGKILL", "SIGKILL"), ("SIGSEGV", "SIGSEGV"), ("exit3", "exit code 3"),
])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_worker_dies_by_itself(how, cause, strategy):
    """Index 5 goes to worker 1 (batch_size=1, round robin over 2 workers)."""
    loader = DataLoader(ds.WorkerDeathDataset(n=200, at=5, how=how), batch_size=1,
                        num_workers=2, multiprocessing_context="fork",
                        sharing_strategy=strategy)
    with deadline(30):
        it = iter(loader)
        pids = list(it.worker_pids)
        assert int(next(it)) == 0
    started = time.monotonic()
    error, consumed = next_until_error(it)
    elapsed = time.monotonic() - started
    assert_names_dead_worker(error, 1, pids[1], cause)
    assert consumed <= 4, f"{consumed} batches after the first: index 5 is batch 5"
    assert elapsed < LOOSE_BOUND_S, f"death reported {elapsed:.1f} s after it happened"
    del it, loader, error


def _read_stamp(path, timeout=5):
    assert wait_until(lambda: os.path.exists(path), timeout), f"{path} never written"
    with open(path) as f:
        return float(f.read())


def _blocked_next(it, seconds=30):
    """next(it) expected to raise: (exception, monotonic time it began waiting, time
    it raised)."""
    began = time.monotonic()
    with deadline(seconds, "waiting for the worker's death to be reported"):
        try:
            batch = next(it)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            return error, began, time.monotonic()
    pytest.fail(f"next() returned {batch!r} instead of raising")


@pytest.mark.parametrize("how,cause", [
    ("SIGSEGV", "SIGSEGV"), ("SIGBUS", "SIGBUS"), ("exit3", "exit code 3"),
])
@pytest.mark.parametrize("ctx", CONTEXTS)
def test_worker_dies_while_main_blocked(ctx, how, cause, tmp_path):
    """Batch 5 (worker 1) sleeps 0.6 s and then dies by a real invalid read, a real
    access past a shrunk shared mapping, or os._exit(3); the main process has been
    blocked in next() for it all that time. The error must name worker 1, its pid and
    the cause, within 2 s of the death (stamped by the worker just before dying)."""
    stamp = str(tmp_path / "died_at")
    loader = DataLoader(rd.DieWhileMainWaitsDataset(n=40, at=5, sleep_s=0.6, how=how,
                                                     stamp_path=stamp),
                        batch_size=1, num_workers=2, multiprocessing_context=ctx,
                        sharing_strategy=_strategy_for(ctx, len(how)))
    with deadline(60):
        it = iter(loader)
        pids = list(it.worker_pids)
        assert [int(next(it)) for _ in range(5)] == [0, 1, 2, 3, 4]
    error, began, raised = _blocked_next(it)
    died = _read_stamp(stamp)
    assert_names_dead_worker(error, 1, pids[1], cause)
    assert died - began > 0.2, "the main process was not blocked waiting when it died"
    assert raised - died < DEATH_BOUND_S, f"death reported {raised - died:.2f} s after it happened"
    del it, loader, error
    _reaped_later(pids)


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_worker_sigkilled_while_main_blocked(ctx, tmp_path):
    """Worker 1 is busy in a long sample (batch 5), the main process blocked waiting
    for it, when someone SIGKILLs it."""
    stamp = str(tmp_path / "in_slow_sample")
    loader = DataLoader(rd.DieWhileMainWaitsDataset(n=40, at=5, sleep_s=30, how="sleep",
                                                     stamp_path=stamp),
                        batch_size=1, num_workers=2, multiprocessing_context=ctx,
                        sharing_strategy=_strategy_for(ctx, 1))
    with deadline(60):
        it = iter(loader)
        pids = list(it.worker_pids)
        assert [int(next(it)) for _ in range(5)] == [0, 1, 2, 3, 4]
    killed_at = []

    def killer():
        if wait_until(lambda: os.path.exists(stamp), 20):
            time.sleep(0.4)
            killed_at.append(time.monotonic())
            os.kill(pids[1], signal.SIGKILL)   # our unreaped child: its pid is not reused

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        error, began, raised = _blocked_next(it)
    finally:
        thread.join()
    assert killed_at, "the worker never reached the slow sample"
    assert_names_dead_worker(error, 1, pids[1], "SIGKILL")
    assert killed_at[0] - began > 0.2, "the main process was not blocked waiting"
    assert raised - killed_at[0] < DEATH_BOUND_S, \
        f"death reported {raised - killed_at[0]:.2f} s after SIGKILL"
    del it, loader, error
    _reaped_later(pids)


def test_death_reported_promptly_while_a_sibling_is_busy(tmp_path):
    """Worker 0 is in a 20 s sample (batch 4: the main process waits for it) when
    worker 1 dies (batch 5). The death must still be reported within 2 s: stopping
    the busy sibling may not hold the error back."""
    stamp = str(tmp_path / "died_at")
    loader = DataLoader(rd.DieWhileMainWaitsDataset(n=40, at=5, sleep_s=0.6, how="exit7",
                                                     stamp_path=stamp, slow_at=4, slow_s=20),
                        batch_size=1, num_workers=2, multiprocessing_context="fork")
    with deadline(60):
        it = iter(loader)
        pids = list(it.worker_pids)
        assert [int(next(it)) for _ in range(4)] == [0, 1, 2, 3]
    error, began, raised = _blocked_next(it)
    died = _read_stamp(stamp)
    assert_names_dead_worker(error, 1, pids[1], "exit code 7")
    assert raised - died < DEATH_BOUND_S, \
        f"death reported {raised - died:.2f} s after it happened (sibling busy)"
    del it, loader, error
    _reaped_later(pids)


def _check_big_batch(batch, k, batch_size, numel):
    if isinstance(batch, dict):
        x, y = batch["x"], batch["index"]
        assert batch["n"] == batch_size
    else:
        x, y = batch
    idx = torch.arange(k * batch_size, (k + 1) * batch_size)
    assert torch.equal(y, idx), f"batch {k}: indices {y.tolist()}"
    assert x.shape == (batch_size, numel), f"batch {k}: shape {tuple(x.shape)}"
    expected = idx.to(torch.int32)[:, None].expand_as(x)
    if not torch.equal(x, expected):
        bad = (x != expected).nonzero()[:5].tolist()
        raise AssertionError(f"batch {k}: torn or stale values at {bad}")


def test_worker_killed_mid_publish_never_yields_a_torn_batch():
    """Many trials: a random worker is SIGKILLed after a random delay while both write
    2 MiB batches (stacked into the slot, or copied by the codec from a dict) and the
    consumer holds a random number of recent batches (slot reuse and overflow). Every
    batch delivered before the WorkerError must be exactly right; the only error
    allowed is the WorkerError."""
    rng = random.Random(20240606)
    batch_size, numel = 4, 128 * 1024
    trials, deaths, delivered = 16, 0, 0
    for trial in range(trials):
        extra = {"collate_fn": rd.dict_collate} if trial % 4 >= 2 else {}
        loader = DataLoader(rd.BigDataset(n=600, numel=numel), batch_size=batch_size,
                            num_workers=2, multiprocessing_context="fork",
                            sharing_strategy=STRATEGIES[trial % 2], **extra)
        held = collections.deque(maxlen=rng.choice([1, 3, 8, 20]))
        with deadline(60, f"torn-slot trial {trial}"):
            it = iter(loader)
            victim = it.worker_pids[rng.randrange(2)]
            pidfd = os.pidfd_open(victim)   # signals through it can never hit a reused pid
            timer = threading.Timer(rng.uniform(0.005, 0.25), signal.pidfd_send_signal,
                                    (pidfd, signal.SIGKILL))
            timer.start()
            k = 0
            try:
                for k, batch in enumerate(it):
                    _check_big_batch(batch, k, batch_size, numel)
                    held.append((k, batch))
                    delivered += 1
            except WorkerError as error:
                assert re.search(rf"\bpid {victim}\b", str(error)), str(error)
                deaths += 1
            finally:
                timer.cancel()
                timer.join()
                os.close(pidfd)
            for k, batch in held:   # still intact, after the worker's death
                _check_big_batch(batch, k, batch_size, numel)
            pids = list(it.worker_pids)
            del it, loader, held
            try:
                del batch
            except NameError:
                pass
        _reaped_later(pids)
    assert deaths >= trials // 3, f"only {deaths} of {trials} trials saw the kill mid-epoch"
    assert delivered > trials, delivered
