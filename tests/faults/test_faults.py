"""Failure contract: clear errors naming worker, pid and cause, fast, and nothing left
behind (processes, fds, mappings, /dev/shm entries) whatever happened.

No test may hang: every wait runs under `deadline` (SIGALRM), subprocesses under
a timeout, and faulthandler_timeout (pyproject) dumps stacks if all else fails.
"""
import gc
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import fastloader
from fastloader import DataLoader, FastLoaderError, WorkerError
from tests.support import datasets as ds
from tests.support.helpers import (
    assert_names_dead_worker,
    assert_no_shm_left, assert_same_batch_lists, clone_batch, collect, deadline, is_gone,
    is_reaped, loader_children, map_lines, num_fds, num_maps, settle, shm_left, shm_names,
    wait_until,
)

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

STRATEGIES = ("file_descriptor", "file_system")
DEATH_BOUND_S = 5.0


# ---- argument validation -------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("value", ["bogus", "", "FILE_SYSTEM", "file_descriptor ", "filesystem"])
def test_invalid_sharing_strategy_rejected(value, num_workers):
    with pytest.raises(ValueError) as info:
        DataLoader(ds.TensorLabelDataset(), batch_size=2, num_workers=num_workers,
                   sharing_strategy=value)
    message = str(info.value)
    assert "file_descriptor" in message and "file_system" in message, message


def test_exception_hierarchy():
    assert issubclass(WorkerError, FastLoaderError)
    assert issubclass(WorkerError, RuntimeError)
    assert fastloader.WorkerError is WorkerError


# ---- exceptions raised by user code in a worker ------------------------------------------

@pytest.mark.parametrize("ctx,nw,strategy,bad_index,worker", [
    ("fork", 2, "file_descriptor", 5, 1),   # batch 5 goes to worker 5 % 2 (round robin)
    ("fork", 3, "file_system", 6, 0),
    ("spawn", 1, "file_descriptor", 3, 0),
])
def test_getitem_exception_reraised_with_type_and_traceback(ctx, nw, strategy, bad_index, worker):
    loader = DataLoader(ds.RaisingDataset(bad_index=bad_index), batch_size=1, num_workers=nw,
                        multiprocessing_context=ctx, sharing_strategy=strategy)
    got = []
    with deadline(60):
        it = iter(loader)
        with pytest.raises(ValueError) as info:
            for batch in it:
                got.append(int(batch))
    assert type(info.value) is ValueError
    message = str(info.value)
    assert f"in DataLoader worker process {worker}" in message, message
    assert "Original Traceback" in message, message
    # the worker's traceback text: file, function, source line and original message
    assert "datasets.py" in message and "__getitem__" in message, message
    assert 'raise ValueError(f"bad sample {index}")' in message, message
    assert f"bad sample {bad_index}" in message, message
    assert got == list(range(bad_index)), "batches before the failing one must arrive in order"
    del it, loader


def test_collate_exception_reraised():
    loader = DataLoader(ds.TensorLabelDataset(), batch_size=4, num_workers=2,
                        collate_fn=ds.raising_collate, multiprocessing_context="fork")
    with deadline(30), pytest.raises(LookupError) as info:
        next(iter(loader))
    assert type(info.value) is LookupError
    message = str(info.value)
    assert "in DataLoader worker process 0" in message, message
    assert "Original Traceback" in message and "raising_collate" in message, message
    assert "collate refused a batch of 4" in message, message


def test_worker_init_fn_exception_reraised():
    loader = DataLoader(ds.TensorLabelDataset(), batch_size=4, num_workers=2,
                        worker_init_fn=ds.raising_worker_init, multiprocessing_context="fork",
                        sharing_strategy="file_system")
    with deadline(30), pytest.raises(KeyError) as info:
        next(iter(loader))
    assert type(info.value) is KeyError
    message = str(info.value)
    assert re.search(r"in DataLoader worker process \d", message), message
    assert "Original Traceback" in message and "raising_worker_init" in message, message
    assert "init failed in" in message, message


# ---- dead workers ------------------------------------------------------------------

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
    assert elapsed < DEATH_BOUND_S, f"death reported {elapsed:.1f} s after SIGKILL"
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
    assert elapsed < DEATH_BOUND_S, f"death reported {elapsed:.1f} s after it happened"
    del it, loader, error


# ---- timeouts, Ctrl-C, unencodable samples, forking with busy threads ------------------

