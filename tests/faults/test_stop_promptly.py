"""Workers stop when told, as torch's do.

- Told to stop (a framework's `_shutdown_workers()`, `break`, Ctrl-C), a worker
  finishes the batch it is building and skips the tasks queued behind it: it used
  to build every one of them first (prefetch_factor batches per worker), so a
  shutdown waited for batches nobody would take.
- A thread waiting in `w.join()` on a stuck worker does not hold up a shutdown:
  the join held a lock that the shutdown's is_alive() and terminate() wait for,
  so the shutdown waited as long as the join (for ever, without a timeout).
- An iter() whose first tasks fail (a sampler that raises) stops its workers
  then, not when the exception's traceback, which holds the iterator, goes.
"""
import gc
import os
import threading
import time

import pytest
import torch
from torch.utils.data import Dataset, Sampler

from fastloader import DataLoader
from tests.support.fault_helpers import QUIET_WORKER_COUNT_WARNING
from tests.support.helpers import is_gone, wait_until

pytestmark = [QUIET_WORKER_COUNT_WARNING]


class Logged(Dataset):
    """Sample i is [i], after `delay` seconds; each fetch is logged to a file
    (workers are processes). Index `stuck` takes `stuck_s` seconds instead."""

    def __init__(self, log, n=64, delay=0.4, stuck=-1, stuck_s=0.0):
        self.log, self.n, self.delay = log, n, delay
        self.stuck, self.stuck_s = stuck, stuck_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, b"%d %.6f\n" % (i, time.monotonic()))   # (one clock for all processes)
        os.close(fd)
        time.sleep(self.stuck_s if i == self.stuck else self.delay)
        return torch.tensor([i])


def _fetched(log, after=0.0):
    """The indices fetched (from `after` on, by time.monotonic())."""
    with open(log) as f:
        return [int(i) for i, t in (line.split() for line in f) if float(t) >= after]


@pytest.mark.parametrize("ctx", ["fork", "forkserver"])
def test_a_worker_told_to_stop_skips_the_tasks_queued_behind_it(tmp_path, ctx):
    log = str(tmp_path / "fetched")
    workers, prefetch = 2, 4
    # (a sample takes 1 s: a worker that took a task just before it was told has
    # started no other by the time the stop flag is set, however loaded the box)
    loader = DataLoader(Logged(log, delay=1.0), batch_size=1, num_workers=workers,
                        prefetch_factor=prefetch, multiprocessing_context=ctx)
    it = iter(loader)
    assert next(it).tolist() == [[0]]
    told = time.monotonic()
    it._shutdown_workers()   # as Lightning and others call it
    procs = list(it._workers)
    assert all(not p.is_alive() for p in procs)
    # queued then: prefetch_factor per worker and one more, less what was taken.
    # A worker may have taken a task just before it was told, and logs it after.
    started_after = _fetched(log, after=told)
    assert len(started_after) <= workers, (started_after, _fetched(log))
    assert len(_fetched(log)) < workers * prefetch + 1


