"""per_process.PerProcess: a forked child gets its own value, made on first use;
and the module state built on it (pool, reaper, forkserver) is the child's own."""
import os
import threading
import time

import fastloader
from fastloader import forkserver, pool, reaper
from fastloader.per_process import PerProcess

from tests.support import datasets as ds
from tests.support.helpers import in_forked_child


class Made:
    count = 0

    def __init__(self):
        Made.count += 1
        self.serial = Made.count
        self.pid = os.getpid()


def test_a_forked_child_makes_its_own_value_and_the_parent_keeps_its():
    local = PerProcess(Made)
    mine = local.get()
    assert local.get() is mine and mine.pid == os.getpid()

    def child():
        theirs = local.get()
        return theirs is not mine, theirs.pid, local.get() is theirs, mine.pid

    fresh, pid, stable, parents_pid = in_forked_child(child)
    assert fresh and stable and pid != os.getpid() and parents_pid == os.getpid()
    assert local.get() is mine   # the child's use left the parent's value alone


def test_a_grandchild_takes_neither_its_parents_nor_its_grandparents_value():
    local = PerProcess(Made)
    top = local.get()

    def child():
        middle = local.get()

        def grandchild():
            own = local.get()
            return own is not middle and own is not top and own.pid == os.getpid()

        return in_forked_child(grandchild), middle is not top

    assert in_forked_child(child) == (True, True)


def test_threads_of_a_child_that_ask_at_once_all_get_one_value():
    made = []

    def slow_factory():
        time.sleep(0.05)   # lets the other threads miss too
        made.append(object())
        return made[-1]

    local = PerProcess(slow_factory)

    def child():
        got = []
        start = threading.Barrier(8)

        def ask():
            start.wait()
            got.append(local.get())

        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return len(got), len({id(v) for v in got}), got[0] is local.get()

    assert in_forked_child(child) == (8, 1, True)


class _Pending:
    """A retired job (reaper.py) that stays pending until `release` is set."""

    def __init__(self):
        self.release = threading.Event()

    def wait_fds(self):
        return []

    def step(self, now):
        return self.release.is_set()


def test_a_child_forked_beside_live_workers_has_none_of_the_parents_state(monkeypatch):
    """The parent's pool, its channels' fds, its worker count, the reaper's jobs
    and the forkserver warm-up are not the child's; a loader made in the child
    runs with state of its own."""
    loader = fastloader.DataLoader(ds.TensorLabelDataset(16), batch_size=4, num_workers=2,
                                   persistent_workers=True, multiprocessing_context="fork")
    job = _Pending()
    it = iter(loader)
    try:
        next(it)
        reaper.retire(job)
        monkeypatch.setattr(forkserver._WARMED.get(), "pid", -1)
        assert pool.live_workers() >= 2 and pool.main_fds() and reaper.pending() >= 1
        parents = (pool._LIVE.get(), reaper._STATE.get(), forkserver._WARMED.get())

        def child():
            seen = (pool.live_workers(), set(pool.main_fds()), reaper.pending(),
                    forkserver._WARMED.get().pid,
                    [mine is not theirs for mine, theirs in
                     zip((pool._LIVE.get(), reaper._STATE.get(), forkserver._WARMED.get()),
                         parents)])
            child_loader = fastloader.DataLoader(ds.TensorLabelDataset(16), batch_size=4,
                                                 num_workers=2, multiprocessing_context="fork")
            batches = sum(1 for _ in child_loader)
            assert reaper.wait_idle(30)
            return seen, batches, pool.live_workers()

        seen, batches, after = in_forked_child(child)
        assert seen == (0, set(), 0, None, [True, True, True])
        assert batches == 4 and after == 0
        # the parent's are as they were
        assert (pool._LIVE.get(), reaper._STATE.get(), forkserver._WARMED.get()) == parents
        assert pool.live_workers() >= 2 and reaper.pending() >= 1
        assert forkserver._WARMED.get().pid == -1
    finally:
        job.release.set()
        del it, loader   # the loader holds its persistent iterator
        assert reaper.wait_idle(30)
