"""A pool never forks while a reaper thread (reaper.py) is starting or exiting.

In those moments the thread runs without the GIL and may hold an allocator lock
(CPython frees its thread state; the C library and ASan's allocator hand its caches
back); a worker forked then inherits that lock held and hangs at its first
allocation. Seen under `make test-asan` as a forked worker stuck in a futex in
libasan's allocator region, after hundreds of loader lifetimes.

The real windows last microseconds, so these tests widen them: a thread is made
to linger before _loop (starting) or after it (exiting), or the fork itself is
slowed while the thread's last job finishes. A lingering thread stops lingering
when a fork happens (or after LINGER_S): without the guard the fork comes at once
and is recorded mid-window; with it, the fork waits for the window to close. A
wrapper around os.fork (which multiprocessing's fork start method calls) records
the reaper's state at the moment of each fork, in the parent."""
import gc
import os
import threading
import time

import pytest

from fastloader import reaper
from fastloader import DataLoader
from tests.support import reliability_datasets as rd
from tests.support.helpers import deadline, is_reaped, settle, wait_until

LINGER_S = 2.0


class _Watch:
    """What reaper threads are doing, recorded by wrappers around reaper._run and
    reaper._loop (both older and newer reaper.py call _loop from _run)."""

    def __init__(self):
        self.in_loop = set()    # native ids of threads inside _loop
        self.starting = set()   # ... lingering before it
        self.exiting = set()    # ... lingering after it
        self.linger_before_loop = False
        self.linger_after_loop = False
        self.forked = threading.Event()   # ends every linger
        self.before_fork = []
        self.states = []   # per fork: (running, in_loop, starting, exiting)

    def linger(self, where):
        me = threading.get_native_id()
        where.add(me)
        try:
            self.forked.wait(LINGER_S)
        finally:
            where.discard(me)


@pytest.fixture
def watch(monkeypatch):
    w = _Watch()
    real_fork, real_run, real_loop = os.fork, reaper._run, reaper._loop

    def fork():
        for callback in w.before_fork:
            callback()
        w.states.append((reaper._state.running, set(w.in_loop), set(w.starting),
                         set(w.exiting)))
        w.forked.set()
        return real_fork()

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

    settle()   # no reaper thread of an earlier test
    monkeypatch.setattr(os, "fork", fork)
    monkeypatch.setattr(reaper, "_run", run)
    monkeypatch.setattr(reaper, "_loop", loop)
    # the guard's own limit must not end a wait that the linger makes long
    monkeypatch.setattr(reaper, "_FORK_WAIT_S", 30.0)
    yield w
    w.forked.set()
    monkeypatch.undo()
    assert reaper.wait_idle(30)


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


def test_no_fork_while_the_reaper_thread_exits(watch):
    watch.linger_after_loop = True
    reaper.retire(_Job())
    assert wait_until(lambda: watch.exiting, 10), "the thread should linger"
    _one_epoch()
    assert watch.states, "no fork was seen"
    assert not any(exiting for *_, exiting in watch.states), \
        f"forked while the reaper thread was exiting: {watch.states}"


def test_no_fork_while_the_reaper_thread_starts(watch):
    watch.linger_before_loop = True
    reaper.retire(_Job())
    _one_epoch()
    assert watch.states, "no fork was seen"
    assert not any(starting for _, _, starting, _ in watch.states), \
        f"forked while the reaper thread was starting: {watch.states}"


def test_no_fork_while_one_thread_exits_and_the_next_one_loops(watch):
    """A pool retired while the last thread exits starts the next one: that one
    being in _loop does not make the exiting one safe."""
    watch.linger_after_loop = True
    reaper.retire(_Job())
    assert wait_until(lambda: watch.exiting, 10), "the first thread should linger"
    finished = []
    reaper.retire(_Job(done=lambda: bool(finished)))
    assert wait_until(lambda: watch.in_loop, 10), "the second thread should loop"
    try:
        _one_epoch()
    finally:
        finished.append(True)
    assert watch.states, "no fork was seen"
    assert not any(exiting for *_, exiting in watch.states), \
        f"forked while a reaper thread was exiting: {watch.states}"


def test_the_reaper_thread_stays_in_its_loop_during_a_fork(watch):
    """The thread's last job finishes while a fork is under way: it must not
    leave _loop (and start exiting) before the fork is done."""
    finished = []
    reaper.retire(_Job(done=lambda: bool(finished)))
    assert wait_until(lambda: watch.in_loop, 10)

    def finish_the_job_and_give_the_thread_time():
        finished.append(True)
        time.sleep(0.3)   # the thread looks every 50 ms: it would have left by now

    watch.before_fork.append(finish_the_job_and_give_the_thread_time)
    _one_epoch()
    running, in_loop, _, _ = watch.states[0]
    assert running and in_loop, watch.states[0]
    assert reaper.wait_idle(30), "the thread should exit once the fork is done"


def test_a_pool_dropped_during_a_fork_is_reaped(watch):
    """Garbage collection may run at any allocation, also inside a fork, where
    the reaper's lock is held: an iterator dropped in a reference cycle then
    retires its pool on the forking thread. That must neither deadlock nor lose
    the pool: its workers are reaped once the fork is done."""
    loader = DataLoader(rd.SmallDataset(n=8), batch_size=4, num_workers=1,
                        multiprocessing_context="fork")
    with deadline(60):
        it = iter(loader)
        next(it)
    pids = list(it.worker_pids)
    it.cycle = it   # only the cyclic collector can free it
    del it
    collected = []

    def collect_once():
        if not collected:
            collected.append(gc.collect())

    watch.before_fork.append(collect_once)
    _one_epoch()
    assert collected and collected[0] > 0, "the dropped iterator was not collected in the fork"
    assert reaper.wait_idle(30)
    assert all(is_reaped(p) for p in pids), [p for p in pids if not is_reaped(p)]


class _Interrupted(Exception):
    pass


def test_an_exception_while_waiting_to_fork_releases_the_lock(watch, monkeypatch):
    """A signal handler may raise at any bytecode (SIGALRM, SIGTERM handlers), also
    while the forking thread checks the reaper's state: the lock must not stay
    held, or the reaper thread could never finish (nor exit) again."""
    watch.linger_after_loop = True
    reaper.retire(_Job())
    assert wait_until(lambda: watch.exiting, 10), "the thread should linger"
    real_tids_alive = reaper._tids_alive
    raised = []

    def interrupted_once(st):
        if not raised:
            raised.append(True)
            raise _Interrupted
        return real_tids_alive(st)

    monkeypatch.setattr(reaper, "_tids_alive", interrupted_once)
    with pytest.raises(_Interrupted):
        with reaper.still_for_fork():
            pass
    got = []

    def take_and_give_back():
        taken = reaper._state.lock.acquire(timeout=10)
        got.append(taken)
        if taken:
            reaper._state.lock.release()

    other = threading.Thread(target=take_and_give_back)
    other.start()
    other.join()
    assert got == [True], "the reaper's lock is still held after the exception"
