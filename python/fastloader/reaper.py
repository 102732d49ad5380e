"""Worker teardown off the training loop's path.

When an epoch ends (or an iterator is dropped), its workers are told to stop and
the loop goes on at once; joining them there would block it for as long as the
workers take to exit (tens of ms on a busy box: the kernel tears down each
forked address space). A retired pool is handed to this module instead: one
thread, alive only while there is something to wait for, waits for the
workers' exits (their sentinels; the wait releases the GIL), lets the pool release
what the workers shared with it, reaps them (no zombie is left), and escalates
to SIGTERM/SIGKILL for a worker that does not stop by its pool's deadline.

A job is any object with ``wait_fds() -> list of fds`` (readable when something
happened), ``step(now) -> bool`` (do what can be done now; True when
finished) and ``abandon()`` (told when its step kept failing and it is given
up). pool.WorkerPool is the only one; this module knows nothing about it.

Interpreter exit waits here (see ``drain``), so no worker outlives the program; a
forked child starts with no jobs and no thread (the parent's are not its own).

No fork of this process (a pool's worker, torch's, the user's) happens while this
thread starts or exits: see ``_before_fork`` for why."""
from __future__ import annotations

import _thread
import os
import threading
import time
from multiprocessing.connection import wait as _wait_fds

from .per_process import PerProcess

__all__ = ["retire", "flush", "wait_idle", "drain", "pending", "busy"]

# How often the thread looks again even if no fd woke it: new jobs, deadlines,
# and a worker whose sentinel the user closed.
_POLL_S = 0.05
# A job whose step keeps failing is given up after this many tries (told so by
# its abandon(); its pool falls back to interpreter exit / garbage collection),
# never retried forever.
_MAX_FAILURES = 3
# When a job's fds were ready but its step could not finish (a join elsewhere
# holds one of its processes), pause this long before looking again: the fds stay
# ready, and waiting on them again at once would spin a CPU.
_RETRY_S = 0.005
# A caller that finishes a retired pool itself, for want of a thread
# (_finish_queued_here), waits at most this long: past the pool's own deadline and
# its SIGTERM and SIGKILL (5 + 1 s by default).
_INLINE_MAX_S = 30.0
# A fork waits at most this long for a thread that is starting or exiting
# (microseconds, normally) before it goes ahead anyway.
_FORK_WAIT_S = 1.0


class _State:
    def __init__(self):
        # Never held across a fork or any wait: a fork's other hooks take the import
        # and logging locks, and a thread holding one of those may run a finalizer
        # (garbage collection) that retires a pool here. Re-entrant: any allocation
        # made while it is held (a set in _tids_alive inside a fork's guard, a list
        # in the reaper thread's loop) may run the garbage collector, and with it an
        # iterator's finalizer that retires its pool (retire() takes this lock) on
        # the same thread; a plain lock hung the process there for ever. Every
        # section below stays consistent when a retire() runs in the middle of it.
        self.lock = threading.RLock()
        # forks under way in this process (_before_fork .. _after_fork_in_parent):
        # meanwhile no thread starts and the one in _loop does not leave it
        self.forking = 0
        self.jobs: list = []
        # jobs being finished by a caller of retire() or wait_idle() itself, where
        # no thread could be started (_finish_queued_here): not idle meanwhile
        self.inline = 0
        self.failures: dict = {}
        self.running = False
        # native id of the thread inside _loop (it holds the GIL or waits for it or
        # for this lock); None while it starts or exits, or when there is none.
        self.loop_tid = None
        self.tids: set = set()   # native ids of reaper threads that may not have exited
        self.idle = threading.Event()
        self.idle.set()


# This process's: a forked child has its own (per_process.py), with no jobs and
# no thread (the parent's are not its own)
_STATE = PerProcess(_State)


# (looked up at each fork, so that tests can observe the moment of the fork)
os.register_at_fork(before=lambda: _before_fork(),
                    after_in_parent=lambda: _after_fork_in_parent())


def retire(job) -> None:
    """Hand `job` to the reaper thread (started if it is not running; during a
    fork, once the fork is done). Where no thread can be started, the job is
    finished here (see _finish_queued_here).

    The thread is started with _thread, not threading.Thread: Thread.start()
    waits until the new thread runs, which on a busy box (the workers that were
    just told to stop are exiting on the same cores) blocked the training loop
    for several ms; here nobody waits for it."""
    st = _STATE.get()
    with st.lock:
        st.jobs.append(job)
        st.idle.clear()
    flush()


