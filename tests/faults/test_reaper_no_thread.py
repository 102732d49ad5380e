"""The reaper (reaper.py) where no thread can be started (the process limit
counts threads): a retired job is finished by the caller, counted as pending
meanwhile; one retired while the caller holds the reaper's lock stays queued
until flush(); an interrupted one goes back to the queue. Run in a forked child:
its reaper state is its own, with no thread of an earlier test's pools."""
import _thread
import os

import psutil
import torch
from torch.utils.data import TensorDataset

import fastloader
from fastloader import reaper
from tests.support.helpers import in_forked_child


class _Job:
    """Finished at its `steps`th step; raises KeyboardInterrupt at step `interrupt_at`."""

    def __init__(self, steps=3, interrupt_at=None):
        self.steps = steps
        self.interrupt_at = interrupt_at
        self.calls = 0
        self.pending_seen = []

    def wait_fds(self):
        return []

    def step(self, now):
        self.calls += 1
        self.pending_seen.append(reaper.pending())
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        return self.calls >= self.steps

    def abandon(self):
        raise AssertionError("not given up")


def _no_thread(*args):
    raise RuntimeError("can't start new thread")


def _scenario():
    _thread.start_new_thread = _no_thread   # this child's own module
    state = reaper._STATE.get()
    out = {}

    job = _Job()
    reaper.retire(job)   # finished here, before retire() returns
    out["inline"] = (job.calls, job.pending_seen, reaper.pending(), state.idle.is_set())

    late = _Job()
    with state.lock:   # as a finalizer run by a collection inside a locked section
        reaper.retire(late)
    out["under_lock"] = (late.calls, reaper.pending(), state.idle.is_set())
    reaper.flush()
    out["flushed"] = (late.calls, reaper.pending(), state.idle.is_set())

    cut = _Job(interrupt_at=2)
    try:
        reaper.retire(cut)
        out["interrupted"] = "not interrupted"
    except KeyboardInterrupt:
        out["interrupted"] = (cut.calls, reaper.pending(), state.idle.is_set())
    out["waited"] = (reaper.wait_idle(5), cut.calls, reaper.pending())
    return out


def test_no_thread_to_be_had():
    got = in_forked_child(_scenario)
    # 3 steps here, the job counted as pending throughout; idle after
    assert got["inline"] == (3, [1, 1, 1], 0, True)
    assert got["under_lock"] == (0, 1, False)   # no wait while the lock is held
    assert got["flushed"] == (3, 0, True)
    assert got["interrupted"] == (2, 1, False)   # back in the queue, not idle
    assert got["waited"] == (True, 3, 0)   # wait_idle() finished it at its 3rd step


def _stranded_pool_then_next_epoch():
    _thread.start_new_thread = _no_thread   # this child's own module
    loader = fastloader.DataLoader(TensorDataset(torch.arange(20.0)), batch_size=5,
                                   num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    next(it)
    with reaper._STATE.get().lock:
        del it   # its finalizer retires the pool, which is left queued (lock held)
    queued = reaper.pending()
    seen, real_fork = [], os.fork

    def fork_seeing_the_queue():
        seen.append(reaper.pending())
        return real_fork()

    os.fork = fork_seeing_the_queue
    try:
        batches = [b.tolist() for (b,) in loader]
    finally:
        os.fork = real_fork
    return queued, seen, batches, reaper.pending(), psutil.Process().children()


def test_the_next_epoch_reaps_a_pool_left_queued_before_it_forks():
    queued, seen, batches, pending, children = in_forked_child(_stranded_pool_then_next_epoch)
    assert queued == 1
    assert seen == [0, 0], "the old workers were still unreaped at the new forks"
    assert batches == [[float(i) for i in range(k, k + 5)] for k in range(0, 20, 5)]
    assert (pending, children) == (0, [])
