"""pool.py under fork: every worker's channel is opened before the first fork, so the
forks follow one another with next to nothing written in between (each page the main
process writes after a fork is a copy-on-write fault); each forked worker still holds
its own channel's fds only, none of its siblings'; and a listed fd number that is
freed while the forks run, and taken by a later fork's own pipe, is left open."""
import os
import stat
import subprocess
import sys
import textwrap

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


# Loader A's epoch is dropped while its workers are stopped (SIGSTOP), so the reaper
# thread waits for them. During loader B's forks, right after the first, A's workers
# are killed and the reaper closes A's channel fds, whose numbers are in the list of
# fds B's workers close at start. The lowest of them go to the pipes multiprocessing
# makes for B's next worker, which must not close its own end of the pipe its parent
# watches (it would read as exited while it runs). (In a fresh interpreter, so that
# fd numbers are given out the same way each time.)
PAUSED_STEPS_SCRIPT = textwrap.dedent("""
    import os, select, signal, time
    import fastloader

    def loader():
        return fastloader.DataLoader(list(range(64)), batch_size=4, num_workers=2,
                                     multiprocessing_context="fork")

    it = iter(loader())
    next(it)
    pool_a, pids_a = it._pool, list(it._pool.pids)
    for pid in pids_a:
        os.kill(pid, signal.SIGSTOP)
    try:
        del it   # retired: the reaper thread waits for A's workers
        assert fastloader.reaper.pending() == 1, "A's pool was not retired"
    except BaseException:
        for pid in pids_a:
            os.kill(pid, signal.SIGKILL)
        raise

    real_fork, released = os.fork, []

    def fork():
        pid = real_fork()
        if pid and not released:
            for a in pids_a:
                os.kill(a, signal.SIGKILL)
            end = time.monotonic() + 2.0   # the reaper's step takes milliseconds
            while not pool_a._channels_released and time.monotonic() < end:
                time.sleep(0.01)
            released.append(pool_a._channels_released)
        return pid

    os.fork = fork
    it = iter(loader())
    os.fork = real_fork
    ready = select.select([w.sentinel for w in it._workers], [], [], 0.5)[0]
    alive = [w.is_alive() for w in it._workers]
    batches = [b.tolist() for b in it]
    print("released during the forks:", released[0])
    print("sentinels ready:", len(ready), "alive:", alive)
    assert batches == [list(range(i, i + 4)) for i in range(0, 64, 4)], batches
    print("ok")
""")


def test_a_number_freed_while_the_workers_are_forked_is_not_closed_by_a_worker(subprocess_env):
    result = subprocess.run([sys.executable, "-c", PAUSED_STEPS_SCRIPT], env=subprocess_env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "released during the forks: True",   # the numbers were freed: the case arose
        "sentinels ready: 0 alive: [True, True]",
        "ok",
    ], result.stdout + result.stderr


def test_a_worker_closes_a_listed_number_only_where_it_names_what_was_listed():
    """Another thread may close a listed fd before a later fork, and that fork's own
    pipe may take the number: the worker must leave it open."""
    from fastloader.worker import close_inherited_fds

    def listed(fd):
        st = os.fstat(fd)
        return (fd, st.st_dev, st.st_ino)

    gone_r, gone_w = os.pipe()
    kept_r, kept_w = os.pipe()
    entries = [listed(gone_r), listed(kept_r)]
    os.close(gone_r)
    os.close(gone_w)
    reused_r, reused_w = os.pipe()   # takes the lowest free numbers: gone_r's among them
    try:
        assert gone_r in (reused_r, reused_w)
        close_inherited_fds(entries, keep=set())
        os.fstat(reused_r)   # still open (raises if it was closed)
        os.fstat(reused_w)
        with pytest.raises(OSError):
            os.fstat(kept_r)   # listed and unchanged: closed
    finally:
        for fd in (kept_w, reused_r, reused_w):
            os.close(fd)