def test_a_thread_joining_a_stuck_worker_does_not_hold_up_a_shutdown(tmp_path):
    log = str(tmp_path / "fetched")
    loader = DataLoader(Logged(log, delay=0.0, stuck=1, stuck_s=600), batch_size=1,
                        num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    assert next(it).tolist() == [[0]]
    assert wait_until(lambda: os.path.exists(log) and 1 in _fetched(log), 60)
    stuck = it._workers[1]
    joiner = threading.Thread(target=stuck.join, daemon=True)   # no timeout
    joiner.start()
    time.sleep(0.2)
    done = threading.Event()

    def shut():
        it._shutdown_workers()
        done.set()
    threading.Thread(target=shut, daemon=True).start()
    try:
        # the shutdown's grace (5 s), then SIGTERM: well within a minute
        assert done.wait(60), "the shutdown waited for the join"
        joiner.join(30)
        assert not joiner.is_alive()
        assert is_gone(stuck.pid)
    finally:
        if not done.is_set():
            os.kill(stuck.pid, 9)


class FailsAfter(Sampler):
    """Yields `good` indices, then raises."""

    def __init__(self, good):
        self.good = good

    def __iter__(self):
        yield from range(self.good)
        raise ValueError("the sampler failed")

    def __len__(self):
        return 64


def test_workers_of_an_iter_whose_first_tasks_fail_stop_with_it(tmp_path):
    log = str(tmp_path / "fetched")
    loader = DataLoader(Logged(log, delay=0.0), sampler=FailsAfter(1), batch_size=1,
                        num_workers=2, multiprocessing_context="fork")
    with pytest.raises(ValueError, match="the sampler failed") as caught:
        iter(loader)
    gc.collect()
    # the traceback (held, as a notebook's sys.last_traceback holds one) keeps the
    # iterator; its workers must be gone all the same
    tb, its = caught.value.__traceback__, []
    while tb is not None:
        its += [v for v in tb.tb_frame.f_locals.values()
                if not isinstance(v, type) and hasattr(v, "worker_pids")]
        tb = tb.tb_next
    assert its, "no frame of the traceback holds the iterator"
    pids = its[0].worker_pids
    assert len(pids) == 2
    assert wait_until(lambda: all(is_gone(pid) for pid in pids), 30), \
        f"the failed iter()'s workers {pids} still run"


@pytest.mark.parametrize("ctx", ["fork", "forkserver"])
def test_a_worker_joined_from_two_threads_keeps_its_exit_status(tmp_path, ctx):
    """With the join's wait outside the lock, two threads read a worker's status at
    once: one of them lost it (forkserver: 255, sticky; fork: 0), and a worker
    killed by SIGKILL read as exited with code 0 in the pool's death message."""
    log = str(tmp_path / "fetched")
    for _ in range(5):
        loader = DataLoader(Logged(log, delay=0.05), batch_size=1, num_workers=2,
                            multiprocessing_context=ctx)
        it = iter(loader)
        next(it)
        w = it._workers[0]
        joiner = threading.Thread(target=w.join, daemon=True)   # as a user's thread might
        joiner.start()
        time.sleep(0.02)
        os.kill(w.pid, 9)
        w.join(30)   # as the pool's death message does
        first = w.exitcode
        joiner.join(30)
        assert (first, w.exitcode) == (-9, -9)
        it._shutdown_workers()


class ForksAHelper(Dataset):
    """Sample i is [i]; the worker first forks a helper that outlives it (it holds
    whatever the worker held, the sentinel pipe's write end among them)."""

    def __init__(self, helper_pid_file):
        self.helper_pid_file = helper_pid_file

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if not os.path.exists(self.helper_pid_file):
            pid = os.fork()
            if pid == 0:
                time.sleep(120)
                os._exit(0)
            with open(self.helper_pid_file, "w") as f:
                f.write(str(pid))
        return torch.tensor([i])


def test_joining_a_dead_worker_returns_while_a_helper_it_forked_lives(tmp_path):
    """join() waited for the sentinel pipe to close: a helper the worker forked
    holds its write end, so a join (and a shutdown, which joins) waited for the
    helper. multiprocessing's join returns once the worker is dead."""
    pid_file = str(tmp_path / "helper")
    loader = DataLoader(ForksAHelper(pid_file), batch_size=1, num_workers=1,
                        multiprocessing_context="fork")
    it = iter(loader)
    next(it)
    def helper_pid():
        if not os.path.exists(pid_file):
            return None
        with open(pid_file) as f:
            text = f.read()
        return int(text) if text else None
    assert wait_until(helper_pid, 60)
    helper = helper_pid()
    try:
        w = it._workers[0]
        os.kill(w.pid, 9)
        done = threading.Event()
        threading.Thread(target=lambda: (w.join(), done.set()), daemon=True).start()
        assert done.wait(30), "join() waited for the worker's helper"
        assert w.exitcode == -9
    finally:
        os.kill(helper, 9)
        it._shutdown_workers()