def flush() -> None:
    """Start the reaper thread for the queued jobs (during a fork,
    _after_fork_in_parent does), or where none can be started, finish them here.
    retire() ends with it; an epoch calls it before it starts its workers: a pool
    whose retirement found no thread to be had and was left queued (retired
    during an earlier fork, or while this thread held the lock) is finished then,
    so that its workers, unreaped, do not count against the process limit that
    the forks meet (one retired during this epoch's own forks waits for the next
    flush). Nothing to do otherwise."""
    st = _STATE.get()
    with st.lock:
        if not st.jobs or st.running or st.forking:
            return
        try:
            _start_thread(st)
            return
        except (RuntimeError, MemoryError):
            pass   # still none
    _finish_queued_here(st)


def _finish_queued_here(st: _State) -> None:
    """Do the reaper thread's work on this thread, one queued job after another,
    until none is left or a thread runs again: no thread could be started (the
    user's process limit or a cgroup's pids.max counts threads, and was reached).
    Leaving the jobs queued would leave their workers unreaped, and a zombie still
    counts against that limit, so the next epoch's fork would be refused too. The
    training loop waits here, as torch's does for its workers.

    Not while this thread holds st.lock (a garbage collection inside a locked
    section ran an iterator's finalizer that retired its pool): the lock is never
    held across a wait. The jobs then stay queued for the next retire(), flush()
    or wait_idle(), or interpreter exit. A job that is not finished (interrupted,
    or past _INLINE_MAX_S) goes back to the queue, and this returns."""
    if st.lock._is_owned():
        return
    while True:
        job, finished = None, False
        try:
            with st.lock:
                if st.running or not st.jobs:
                    return   # a thread took over, or nothing is left
                # (no call among these three: a Ctrl-C is raised only after a call
                # returns, so it finds the job either queued or taken and counted)
                job = st.jobs[0]
                st.inline += 1
                del st.jobs[0]
            finished = _finish_here(st, job)
        finally:
            if job is not None:
                # before anything that calls (see above); list.append is atomic
                # under the GIL, and a thread looking meanwhile finds it queued
                st.inline -= 1
                if not finished:
                    st.jobs.append(job)
                with st.lock:
                    _set_idle_if_done(st)
        if not finished:
            return


def _finish_here(st: _State, job) -> bool:
    """Wait for `job` and step it until it is finished, on this thread; False if
    that took longer than _INLINE_MAX_S (a worker that SIGKILL does not end:
    uninterruptible sleep)."""
    give_up = time.monotonic() + _INLINE_MAX_S
    while True:
        ready = _wait_for([job])
        now = time.monotonic()
        if _step(st, job, now):
            return True
        if now >= give_up:
            return False
        if ready:
            time.sleep(_RETRY_S)


def _wait_for(jobs) -> list:
    """Wait at most _POLL_S for something to happen to one of `jobs` (their
    wait_fds); the fds that are ready."""
    fds = []
    for job in jobs:
        try:
            fds.extend(job.wait_fds())
        except Exception:
            pass
    try:
        if fds:
            return _wait_fds(fds, _POLL_S)
        time.sleep(_POLL_S)
    except (OSError, ValueError):   # an fd closed under us: look again shortly
        time.sleep(0.001)
    return []


def _step(st: _State, job, now: float) -> bool:
    """job.step(now); True when the job is finished, or given up after its step
    failed _MAX_FAILURES times (then told so by abandon())."""
    try:
        done = job.step(now)
    except Exception:
        st.failures[id(job)] = st.failures.get(id(job), 0) + 1
        done = st.failures[id(job)] >= _MAX_FAILURES
        if done:
            _abandon(job)
    if done:
        st.failures.pop(id(job), None)
    return done


def _set_idle_if_done(st: _State) -> None:
    # (st.lock held)
    if not st.jobs and not st.running and not st.inline:
        st.idle.set()


def _abandon(job) -> None:
    try:
        job.abandon()
    except Exception:
        pass   # nothing more to do for it here


def _start_thread(st: _State) -> None:
    # (st.lock held)
    if not st.running:
        st.running = True
        try:
            _thread.start_new_thread(_run, (st,))
        except (RuntimeError, MemoryError):   # not started ("can't start new thread");
            st.running = False   # any other exception came after the start
            raise