def test_timeout_exceeded_names_the_timeout():
    loader = DataLoader(ds.SleepAtDataset(at=0, seconds=3), batch_size=1, num_workers=1,
                        timeout=1, multiprocessing_context="fork")
    with deadline(20), pytest.raises(RuntimeError) as info:
        next(iter(loader))
    message = str(info.value)
    assert re.search(r"time(d)?\s?out", message, re.IGNORECASE), message
    assert re.search(r"\b1(\.0)?\s?(s|sec|second)", message), message


def test_ctrl_c_while_waiting_for_a_batch():
    # Earlier tests leave torch DataLoader iterators in reference cycles; their
    # __del__ joins workers for seconds. If the collector ran one while our SIGINT
    # arrived, the KeyboardInterrupt would be raised (and swallowed) inside that
    # finalizer, not in next(): collect now and keep the collector off meanwhile.
    gc.collect()
    gc.disable()
    # A test run started in the background (`make test &`) inherits SIGINT ignored,
    # and Python then keeps it ignored: be a foreground Ctrl-C target ourselves.
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    loader = DataLoader(ds.SleepAtDataset(at=0, seconds=8), batch_size=1, num_workers=1,
                        multiprocessing_context="fork")
    it = iter(loader)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    timer.start()
    try:
        with deadline(30), pytest.raises(KeyboardInterrupt):
            next(it)
            time.sleep(0.1)  # a late KeyboardInterrupt still lands inside this block
        elapsed = time.monotonic() - started
    finally:
        timer.cancel()
        gc.enable()
        signal.signal(signal.SIGINT, old_handler)
    assert elapsed < DEATH_BOUND_S, f"KeyboardInterrupt came {elapsed:.1f} s after Ctrl-C"
    pids = list(it.worker_pids)
    del it, loader
    settle()
    assert wait_until(lambda: all(is_reaped(p) for p in pids), 5)


def test_unencodable_sample_names_the_type():
    loader = DataLoader(ds.LockDataset(), batch_size=2, num_workers=1,
                        collate_fn=ds.list_collate, multiprocessing_context="fork")
    with deadline(10), pytest.raises(Exception) as info:
        next(iter(loader))
    assert "lock" in str(info.value).lower(), str(info.value)


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


# ---- cleanup: dropped iterators, 200 lifetimes, /dev/shm, interpreter exit ----------------

