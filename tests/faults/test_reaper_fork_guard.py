"""A pool never forks while the reaper thread (reaper.py) is starting or exiting.

In those moments the thread runs without the GIL and may hold an allocator lock
(CPython frees its thread state; the C library and ASan's allocator hand its caches
back); a worker forked then inherits that lock held and hangs at its first
allocation. Seen under `make test-asan` as a forked worker stuck in a futex in
libasan's allocator region, after hundreds of loader lifetimes.

The real windows last microseconds, so these tests widen them: the thread is made
to linger before _loop (starting) or after it (exiting), or the fork itself is
slowed while the thread's last job finishes. A wrapper around os.fork (which
multiprocessing's fork start method calls) records the reaper's state at the
moment of each fork, in the parent."""
import gc
import os
import threading
import time

import pytest

from fastloader import DataLoader, reaper
from tests.support import reliability_datasets as rd
from tests.support.helpers import deadline, is_reaped, settle, wait_until


class _Watch:
    """What the reaper thread is doing, recorded by wrappers around reaper._run and
    reaper._loop (both versions of reaper.py call _loop from _run), and the
    reaper's state at each os.fork in this process (the fork start method calls
    os.fork), in the parent, after `before_fork` callbacks ran."""

    def __init__(self):
        self.in_loop = False
        self.tid = None
        self.linger_before_loop = 0.0
        self.linger_after_loop = 0.0
        self.before_fork = []
        self.states = []   # (running, in _loop, the thread exists)

    def thread_alive(self):
        return self.tid is not None and os.path.exists(f"/proc/self/task/{self.tid}")


@pytest.fixture
def watch(monkeypatch):
    w = _Watch()
    real_fork, real_run, real_loop = os.fork, reaper._run, reaper._loop

    def fork():
        for callback in w.before_fork:
            callback()
        w.states.append((reaper._state.running, w.in_loop, w.thread_alive()))
        return real_fork()

    def run(st):
        w.tid = threading.get_native_id()
        time.sleep(w.linger_before_loop)   # started, not yet in _loop
        real_run(st)

    def loop(st):
        w.in_loop = True
        try:
            real_loop(st)
        finally:
            w.in_loop = False
        time.sleep(w.linger_after_loop)   # out of _loop, not yet gone

    settle()   # no reaper thread of an earlier test
    monkeypatch.setattr(os, "fork", fork)
    monkeypatch.setattr(reaper, "_run", run)
    monkeypatch.setattr(reaper, "_loop", loop)
    yield w
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
    watch.linger_after_loop = 0.5   # the exit's window, widened
    reaper.retire(_Job())
    assert wait_until(lambda: not reaper._state.running, 10)
    assert watch.thread_alive() and not watch.in_loop, "the thread should linger"
    _one_epoch()
    assert watch.states, "no fork was seen"
    assert all(in_loop or not alive for _, in_loop, alive in watch.states), \
        f"forked while the reaper thread was exiting: {watch.states}"


def test_no_fork_while_the_reaper_thread_starts(watch):
    watch.linger_before_loop = 0.5   # the start's window, widened
    reaper.retire(_Job())
    assert reaper._state.running and not watch.in_loop
    _one_epoch()
    assert watch.states, "no fork was seen"
    assert all(in_loop or not running for running, in_loop, _ in watch.states), \
        f"forked while the reaper thread was starting: {watch.states}"


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
    running, in_loop, alive = watch.states[0]
    assert running and in_loop and alive, watch.states[0]
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