def pending() -> int:
    """How many retired pools are still being waited for."""
    st = _STATE.get()
    with st.lock:
        return len(st.jobs) + st.inline


def busy() -> bool:
    """Whether a reaper thread may exist now."""
    st = _STATE.get()
    with st.lock:
        return st.running or bool(st.tids and _tids_alive(st))


def _before_fork() -> None:
    """Wait until no reaper thread is starting or exiting, and keep it so until the
    fork is done (`forking`).

    The thread starts and exits without the GIL: CPython frees its thread state,
    and the C library and an instrumented allocator (ASan) hand the thread's caches
    back, taking allocator locks. A fork at that moment leaves the child with a lock
    that no thread of it will ever release, and the child hangs at its first
    allocation: seen under `make test-asan` (GCC 12's libasan does not take its
    allocator locks around fork). Inside _loop the thread holds the GIL (which the
    forking thread holds at the fork) or waits in the kernel (poll, waitpid,
    sleep, a lock), with no allocator lock held. One thread may still be exiting
    while the next one loops: both are looked at. Runs for every fork of the
    process (an at-fork hook registered at import; Python runs `before` hooks in
    reverse order of registration, so hooks registered later run before it)."""
    st = _STATE.get()
    with st.lock:
        st.forking += 1
    end = None
    while True:
        with st.lock:
            if _quiet(st):
                return
        now = time.monotonic()
        end = end or now + _FORK_WAIT_S
        if now >= end:   # never expected: fork anyway
            return
        time.sleep(0.0002)   # releases the GIL: the thread can get on


def _after_fork_in_parent() -> None:
    st = _STATE.get()
    with st.lock:
        st.forking = max(0, st.forking - 1)
        if st.jobs and not st.forking:
            try:
                _start_thread(st)   # retired during the fork
            except (RuntimeError, MemoryError):
                pass   # stays queued: the next retire() or wait_idle() starts it


def _quiet(st: _State) -> bool:
    """(st.lock held) No reaper thread is starting or exiting: the one in _loop,
    if any, is the only one alive."""
    if st.running and st.loop_tid is None:
        return False   # starting
    _tids_alive(st)
    return not (st.tids - {st.loop_tid})


def _tids_alive(st: _State) -> bool:
    st.tids = {tid for tid in st.tids if os.path.exists(f"/proc/self/task/{tid}")}
    return bool(st.tids)


def wait_idle(timeout: float) -> bool:
    """Wait until every retired pool is finished and the reaper thread has
    exited; False if that took longer than `timeout` seconds."""
    st = _STATE.get()
    end = time.monotonic() + timeout
    # a job queued while no thread could start (see retire): started now, or
    # finished here (bounded by the pools' own deadlines, not by `timeout`)
    flush()
    with st.lock:   # (a Ctrl-C in _finish_queued_here may have left it unset)
        _set_idle_if_done(st)
    if not st.idle.wait(max(0.0, end - time.monotonic())):
        return False
    while True:
        with st.lock:
            if st.jobs or st.inline:
                return False   # retired meanwhile: not idle
            if not _tids_alive(st):
                return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.001)


def drain(timeout: float) -> bool:
    """At interpreter exit: give every retired pool at most `timeout` seconds
    more, then wait for them (see wait_idle)."""
    st = _STATE.get()
    with st.lock:
        jobs = list(st.jobs)
    for job in jobs:
        shorten = getattr(job, "hurry", None)
        if shorten is not None:
            shorten(timeout)
    return wait_idle(timeout + 2.0)


def _run(st: _State) -> None:
    me = _thread.get_native_id()
    try:
        with st.lock:
            st.tids.add(me)
            st.loop_tid = me
        _loop(st)
    except BaseException:   # never expected; the next retire() starts a new thread
        with st.lock:
            st.running = False
            st.loop_tid = None


def _loop(st: _State) -> None:
    while True:
        with st.lock:
            jobs = list(st.jobs)
            # st.jobs, not the copy: a retire() run by a collection during the copy
            # saw this thread running and started none
            if not st.jobs and not st.forking:
                st.running = False
                st.loop_tid = None
                _set_idle_if_done(st)
                return
        ready = _wait_for(jobs)
        now = time.monotonic()
        finished = 0
        for job in jobs:
            if _step(st, job, now):
                finished += 1
                with st.lock:
                    st.jobs.remove(job)
        if ready and not finished:
            time.sleep(_RETRY_S)
