"""Datasets and worker hooks for the failure-contract tests in tests/faults/.

Module level, so that "spawn" workers unpickle them as
``tests.support.reliability_datasets.<name>``. Every value encodes its sample index, so a
torn, stale or overwritten batch shows up as a wrong value, never as noise.
"""
import ctypes
import mmap
import os
import resource
import signal
import tempfile
import time

import torch
from torch.utils.data import Dataset


def _quiet_crash_setup():
    """A deliberate crash: no core file, no faulthandler dump on stderr."""
    try:
        import faulthandler
        faulthandler.disable()
    except ImportError:  # pragma: no cover
        pass
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ValueError, OSError):
        pass


def _stamp(path):
    """Record (atomically) the CLOCK_MONOTONIC time of this moment: system-wide, so
    the test process can compare it with its own clock."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(repr(time.monotonic()))
    os.replace(tmp, path)


def _real_sigsegv():
    ctypes.string_at(8)   # read from an unmapped page


def _real_sigbus():
    # A shared mapping of a file that then shrinks: touching the vanished page
    # raises SIGBUS, as a full /dev/shm does for torch's workers.
    fd, path = tempfile.mkstemp(prefix="rel_sigbus_", dir="/dev/shm")
    try:
        os.ftruncate(fd, 2 * mmap.PAGESIZE)
        m = mmap.mmap(fd, 2 * mmap.PAGESIZE)
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
        os.unlink(path)
    m[mmap.PAGESIZE]   # noqa: B018 - the access is the point


class DieWhileMainWaitsDataset(Dataset):
    """Index `at` sleeps `sleep_s` (the main process is blocked waiting for it by then),
    stamps the time of death into `stamp_path`, then dies: how = "SIGSEGV" (a real
    invalid read), "SIGBUS" (a real access past the end of a shrunk shared mapping),
    "SIGKILL" (sent to itself) or "exit<code>" (os._exit). With how="sleep" it only
    sleeps (long), for a killer outside the worker. Index `slow_at` (if given) sleeps
    `slow_s`: a sibling busy in a long sample while the other worker dies. Other
    indices are instant."""

    def __init__(self, n=40, at=5, sleep_s=0.6, how="SIGSEGV", stamp_path=None,
                 slow_at=None, slow_s=20.0):
        self.n = n
        self.at = at
        self.sleep_s = sleep_s
        self.how = how
        self.stamp_path = stamp_path
        self.slow_at = slow_at
        self.slow_s = slow_s

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if index == self.slow_at:
            time.sleep(self.slow_s)
        if index == self.at:
            _quiet_crash_setup()
            if self.how == "sleep":
                if self.stamp_path:
                    _stamp(self.stamp_path)   # "I am in the slow sample now"
                time.sleep(self.sleep_s)
                return torch.tensor([index])
            time.sleep(self.sleep_s)
            _stamp(self.stamp_path)
            if self.how.startswith("exit"):
                os._exit(int(self.how[4:]))
            elif self.how == "SIGSEGV":
                _real_sigsegv()
            elif self.how == "SIGBUS":
                _real_sigbus()
            os.kill(os.getpid(), getattr(signal, self.how))
            time.sleep(60)  # a signal sent to oneself is delivered before kill() returns
        return torch.tensor([index])


import tests.support.datasets as _common  # noqa: E402

# the same as tests.support.datasets.SleepAtDataset
from tests.support.datasets import SleepAtDataset as SleepAtIndexDataset  # noqa: E402,F401


class SlowDataset(_common.SlowDataset):
    """tests.support.datasets.SlowDataset with a 64-int sample (the index in every element)
    and its label."""

    def __init__(self, n=100_000, delay=0.01):
        super().__init__(n, delay)

    def __getitem__(self, index):
        one = super().__getitem__(index)   # sleeps `delay`
        return one.expand(64).clone(), index


class SmallDataset(Dataset):
    """A few int64s per sample, each equal to index * 10 + position."""

    def __init__(self, n=64, width=4):
        self.n = n
        self.width = width

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return torch.arange(self.width, dtype=torch.int64) + index * 10, index


class BigDataset(Dataset):
    """`numel` int32 elements per sample, all equal to the index (a torn or stale
    slot is visible anywhere in it)."""

    def __init__(self, n=64, numel=256 * 1024):
        self.n = n
        self.numel = numel

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return torch.full((self.numel,), index, dtype=torch.int32), index


class GrowingDataset(Dataset):
    """Samples that grow over the epoch: index i has 256 * (1 + i // step)**2 int64
    elements, all equal to i, so later batches outgrow the ring's slots (with `step` a
    multiple of the batch size, the samples of one batch have one size)."""

    def __init__(self, n=144, step=48):
        self.n = n
        self.step = step

    def __len__(self):
        return self.n

    def numel(self, index):
        return 256 * (1 + index // self.step) ** 2

    def __getitem__(self, index):
        return torch.full((self.numel(index),), index, dtype=torch.int64), index


class UnpicklableDataset(Dataset):
    """Sample `bad` holds an object that pickle refuses (a generator); use with
    list_collate so that the batch stays a list of samples."""

    def __init__(self, n=16, bad=5):
        self.n = n
        self.bad = bad

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if index == self.bad:
            return {"index": index, "payload": (i for i in range(3))}
        return {"index": index, "payload": index}


from tests.support.datasets import list_collate  # noqa: E402,F401  (keep the batch a list)


def dict_collate(batch):
    """Not the default collate: the codec copies each tensor into the slot itself
    (instead of torch.stack writing straight into it)."""
    xs, ys = zip(*batch)
    return {"x": torch.stack(xs), "index": torch.tensor(ys), "n": len(batch)}


FSIZE_LIMIT = 1 << 20


def limit_file_size_init(worker_id):
    """Shared segments count as files: with RLIMIT_FSIZE at 1 MiB, creating a bigger
    one fails (EFBIG) as it would when the memory for it is exhausted. (Python starts
    with SIGXFSZ ignored, so the worker is not killed by it.)"""
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, resource.RLIM_INFINITY))


def no_files_init(worker_id):
    """RLIMIT_FSIZE at 0: the worker can create no shared segment at all, not even
    one for an error."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))


def _sleep_at_exit(seconds, marker=None):
    time.sleep(seconds)
    if marker is not None:   # the exit's work got done
        with open(f"{marker}.{os.getpid()}", "w"):
            pass


def slow_exit_init(seconds, worker_id, marker=None):
    """worker_init_fn (bind `seconds`, and `marker` if wanted, with
    functools.partial): the worker's exit then takes `seconds` (a multiprocessing
    finalizer run as the process exits), as a worker tearing down a big address
    space or flushing a dataset's files does; at its end it creates the file
    `{marker}.{pid}`."""
    from multiprocessing import util

    util.Finalize(None, _sleep_at_exit, args=(seconds, marker), exitpriority=0)


class CtrlCWhenPickled(Dataset):
    """Sends this process a SIGINT while it is pickled for a spawned worker, once
    armed: a Ctrl-C that lands while the loader starts its workers."""

    def __init__(self, n):
        self.n = n
        self.armed = False

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i

    def __getstate__(self):
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), signal.SIGINT)
        return {"n": self.n, "armed": False}
