"""A wait that ends early: timeout= exceeded (the error names the timeout) and Ctrl-C
(KeyboardInterrupt within 1 s of a terminal's SIGINT, workers shut down, nothing on
stderr).

Every wait runs under `deadline` (SIGALRM) or a subprocess timeout, and
faulthandler_timeout (pyproject) dumps stacks if all else fails.
"""
import gc
import json
import os
import re
import signal
import threading
import time

import pytest

from fastloader import DataLoader
from tests.support import datasets as ds
from tests.support import reliability_datasets as rd
from tests.support.fault_helpers import (
    CONTEXTS, LOOSE_BOUND_S, QUIET_WORKER_COUNT_WARNING, _assert_no_shm_of, _read_line,
    _reaped_later, _script,
)
from tests.support.helpers import deadline, is_gone, is_reaped, settle, wait_until

pytestmark = [QUIET_WORKER_COUNT_WARNING]

CTRL_C_BOUND_S = 1.0


def test_timeout_exceeded_names_the_timeout():
    loader = DataLoader(ds.SleepAtDataset(at=0, seconds=3), batch_size=1, num_workers=1,
                        timeout=1, multiprocessing_context="fork")
    with deadline(20), pytest.raises(RuntimeError) as info:
        next(iter(loader))
    message = str(info.value)
    assert re.search(r"time(d)?\s?out", message, re.IGNORECASE), message
    assert re.search(r"\b1(\.0)?\s?(s|sec|second)", message), message


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_timeout_names_the_timeout(ctx):
    loader = DataLoader(rd.SleepAtIndexDataset(n=8, at=0, seconds=3), batch_size=1,
                        num_workers=1, timeout=1.5, multiprocessing_context=ctx)
    it = iter(loader)
    pids = list(it.worker_pids)
    started = time.monotonic()
    with deadline(30), pytest.raises(RuntimeError) as info:
        next(it)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert re.search(r"time(d)?\s?out", message, re.IGNORECASE), message
    assert "1.5" in message, message
    assert 1.4 < elapsed < 4.0, f"timeout=1.5 raised after {elapsed:.2f} s"
    del it, loader, info
    _reaped_later(pids, timeout=10)


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
    assert elapsed < LOOSE_BOUND_S, f"KeyboardInterrupt came {elapsed:.1f} s after Ctrl-C"
    pids = list(it.worker_pids)
    del it, loader
    settle()
    assert wait_until(lambda: all(is_reaped(p) for p in pids), 5)


_CTRL_C_SCRIPT = """
    import os, signal, sys, time
    # Started from a background job, we inherit SIGINT ignored (and Python keeps it
    # so): take Ctrl-C as a foreground program does.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import psutil
    from fastloader import DataLoader
    from tests.support.reliability_datasets import SleepAtIndexDataset

    ctx = sys.argv[1]
    loader = DataLoader(SleepAtIndexDataset(n=40, at=1, seconds=30), batch_size=1,
                        num_workers=2, multiprocessing_context=ctx)
    it = iter(loader)
    assert int(next(it)) == 0
    pids = list(it.worker_pids)
    print("pids", *pids, flush=True)
    print("waiting", repr(time.monotonic()), flush=True)
    try:
        next(it)   # batch 1: its worker sleeps 30 s
        print("no interrupt", flush=True)
    except KeyboardInterrupt:
        print("interrupted", repr(time.monotonic()), flush=True)
    def gone(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    end = time.monotonic() + 5
    while not all(gone(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.02)
    print("workers_gone", all(gone(p) for p in pids), flush=True)
    time.sleep(0.3)   # late output from a worker would land on stderr before we exit
"""


@pytest.mark.parametrize("ctx", CONTEXTS + ("forkserver",))
def test_ctrl_c_while_blocked_raises_within_1s(ctx, subprocess_env):
    """SIGINT to the process group (what a terminal's Ctrl-C does) while the main
    process is blocked in next(): KeyboardInterrupt within 1 s, workers shut down,
    nothing at all on stderr (no worker traceback)."""
    with _script(_CTRL_C_SCRIPT, subprocess_env, ctx) as proc:
        pids = [int(p) for p in _read_line(proc, "pids ").split()]
        waiting_since = float(_read_line(proc, "waiting "))
        time.sleep(0.5)   # next() has long been blocked by now
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        line = _read_line(proc, "", seconds=30)
        assert line.startswith("interrupted "), f"got {line!r}"
        interrupted = float(line.split()[1])
        workers_gone = _read_line(proc, "workers_gone ", seconds=30)
        with deadline(30, "the Ctrl-C script's exit"):
            rest = proc.stdout.read()
            err = proc.stderr.read()
            proc.wait(timeout=25)
    assert sent - waiting_since > 0.4
    assert interrupted - sent < CTRL_C_BOUND_S, \
        f"KeyboardInterrupt came {interrupted - sent:.2f} s after Ctrl-C"
    assert workers_gone == "True", "workers still running 5 s after the KeyboardInterrupt"
    assert proc.returncode == 0, (proc.returncode, rest, err)
    assert err == "", f"output on stderr after Ctrl-C:\n{err}"
    assert wait_until(lambda: all(is_gone(p) for p in pids), 2)


