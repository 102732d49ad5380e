"""pool.py under fork: every worker's channel is opened before the first fork, so the
forks follow one another with next to nothing written in between (each page the main
process writes after a fork is a copy-on-write fault); and each forked worker still
holds its own channel's fds only, none of its siblings'."""
import os
import stat

import pytest

import fastloader
from fastloader import _core
from torch.utils.data import Dataset, get_worker_info

WORKERS = 3   # more than this box's CPUs: torch's warning about it is expected
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class Recorder:
    """Records, in the process that made it, each channel opened and each fork."""

    def __init__(self, monkeypatch):
        self.events = []
        self.pid = os.getpid()
        real_channel, real_fork = _core.MainChannel, os.fork

        def channel(*args, **kwargs):
            self.events.append("channel")
            return real_channel(*args, **kwargs)

        def fork():
            pid = real_fork()
            if pid != 0:
                self.events.append("fork")
            return pid

        monkeypatch.setattr(_core, "MainChannel", channel)
        monkeypatch.setattr(os, "fork", fork)


def test_every_channel_is_opened_before_the_first_fork(monkeypatch):
    recorder = Recorder(monkeypatch)
    loader = fastloader.DataLoader(list(range(12)), batch_size=2, num_workers=WORKERS,
                                   multiprocessing_context="fork")
    batches = [b.tolist() for b in loader]
    assert batches == [[i, i + 1] for i in range(0, 12, 2)]
    assert recorder.events == ["channel"] * WORKERS + ["fork"] * WORKERS


def _sockets(pid="self"):
    """Inodes of the sockets open in process `pid`."""
    inodes = set()
    base = f"/proc/{pid}/fd"
    for name in os.listdir(base):
        try:
            st = os.stat(os.path.join(base, name))
        except OSError:   # closed meanwhile (the listing's own fd)
            continue
        if stat.S_ISSOCK(st.st_mode):
            inodes.add(st.st_ino)
    return inodes


class SocketReport(Dataset):
    """Each sample: (worker id, inodes of the sockets open in the worker)."""

    def __len__(self):
        return 2 * WORKERS

    def __getitem__(self, index):
        return get_worker_info().id, sorted(_sockets())


@pytest.mark.parametrize("num_workers", [2, WORKERS])
def test_a_forked_worker_holds_none_of_its_siblings_channel_fds(num_workers):
    before = _sockets()   # what every worker inherits from this process
    loader = fastloader.DataLoader(SocketReport(), batch_size=None, num_workers=num_workers,
                                   multiprocessing_context="fork")
    own = {}
    for wid, sockets in loader:
        own.setdefault(wid, set()).update(set(sockets) - before)
    assert sorted(own) == list(range(num_workers))
    # each worker holds one socket of its own, its channel's end, and no sibling's
    assert all(len(s) == 1 for s in own.values()), own
    assert len(set().union(*own.values())) == num_workers, own
