"""After a worker's death or Ctrl-C has stopped an epoch's workers: the iterator says
so once, in words, then ends (it raised "ValueError: channel is closed" on every
later next(), forever), and a loader with persistent workers starts its next epoch
with new ones, as iter() does after Ctrl-C with torch (it raised that ValueError)."""
import gc
import os
import signal
import threading
import time

import pytest
import torch
from torch.utils.data import Dataset

import fastloader
from fastloader import DataLoader, WorkerError
from tests.support.fault_helpers import QUIET_WORKER_COUNT_WARNING, workers_cannot_start
from tests.support.helpers import collect, deadline, is_gone, wait_until

pytestmark = [QUIET_WORKER_COUNT_WARNING]


class DiesOnce(Dataset):
    """Sample i is [i]; the worker that first gets index `at` exits with code 3
    (forked workers only: it is not importable)."""

    def __init__(self, marker, n=12, at=5):
        self.marker, self.n, self.at = marker, n, at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(3)
        return torch.tensor([i])


def _until_error(it):
    got = []
    with deadline(60):
        while True:
            try:
                got.append(int(next(it)))
            except WorkerError as error:
                return got, error


def test_after_a_workers_death_next_says_the_workers_were_stopped_then_ends(tmp_path):
    loader = DataLoader(DiesOnce(str(tmp_path / "died")), batch_size=1, num_workers=2,
                        multiprocessing_context="fork")
    it = iter(loader)
    got, error = _until_error(it)
    assert got == list(range(len(got))) and len(got) <= 5
    with pytest.raises(RuntimeError, match=r"its workers were stopped after DataLoader "
                                           r"worker 1 \(pid \d+\) exited unexpectedly"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    # the epoch did not end: a checkpoint taken now resumes within it
    state = it.state_dict()
    assert state["epoch_done"] is False and state["next_seq"] == len(got)


@pytest.fixture(params=["fastloader", "install"])
def Loader(request):
    """fastloader.DataLoader, and torch's under install(): torch's own __iter__ then
    resets the stopped persistent iterator (it raised "ValueError: channel is
    closed" at every later epoch)."""
    if request.param == "fastloader":
        yield DataLoader
        return
    fastloader.install()
    try:
        yield torch.utils.data.DataLoader
    finally:
        fastloader.uninstall()


def test_persistent_workers_stopped_by_a_death_are_replaced_at_the_next_epoch(tmp_path, Loader):
    loader = Loader(DiesOnce(str(tmp_path / "died")), batch_size=1, num_workers=2,
                    multiprocessing_context="fork", persistent_workers=True)
    it = iter(loader)
    first_pids = list(it.worker_pids)
    _until_error(it)
    again = iter(loader)
    assert not set(again.worker_pids) & set(first_pids)
    assert [int(b) for b in collect(again)] == list(range(12))
    assert [int(b) for b in collect(loader)] == list(range(12))   # and they persist
    assert loader._iterator is again
    pids = list(again.worker_pids)
    assert [int(b) for b in collect(loader)] == list(range(12))
    assert list(loader._iterator.worker_pids) == pids


class SlowFirst(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i == 0 and not getattr(self, "slept", False):
            time.sleep(8)
        return torch.tensor([i])


def test_persistent_workers_stopped_by_ctrl_c_are_replaced_at_the_next_epoch(Loader):
    # as in test_interrupts: no collector run (a finalizer could take the
    # KeyboardInterrupt) and SIGINT handled even in a run started in the background
    gc.collect()
    gc.disable()
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    loader = Loader(SlowFirst(), batch_size=1, num_workers=1,
                    multiprocessing_context="fork", persistent_workers=True)
    it = iter(loader)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with deadline(30), pytest.raises(KeyboardInterrupt):
            next(it)
            time.sleep(0.1)   # a late KeyboardInterrupt still lands inside this block
    finally:
        timer.cancel()
        gc.enable()
        signal.signal(signal.SIGINT, old_handler)
    with pytest.raises(RuntimeError, match="its workers were stopped after KeyboardInterrupt"):
        next(it)
    loader.dataset.slept = True   # the new workers are forked with it
    assert [int(b) for b in collect(loader)] == list(range(6))
    assert [int(b) for b in collect(loader)] == list(range(6))


def test_a_revival_that_fails_is_tried_again_at_the_next_epoch(tmp_path, monkeypatch):
    """install(): starting the new workers failed once (no fds, processes or memory
    left): the iterator kept its closed channels and every later epoch raised
    "ValueError: channel is closed"."""
    fastloader.install()
    try:
        loader = torch.utils.data.DataLoader(
            DiesOnce(str(tmp_path / "died")), batch_size=1, num_workers=2,
            multiprocessing_context="fork", persistent_workers=True)
        _until_error(iter(loader))
        with workers_cannot_start(monkeypatch), pytest.raises(OSError, match="Too many"):
            iter(loader)
        assert [int(b) for b in collect(loader)] == list(range(12))
        assert [int(b) for b in collect(loader)] == list(range(12))
    finally:
        fastloader.uninstall()


class _FailsOnce(torch.utils.data.Sampler):
    """0..n-1 in order, but the iteration after `arm()` raises at its first draw."""

    def __init__(self, n):
        self.n, self.armed = n, False

    def __len__(self):
        return self.n

    def __iter__(self):
        if self.armed:
            self.armed = False
            raise RuntimeError("the sampler failed")
        return iter(range(self.n))


def test_a_revival_that_fails_after_its_workers_started_leaves_none_running():
    """install(): the new workers started, then the first tasks failed (the
    sampler raised); the pool was left running, unreachable, to the end."""
    import psutil

    fastloader.install()
    try:
        sampler = _FailsOnce(6)
        loader = torch.utils.data.DataLoader(
            list(range(6)), batch_size=2, num_workers=2, sampler=sampler,
            multiprocessing_context="fork", persistent_workers=True)
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
        loader._iterator._shutdown_workers()
        sampler.armed = True
        before = {p.pid for p in psutil.Process().children()}
        with pytest.raises(RuntimeError, match="the sampler failed"):
            iter(loader)
        started = {p.pid for p in psutil.Process().children()} - before
        assert wait_until(lambda: all(is_gone(pid) for pid in started), 10), started
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    finally:
        fastloader.uninstall()
