"""Run one out-of-shared-memory scenario in a private mount namespace whose /dev/shm
is a small tmpfs (or, for memfd segments, under a small RLIMIT_FSIZE), and print
one JSON line: what the scenario raised. Used by tests/transport/test_shm_limits.py, which
runs this as a child process so that a SIGBUS kills only the child (and shows as
its exit status) and the mounts never reach the test process.

    python -m tests.support.shm_limits_child SCENARIO [tmpfs size]

Exit status 77: the namespace cannot be made here (not root, no CAP_SYS_ADMIN)."""
import json
import os
import resource
import sys
import time

from tests.support.private_shm import mount_private_dev_shm

SKIP = 77


def private_shm(size: str) -> None:
    """A /dev/shm of this process's own, a fresh tmpfs of `size` (see
    tests/support/private_shm.py); exit SKIP, saying why, where it cannot be made."""
    try:
        mount_private_dev_shm(size)
    except OSError as exc:
        print(json.dumps({"skip": str(exc)}))
        sys.exit(SKIP)


def fill_shm(leave: int = 0) -> None:
    """Take all of /dev/shm but `leave` bytes, with pages that really exist (and,
    with leave=0, every last page statvfs did not count)."""
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    fd = os.open("/dev/shm/filler", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if free - leave > 0:
            os.posix_fallocate(fd, 0, free - leave)
        if leave == 0:
            size = max(free, 0)
            while True:
                try:
                    os.posix_fallocate(fd, size, 4096)
                except OSError:
                    break
                size += 4096
    finally:
        os.close(fd)


# ---- datasets (module level: spawn workers import them) -----------------------------

class Blobs:
    """`n` samples of `nbytes` bytes each (float32 tensors)."""

    def __init__(self, n, nbytes, first_nbytes=None):
        self.n, self.nbytes, self.first = n, nbytes, first_nbytes or nbytes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch

        size = self.first if i == 0 else self.nbytes
        return torch.full((size // 4,), float(i))


def iterate(loader, hold=True):
    held = []
    for batch in loader:
        if hold:
            held.append(batch)
    return len(held)


# ---- scenarios ----------------------------------------------------------------------

def loader(ds, strategy, **kw):
    from fastloader import DataLoader

    kw.setdefault("num_workers", 1)
    return DataLoader(ds, batch_size=None, sharing_strategy=strategy,
                      multiprocessing_context="fork", **kw)


def control_block(strategy):
    """No room at all: the very first segment, the control block, cannot be made."""
    if strategy == "file_system":
        fill_shm()
    else:
        memfd_limit(16 << 10)
    iterate(loader(Blobs(2, 4096), strategy))


def memfd_limit(nbytes):
    """memfds live on the kernel's internal tmpfs, not in /dev/shm: a file-size
    limit is what makes creating or reserving one fail here (a memory cgroup limit
    fails it the same way, with ENOMEM). The control block (about 1 MiB) fits."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


def arena(strategy):
    """Batches held by the consumer fill /dev/shm slot by slot, then overflow."""
    if strategy == "file_system":
        iterate(loader(Blobs(64, 1 << 20), strategy, prefetch_factor=2))
    else:
        memfd_limit(3 << 19)
        iterate(loader(Blobs(4, 2 << 20), strategy))


def overflow(strategy):
    """A batch bigger than the slots (the arena was sized from a small first one)."""
    if strategy == "file_descriptor":
        memfd_limit(3 << 20)
    iterate(loader(Blobs(3, 6 << 20, first_nbytes=4096), strategy))


def packed_build(strategy):
    from fastloader import PackedStringArray

    if strategy == "file_descriptor":
        memfd_limit(1 << 20)
    PackedStringArray((f"{i:08d}-" + "x" * 200 for i in range(40000)),
                      sharing_strategy=strategy)


def packed_share(strategy):
    from fastloader import PackedArray

    a = PackedArray([{"i": i, "pad": "y" * 100} for i in range(15000)],
                    sharing_strategy="file_descriptor" if strategy == "file_system"
                    else "file_system")
    if strategy == "file_system":
        fill_shm()
    else:
        memfd_limit(64 << 10)
    a.share(strategy)


class KeyLengths:
    """Samples keyed by strings: a batch of keys is pickled into the task ring."""

    def __getitem__(self, key):
        import torch

        return torch.tensor(len(key))


def task_ring(strategy):
    """Tasks reaching past the part of the task ring reserved when the control
    block was made (only its first chunk is), once /dev/shm is full: the tasks
    before them were small, the next ones are pickled batches of ~150 KB of keys.
    Returns what each next() gave: a batch's sum, or the error's type and text.
    memfd pages are not in /dev/shm: there the big tasks must simply go through."""
    import time

    from fastloader import DataLoader

    small = [["k"] * 4] * 2
    big = [[f"{i:06d}" + "x" * 1500 for i in range(100)]] * 4
    it = iter(DataLoader(KeyLengths(), batch_sampler=small + big, num_workers=1,
                         prefetch_factor=2, sharing_strategy=strategy,
                         multiprocessing_context="fork"))
    # both small batches published: the worker's arena exists and holds their slots
    deadline = time.monotonic() + 120
    while it.stats(memory=False)["workers"][0]["published"] < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("the worker did not publish the small batches")
        time.sleep(0.01)
    if strategy == "file_system":
        fill_shm()
    got = []
    while True:
        try:
            got.append(int(next(it).sum()))
        except StopIteration:
            return got
        except Exception as exc:   # the caller asserts on each
            got.append([type(exc).__name__, str(exc)])


def scribbled_task_head(strategy):
    """A worker (here: this process, through its own mapping of the shared block)
    moves task_head and task_tail to the ring's last record (an empty ring, whose
    next record would wrap: a pad record goes there first), a page never reserved,
    and /dev/shm is full: the main process must not write there (it keeps its own
    head), and says the ring is corrupt instead."""
    import struct

    from fastloader import DataLoader
    from tests.support.ring_geometry_child import control_blocks

    # batches of 2: a task record is 64 bytes, so one at the ring's last 32 bytes
    # wraps, and a pad record is written there first
    loader = DataLoader(Blobs(80, 256), batch_size=2, num_workers=1,
                        sharing_strategy=strategy, multiprocessing_context="fork")
    it = iter(loader)
    got = [float(next(it)[0][0]) for _ in range(3)]
    (ctl,) = control_blocks()
    task_cap, = struct.unpack_from("<Q", ctl, 16)
    # Wait until the worker has taken every task sent so far and sleeps for more
    # (task_tail == task_head, worker_waiting set: csrc/ring.h's fl_ctl), so all it
    # had to publish is published. Scribbled earlier, on a busy box, the ring looked
    # empty to a worker still owing batches: it waited for tasks and the main
    # process for its batches, for ever (a worker that stops, which only a timeout
    # catches, as in torch); or it made a segment after the fill (ENOSPC in CI).
    deadline = time.monotonic() + 120
    while (struct.unpack_from("<Q", ctl, 64) != struct.unpack_from("<Q", ctl, 128)
           or struct.unpack_from("<I", ctl, 512) != (1,)):
        if time.monotonic() > deadline:
            raise AssertionError("the worker did not go idle within 120 s")
        time.sleep(0.01)
    task_tail, = struct.unpack_from("<Q", ctl, 128)
    fill_shm()
    last = task_tail - task_tail % task_cap + 2 * task_cap - 32
    struct.pack_into("<Q", ctl, 128, last)   # task_tail
    struct.pack_into("<Q", ctl, 64, last)    # task_head
    for batch in it:
        got.append(float(batch[0][0]))
    return got


def next_epoch_after_release(strategy):
    """A persistent worker gives its free slots' pages back between epochs; when
    /dev/shm is full at the next epoch's start, even the worker's acknowledgement
    of TASK_RESUME (its RNG state) needs a new page: it must not kill the worker (it
    did, found by review: "exited unexpectedly"). iter() raises MemoryError, and
    once memory is free again the next iter() runs the epoch with the same worker.
    Returns (first epoch, iter()'s error, the epoch after, same worker)."""
    import time

    from fastloader import DataLoader

    loader = DataLoader(Blobs(4, 256 << 10), batch_size=None, num_workers=1,
                        persistent_workers=True, sharing_strategy=strategy,
                        multiprocessing_context="fork")
    it = iter(loader)
    first = [float(b[0]) for b in it]
    pid = it.worker_pids[0]
    deadline = time.monotonic() + 120
    while it.stats(memory=False)["workers"][0]["arena_reserved_bytes"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the idle worker kept its slots' pages")
        time.sleep(0.05)
    fill_shm()
    error = None
    try:
        iter(loader)
    except MemoryError as exc:
        error = ["MemoryError", str(exc)]
    os.unlink("/dev/shm/filler")
    it = iter(loader)
    return first, error, [float(b[0]) for b in it], it.worker_pids == [pid]


SCENARIOS = {f.__name__: f for f in (control_block, arena, overflow, packed_build,
                                     packed_share, task_ring, scribbled_task_head,
                                     next_epoch_after_release)}


def main():
    name, strategy = sys.argv[1], sys.argv[2]
    size = sys.argv[3] if len(sys.argv) > 3 else "4m"
    private_shm(size)
    try:
        value = SCENARIOS[name](strategy)
    except BaseException as exc:   # reported to the parent, which asserts on it
        print(json.dumps({"type": type(exc).__name__, "message": str(exc)}))
        return
    print(json.dumps({"type": None, "message": "no exception", "value": value}))


if __name__ == "__main__":
    main()