@pytest.mark.parametrize("how", ["exhaust", "del", "break"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_iterator_end_joins_workers(how, strategy):
    loader = DataLoader(ds.TensorLabelDataset(n=40), batch_size=2, num_workers=2,
                        multiprocessing_context="fork", sharing_strategy=strategy)
    with deadline(30):
        it = iter(loader)
        pids = list(it.worker_pids)
        assert all(pid in loader_children() for pid in pids)
        if how == "exhaust":
            assert len(list(it)) == 20
        elif how == "del":
            next(it), next(it)
            del it
        else:
            for i, _ in enumerate(it):
                if i == 1:
                    break
            del it
    settle()
    # joined means reaped: not running, and not a zombie child either
    assert wait_until(lambda: all(is_reaped(p) for p in pids), 2), [
        p for p in pids if not is_reaped(p)]


def test_no_growth_after_200_partial_loaders():
    """fds, mappings, processes and /dev/shm entries are back where they started after
    200 loader lifetimes that each stopped after two batches."""
    dataset = ds.TensorLabelDataset(n=64)

    def lifetime(i):
        loader = DataLoader(dataset, batch_size=4, num_workers=2,
                            multiprocessing_context="fork",
                            sharing_strategy=STRATEGIES[i % 2])
        if i % 3 == 0:
            for j, batch in enumerate(loader):
                if j == 1:
                    break
        else:
            it = iter(loader)
            x, y = next(it)
            x, y = next(it)
            del it, x, y
        del loader

    with deadline(180, "200 loader lifetimes"):
        for i in range(6):  # warm up: lazily created, process-lifetime state
            lifetime(i)
        settle()
        fds0, maps0, children0, shm0 = num_fds(), num_maps(), loader_children(), shm_names()
        for i in range(200):
            lifetime(i)
    settle()
    wait_until(lambda: loader_children() <= children0, 5)
    fds1, maps1, children1 = num_fds(), num_maps(), loader_children()
    assert not (children1 - children0), f"processes left: {sorted(children1 - children0)}"
    assert fds1 - fds0 <= 2, f"fds grew from {fds0} to {fds1} over 200 loaders"
    assert maps1 - maps0 <= 8, f"mappings grew from {maps0} to {maps1} over 200 loaders"
    assert_no_shm_left(shm0)


def test_file_system_segments_are_private_and_unlinked():
    """Named segments: /dev/shm/fastloader-*, mode 0600, unlinked once both sides mapped
    them, so every such mapping of ours is already '(deleted)' and none is left after."""
    shm_before = shm_names()
    loader = DataLoader(ds.TensorLabelDataset(n=40), batch_size=4, num_workers=2,
                        multiprocessing_context="fork", sharing_strategy="file_system")
    held = []
    with deadline(30):
        it = iter(loader)
        held.extend([next(it), next(it), next(it)])
    ours = [line for line in map_lines() if "/dev/shm/fastloader-" in line]
    assert ours, "file_system strategy, yet no /dev/shm/fastloader-* segment is mapped"
    for line in ours:
        assert line.endswith("(deleted)"), f"mapped segment not unlinked: {line}"
        addresses = line.split()[0]
        try:
            mode = os.stat(f"/proc/self/map_files/{addresses}").st_mode
        except PermissionError:
            continue  # map_files needs CAP_SYS_ADMIN on some kernels
        assert stat.S_IMODE(mode) == 0o600, f"{line}: mode {oct(stat.S_IMODE(mode))}"
    del it, loader, held
    settle()
    assert_no_shm_left(shm_before)


def test_file_descriptor_strategy_stays_out_of_dev_shm():
    def shm_mappings():  # POSIX semaphores (/dev/shm/sem.*) are not data segments
        return {line.split(None, 5)[-1] for line in map_lines()
                if "/dev/shm/" in line and "/dev/shm/sem." not in line}

    before = shm_mappings()
    shm_before = shm_names()
    loader = DataLoader(ds.TensorLabelDataset(n=40), batch_size=4, num_workers=2,
                        multiprocessing_context="fork", sharing_strategy="file_descriptor")
    with deadline(30):
        it = iter(loader)
        held = [next(it), next(it), next(it)]
        after = shm_mappings()
        assert not (after - before), f"file_descriptor batches mapped from /dev/shm: {after - before}"
        assert not shm_left(shm_before)
    del it, loader, held


def run_script(code, env, timeout=90):
    return subprocess.run([sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_interpreter_exit_with_live_iterators(subprocess_env):
    """Iterators still alive mid-epoch at exit: clean exit, no warning or traceback,
    workers gone, nothing in /dev/shm."""
    shm_before = shm_names()
    result = run_script("""
        from fastloader import DataLoader
        from tests.support.datasets import TensorLabelDataset
        its = []
        for strategy in ("file_descriptor", "file_system"):
            loader = DataLoader(TensorLabelDataset(n=200), batch_size=2, num_workers=2,
                                multiprocessing_context="fork", sharing_strategy=strategy)
            it = iter(loader)
            batch = next(it)
            its.append((it, batch))
        print(" ".join(str(p) for it, _ in its for p in it.worker_pids), flush=True)
    """, subprocess_env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", f"output at exit:\n{result.stderr}"
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 4, result.stdout
    assert wait_until(lambda: all(is_gone(p) for p in pids), 5), [p for p in pids if not is_gone(p)]
    assert_no_shm_left(shm_before)


def test_main_process_killed(subprocess_env):
    """SIGKILL of the main process: its workers exit within seconds, /dev/shm stays clean."""
    shm_before = shm_names()
    result = run_script("""
        import os, signal
        from fastloader import DataLoader
        from tests.support.datasets import SlowDataset
        loader = DataLoader(SlowDataset(n=10_000, delay=0.01), batch_size=2, num_workers=2,
                            multiprocessing_context="fork", sharing_strategy="file_system")
        it = iter(loader)
        held = [next(it), next(it)]
        print(" ".join(str(p) for p in it.worker_pids), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """, subprocess_env)
    assert result.returncode == -signal.SIGKILL, (result.returncode, result.stderr)
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 2, (result.stdout, result.stderr)
    assert wait_until(lambda: all(is_gone(p) for p in pids), 10), \
        f"workers still running 10 s after the main process died: {[p for p in pids if not is_gone(p)]}"
    assert_no_shm_left(shm_before)
