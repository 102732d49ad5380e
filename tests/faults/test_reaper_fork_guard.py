"""No fork of the process happens while a reaper thread (reaper.py) is starting or
exiting: a pool's worker, torch's, or a plain os.fork().

In those moments the thread runs without the GIL and may hold an allocator lock
(CPython frees its thread state; the C library and ASan's allocator hand its caches
back); a child forked then inherits that lock held and hangs at its first
allocation. Seen under `make test-asan` as a forked worker stuck in a futex in
libasan's allocator region, after hundreds of loader lifetimes.

The real windows last microseconds, so these tests widen them: a thread is made
to linger before _loop (starting) or after it (exiting). A lingering thread stops
lingering once the guard was seen waiting for it, or once the fork happened
without waiting. What reaper threads were doing at the fork is read in the child,
from its copy of the parent's memory (an at-fork hook writes it to a pipe): the
state at the very instant of the fork, whatever the implementation."""
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest

from fastloader import DataLoader, reaper
from tests.support import reliability_datasets as rd
from tests.support.helpers import deadline, is_reaped, settle, wait_until

LINGER_S = 10.0   # a cap: a linger normally ends as soon as the guard waits or the fork is done
_ACTIVE = []      # the running test's _Watch, if any


class _Watch:
    def __init__(self, state):
        self.state = state      # the parent's reaper state (a child makes its own)
        self.in_loop = set()    # native ids of reaper threads inside _loop
        self.starting = set()   # ... lingering before it
        self.exiting = set()    # ... lingering after it
        self.linger_before_loop = False
        self.linger_after_loop = False
        self.release = threading.Event()   # ends every linger
        self.guard_waited = False
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)

    def snapshot(self):
        return (self.state.running, sorted(self.in_loop), sorted(self.starting),
                sorted(self.exiting))

    def linger(self, where):
        me = threading.get_native_id()
        where.add(me)
        try:
            self.release.wait(LINGER_S)
        finally:
            where.discard(me)

    def at_forks(self):
        """The snapshot each child took at its fork."""
        data = b""
        while True:
            try:
                chunk = os.read(self.read_fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        return [eval(line) for line in data.decode().splitlines()]   # our own repr()s

    def close(self):
        os.close(self.read_fd)
        os.close(self.write_fd)


def _in_child():
    if _ACTIVE:
        w = _ACTIVE[0]
        try:
            os.write(w.write_fd, (repr(w.snapshot()) + "\n").encode())
        except OSError:
            pass


def _in_parent():
    if _ACTIVE:
        _ACTIVE[0].release.set()


# (registered once; idle unless a test here is running)
os.register_at_fork(after_in_child=_in_child, after_in_parent=_in_parent)


@pytest.fixture
def watch(monkeypatch):
    settle()   # no reaper thread of an earlier test
    w = _Watch(reaper._STATE.get())
    real_run, real_loop = reaper._run, reaper._loop
    real_quiet = getattr(reaper, "_quiet", None)

    def run(st):
        if w.linger_before_loop:
            w.linger(w.starting)
        real_run(st)

    def loop(st):
        me = threading.get_native_id()
        w.in_loop.add(me)
        try:
            real_loop(st)
        finally:
            w.in_loop.discard(me)
        if w.linger_after_loop:
            w.linger(w.exiting)

    def quiet(st):
        answer = real_quiet(st)
        if not answer:
            w.guard_waited = True
            w.release.set()
        return answer

    monkeypatch.setattr(reaper, "_run", run)
    monkeypatch.setattr(reaper, "_loop", loop)
    if real_quiet is not None:
        monkeypatch.setattr(reaper, "_quiet", quiet)
    # the guard's own limit must not end a wait that a linger makes long
    monkeypatch.setattr(reaper, "_FORK_WAIT_S", 30.0, raising=False)
    _ACTIVE.append(w)
    try:
        yield w
    finally:
        _ACTIVE.clear()
        w.release.set()
        monkeypatch.undo()
        assert reaper.wait_idle(30)
        w.close()


class _Job:
    """A retired job with nothing to wait for: finished when `done` says so."""

    def __init__(self, done=lambda: True):
        self.done = done

    def wait_fds(self):
        return []

    def step(self, now):
        return self.done()


def _one_epoch():
    loader = DataLoader(rd.SmallDataset(n=8), batch_size=4, num_workers=1,
                        multiprocessing_context="fork")
    with deadline(60):
        assert len(list(loader)) == 2


def _plain_fork():
    with deadline(60):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _assert_no_fork_caught(w, what):
    forks = w.at_forks()
    assert forks, "no fork was seen"
    caught = [f for f in forks if f[2] or f[3]]
    assert not caught, f"forked while a reaper thread was {what}: {caught}"
    assert w.guard_waited, "the fork should have waited for the thread"


def _exiting_thread(w):
    w.linger_after_loop = True
    reaper.retire(_Job())
    assert wait_until(lambda: w.exiting, 10), "the thread should linger"


def test_no_worker_is_forked_while_the_reaper_thread_exits(watch):
    _exiting_thread(watch)
    _one_epoch()
    _assert_no_fork_caught(watch, "exiting")


def test_no_plain_fork_while_the_reaper_thread_exits(watch):
    """Not only a pool's forks: any fork of the process (torch's DataLoader, the
    user's own) would catch our thread the same way."""
    _exiting_thread(watch)
    _plain_fork()
    _assert_no_fork_caught(watch, "exiting")


def test_no_fork_while_the_reaper_thread_starts(watch):
    watch.linger_before_loop = True
    reaper.retire(_Job())
    assert wait_until(lambda: watch.starting, 10), "the thread should linger"
    _one_epoch()
    _assert_no_fork_caught(watch, "starting")


def test_no_fork_while_one_thread_exits_and_the_next_one_loops(watch):
    """A pool retired while the last thread exits starts the next one: that one
    being in _loop does not make the exiting one safe."""
    _exiting_thread(watch)
    finished = []
    reaper.retire(_Job(done=lambda: bool(finished)))
    assert wait_until(lambda: len(watch.in_loop) == 1, 10), "the next thread should loop"
    try:
        _one_epoch()
    finally:
        finished.append(True)
    _assert_no_fork_caught(watch, "exiting")


@pytest.fixture
def in_the_fork(monkeypatch):
    """Callbacks run by the forking thread between the reaper's guard and the fork."""
    callbacks = []
    real = reaper._before_fork

    def before_fork():
        real()
        for callback in callbacks:
            callback()

    monkeypatch.setattr(reaper, "_before_fork", before_fork)
    return callbacks


def test_the_reaper_thread_stays_in_its_loop_during_a_fork(watch, in_the_fork):
    """The thread's last job finishes while a fork is under way: it must not
    leave _loop (and start exiting) before the fork is done."""
    finished = []
    reaper.retire(_Job(done=lambda: bool(finished)))
    assert wait_until(lambda: watch.in_loop, 10)

    def finish_the_job_and_give_the_thread_time():
        finished.append(True)
        time.sleep(0.3)   # the thread looks every 50 ms: it would have left by now

    in_the_fork.append(finish_the_job_and_give_the_thread_time)
    _plain_fork()
    running, in_loop, starting, exiting = watch.at_forks()[0]
    assert running and in_loop and not starting and not exiting, watch.at_forks()
    assert reaper.wait_idle(30), "the thread should exit once the fork is done"


def test_a_pool_dropped_during_a_fork_is_reaped(watch, in_the_fork):
    """Garbage collection may run at any allocation, also inside a fork: an
    iterator dropped in a reference cycle then retires its pool while a fork is
    under way. That must neither deadlock nor lose the pool: its workers are
    reaped once the fork is done."""
    loader = DataLoader(rd.SmallDataset(n=8), batch_size=4, num_workers=1,
                        multiprocessing_context="fork")
    with deadline(60):
        it = iter(loader)
        next(it)
    pids = list(it.worker_pids)
    gc.disable()   # the collection below, in the fork, is the one that frees it
    try:
        it.cycle = it
        dropped = weakref.ref(it)
        del it
        seen = []

        def collect_once():
            if not seen:
                seen.append(dropped() is not None)
                gc.collect()
                seen.append(dropped() is None)

        in_the_fork.append(collect_once)
        _plain_fork()
    finally:
        gc.enable()
    assert seen == [True, True], "the iterator should have been freed in the fork"
    assert reaper.wait_idle(30)
    assert all(is_reaped(p) for p in pids), [p for p in pids if not is_reaped(p)]


def test_an_exception_in_the_guard_leaves_nothing_stuck(watch, monkeypatch):
    """An exception in the guard (a signal handler may raise at any bytecode) is
    reported by Python and the fork goes on: no fork stays counted, so the thread
    can still start and exit."""
    real = reaper._tids_alive
    raised = []

    def interrupted_once(st):
        if not raised:
            raised.append(True)
            raise KeyboardInterrupt
        return real(st)

    monkeypatch.setattr(reaper, "_tids_alive", interrupted_once)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    _plain_fork()
    assert raised and unraisable, "the guard should have raised once, inside the fork"
    assert reaper._STATE.get().forking == 0
    reaper.retire(_Job())
    assert reaper.wait_idle(30)


_FINALIZER_IN_ANOTHER_THREAD = textwrap.dedent("""
    import gc, logging, os, threading, time
    from fastloader import DataLoader, reaper

    class Job:
        def wait_fds(self):
            return []
        def step(self, now):
            return True

    class Dropped:   # stands for an iterator dropped in a reference cycle
        def __del__(self):
            reaper.retire(Job())

    holding = threading.Event()

    def other_thread():
        # e.g. a logging call whose allocation runs the garbage collector
        with logging._lock:
            holding.set()
            time.sleep(0.5)   # meanwhile the main thread forks
            d = Dropped()
            d.cycle = d
            del d
            gc.collect()

    loader = DataLoader(list(range(8)), batch_size=4, num_workers=1,
                        multiprocessing_context="fork")
    t = threading.Thread(target=other_thread)
    t.start()
    holding.wait()
    assert len(list(loader)) == 2   # the worker's fork: logging's at-fork hook waits for logging._lock
    t.join()
    assert reaper.wait_idle(30)
    print("OK", flush=True)
""")


@pytest.mark.skipif(not hasattr(logging, "_lock"), reason="logging has no module lock here")
def test_a_finalizer_in_another_thread_during_a_fork_does_not_deadlock():
    """Another thread holds a lock that a fork's own at-fork hooks need (here
    logging's), and a finalizer it runs retires a pool: the fork must not hold a
    lock that retire() waits for, or both wait for ever."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        result = subprocess.run([sys.executable, "-c", _FINALIZER_IN_ANOTHER_THREAD],
                                capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the fork and the other thread's retire() deadlocked")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK", (result.stdout, result.stderr)


_COLLECTION_UNDER_THE_LOCK = textwrap.dedent("""
    import gc, os, sys, weakref
    from fastloader import DataLoader, reaper

    where = sys.argv[1]
    loader = DataLoader(list(range(8)), batch_size=4, num_workers=1,
                        multiprocessing_context="fork")
    it = iter(loader)
    next(it)
    pids = list(it.worker_pids)
    gc.disable()   # the collection below is the one that frees the iterator
    it.cycle = it
    dropped = weakref.ref(it)
    del it
    collected = []

    def collect_once():
        if not collected:
            collected.append(True)
            gc.collect()   # the iterator's finalizer retires its pool: retire() takes the lock

    if where == "fork guard":
        # an allocation of the guard's (a set in _tids_alive) runs the collector
        real = reaper._tids_alive

        def tids_alive(st):
            collect_once()
            return real(st)

        reaper._tids_alive = tids_alive
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        reaper._tids_alive = real
    else:
        # an allocation of the reaper thread's loop (its copy of the jobs) runs it
        class Jobs(list):
            def __iter__(self):
                collect_once()
                return super().__iter__()

        class Job:
            def wait_fds(self):
                return []
            def step(self, now):
                return True

        reaper._STATE.get().jobs = Jobs()
        reaper.retire(Job())
        assert reaper.wait_idle(30), "the reaper thread should finish"
    gc.enable()
    assert collected and dropped() is None, "the collection should have freed the iterator"
    assert reaper.wait_idle(30), "the dropped iterator's pool should be reaped"
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"worker {pid} was not reaped")
    print("OK", flush=True)
""")


@pytest.mark.parametrize("where", ["fork guard", "reaper thread"])
def test_a_collection_while_the_reapers_lock_is_held_does_not_deadlock(where):
    """Any allocation may run the garbage collector, and with it the finalizer of
    an iterator dropped in a reference cycle, which retires its pool: also an
    allocation made while the reaper's own lock is held, on the same thread (the
    fork guard's, found when torch's DataLoader forked its workers; the reaper
    thread's loop). That retire() must neither deadlock nor lose the pool."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        result = subprocess.run([sys.executable, "-c", _COLLECTION_UNDER_THE_LOCK, where],
                                capture_output=True, text=True, timeout=90, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a retire() run by a collection in the {where} deadlocked")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK", (result.stdout, result.stderr)