_CTRL_C_AT_START_SCRIPT = """
    import os, signal, sys, threading, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import psutil
    from fastloader import DataLoader, spawn_server
    from tests.support.reliability_datasets import CtrlCWhenPickled

    ctx = sys.argv[1]
    # A thread that does not block SIGINT, as every program that imported NumPy has:
    # the kernel may hand it a Ctrl-C meant for the process.
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    dataset = CtrlCWhenPickled(8)
    loader = DataLoader(dataset, batch_size=2, num_workers=1, multiprocessing_context=ctx)
    assert len(list(loader)) == 4   # warm-up: the resource tracker and such start here
    me = psutil.Process()
    def ours(p):
        # not the resource tracker, nor the server spawn workers fork from: both
        # outlive every loader
        if p.pid == spawn_server.server_pid():
            return False
        try:
            return "resource_tracker" not in " ".join(p.cmdline())
        except psutil.Error:
            return True
    def wait_for_children():
        end = time.monotonic() + 30
        while time.monotonic() < end and [p for p in me.children() if ours(p)]:
            time.sleep(0.05)
        return [(p.pid, p.status()) for p in me.children() if ours(p)]
    def fds_after(baseline):
        # the reaper closes a pool's fds once its workers are reaped: give it time
        end = time.monotonic() + 30
        while me.num_fds() > baseline and time.monotonic() < end:
            time.sleep(0.05)
        return me.num_fds() - baseline
    def settled_fds():
        last, since, end = me.num_fds(), time.monotonic(), time.monotonic() + 30
        while time.monotonic() < end and time.monotonic() - since < 1.0:
            time.sleep(0.05)
            if me.num_fds() != last:
                last, since = me.num_fds(), time.monotonic()
        return last
    wait_for_children()
    fds = settled_fds()
    # the Ctrl-C lands while iter() starts the worker
    if ctx == "fork":
        os.register_at_fork(before=lambda: os.kill(os.getpid(), signal.SIGINT))
    else:
        dataset.armed = True
    try:
        it = iter(loader)
        print("lost: the epoch went on,", len(list(it)), "batches", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    print("children", wait_for_children(), flush=True)
    print("fds", fds_after(fds), flush=True)
"""


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_ctrl_c_while_workers_start_is_raised_not_dropped(ctx, subprocess_env):
    """SIGINT while iter() starts the workers, in a process with another thread that
    does not block it: the start set SIGINT to ignored for the whole process, so the
    kernel handed the signal to that thread, which dropped it, and the epoch went on.
    Now it is held and raised once the started worker is the pool's: a
    KeyboardInterrupt from iter(), the worker reaped, no fd left, nothing on stderr."""
    with _script(_CTRL_C_AT_START_SCRIPT, subprocess_env, ctx) as proc:
        with deadline(120, "the Ctrl-C-at-start script"):
            out, err = proc.communicate()
    assert proc.returncode == 0, (proc.returncode, out, err)
    lines = out.splitlines()
    assert lines[0] == "interrupted", out
    assert lines[1] == "children []", out
    assert lines[2].startswith("fds ") and int(lines[2].split()[1]) <= 0, out
    assert err == "", f"output on stderr after Ctrl-C:\n{err}"


_ENTER_RACE_SCRIPT = """
    import json, os, signal, threading, time
    from fastloader.sigint import DeferredCtrlC

    armed = False
    def handler(signum, frame):
        if armed:   # only around the block: not in the loop's own bookkeeping
            raise KeyboardInterrupt
    signal.signal(signal.SIGINT, handler)
    stop = threading.Event()
    def ctrl_c_all_the_time():
        while not stop.is_set():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.0001)
    threading.Thread(target=ctrl_c_all_the_time, daemon=True).start()
    counts = {"entered": 0, "interrupted": 0, "left_blocked": 0, "left_replaced": 0}
    end = time.monotonic() + 3
    while time.monotonic() < end:
        deferred = DeferredCtrlC()
        try:
            armed = True
            try:
                with deferred:
                    counts["entered"] += 1
            finally:
                deferred.deliver()
            armed = False
        except KeyboardInterrupt:
            armed = False
            counts["interrupted"] += 1
            if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, ()):
                counts["left_blocked"] += 1
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            if signal.getsignal(signal.SIGINT) is not handler:
                counts["left_replaced"] += 1
                signal.signal(signal.SIGINT, handler)
    stop.set()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(json.dumps(counts), flush=True)
"""


def test_a_ctrl_c_around_the_start_block_never_leaves_sigint_blocked(subprocess_env):
    """A Ctrl-C pending as the block began was raised by pthread_sigmask once it had
    blocked SIGINT and before the block could restore anything: the main thread kept
    SIGINT blocked for good, and every child it started after inherited that. Now
    the holding handler is in place first, and a failed entry puts all back."""
    with _script(_ENTER_RACE_SCRIPT, subprocess_env) as proc:
        with deadline(120, "the enter-race script"):
            out, err = proc.communicate()
    assert proc.returncode == 0, (proc.returncode, out, err)
    counts = json.loads(out.strip().splitlines()[-1])
    assert counts["entered"] > 1000 and counts["interrupted"] > 0, counts
    assert counts["left_blocked"] == 0 and counts["left_replaced"] == 0, counts


@pytest.mark.parametrize("ctx", CONTEXTS + ("forkserver",))
def test_programs_a_worker_starts_take_ctrl_c_as_under_torch(ctx):
    """A worker ignored SIGINT, and an ignored signal stays ignored across exec:
    ffmpeg or a shell tool started by the dataset ignored Ctrl-C and outlived the
    program. Its handler does nothing now, and exec gives the program the default."""
    import torch

    got = {}
    for name, cls in (("torch", torch.utils.data.DataLoader), ("fastloader", DataLoader)):
        got[name] = list(cls(ds.ChildSignalState(), batch_size=None, num_workers=1,
                             multiprocessing_context=ctx))
    assert got["fastloader"] == got["torch"] == [{"ignored": False, "blocked": False}] * 2


@pytest.mark.parametrize("ctx", CONTEXTS + ("forkserver",))
def test_a_worker_ignores_ctrl_c_while_it_exits(ctx, tmp_path):
    """The interpreter's finalization puts a SIGINT handler written in Python back
    to the default: a Ctrl-C then would kill a worker flushing its files."""
    import functools

    loader = DataLoader(ds.TensorLabelDataset(4), batch_size=2, num_workers=2,
                        multiprocessing_context=ctx,
                        worker_init_fn=functools.partial(ds.record_sigint_at_exit, str(tmp_path)))
    assert len(list(loader)) == 2
    del loader
    assert wait_until(lambda: {"0", "1"} <= set(os.listdir(tmp_path)), 30)
    assert {(tmp_path / w).read_text() for w in ("0", "1")} == {"<Handlers.SIG_IGN: 1>"}


_EXIT_CTRL_C_SCRIPT = """
    import atexit, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)   # as in _CTRL_C_SCRIPT
    # registered first, so run last: after fastloader's exit hook
    atexit.register(lambda: print("done", repr(time.monotonic()), flush=True))
    from fastloader import DataLoader
    from tests.support.reliability_datasets import SleepAtIndexDataset

    loader = DataLoader(SleepAtIndexDataset(n=40, at=1, seconds=60), batch_size=1,
                        num_workers=2, multiprocessing_context="fork",
                        sharing_strategy="file_system")
    it = iter(loader)
    assert int(next(it)) == 0
    pids = list(it.worker_pids)
    # worker 1 is in its first task, batch 1's 60 s sample, by now (a worker told
    # to stop skips the tasks it has not started, as torch's do)
    time.sleep(0.5)
    if sys.argv[1] == "retired":
        del it   # its workers are the reaper's now, with 5 s to stop
    print("pids", *pids, flush=True)
    print("exiting", flush=True)
"""


@pytest.mark.parametrize("held_by", ["live", "retired"])
def test_ctrl_c_while_exit_waits_for_a_busy_worker(held_by, subprocess_env):
    """At exit, fastloader gives a worker busy in a sample 2 s (an iterator still
    alive) or the rest of 5 s (one dropped) to stop. A Ctrl-C meanwhile ends the
    wait: the workers are stopped at once, nothing is left in /dev/shm, and nothing
    is printed (it was: "Exception ignored in atexit callback" and a traceback)."""
    with _script(_EXIT_CTRL_C_SCRIPT, subprocess_env, held_by) as proc:
        pids = [int(p) for p in _read_line(proc, "pids ").split()]
        _read_line(proc, "exiting")
        time.sleep(0.5)   # the exit hook is waiting for the busy worker by now
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        done = float(_read_line(proc, "done ", seconds=30))
        with deadline(30, "the script's exit after Ctrl-C"):
            err = proc.stderr.read()
            proc.wait(timeout=25)
        script_pid = proc.pid
    assert proc.returncode == 0, (proc.returncode, err)
    assert err == "", f"output on stderr after Ctrl-C at exit:\n{err}"
    # the exit hook was still waiting when Ctrl-C came (else this tested nothing)
    assert done > sent, "the exit hook had finished before the Ctrl-C: the box was too slow"
    if held_by == "retired":
        # about 4 s of the reaper's 5 s were left (plus its escalation): not waited out
        assert done - sent < 2.5, f"exit took {done - sent:.2f} s after Ctrl-C"
    # the busy worker sleeps 60 s: it was ended, not waited for
    assert wait_until(lambda: all(is_gone(p) for p in pids), LOOSE_BOUND_S), \
        [p for p in pids if not is_gone(p)]
    _assert_no_shm_of(script_pid)
