"""Shared-memory limits: running out is a MemoryError naming the size, never a SIGBUS;
a fork made after a loader started inherits none of its batch mappings (except the
slots of batches still alive, which the child may read); an arena reserves what is
in flight, not slots x 1.25 x the biggest batch."""
import gc
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastloader import DataLoader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATEGIES = ["file_system", "file_descriptor"]


# ---- out of shared memory: every segment kind, both strategies ----------------------

def run_scenario(name, strategy):
    """Run tests/support/shm_limits_child.py in its own process (its own mount namespace with
    a 4 MiB /dev/shm); returns the JSON line it printed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), os.path.join(ROOT, "python"), ROOT) if p]))
    proc = subprocess.run([sys.executable, "-m", "tests.support.shm_limits_child", name, strategy],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode == 77:
        pytest.skip(json.loads(proc.stdout.strip().splitlines()[-1])["skip"])
    assert proc.returncode == 0, (
        f"the scenario's process died of "
        f"{signal.Signals(-proc.returncode).name if proc.returncode < 0 else proc.returncode}"
        f" (a full /dev/shm must be a MemoryError, never a signal)\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# scenario -> what the MemoryError must name: the segment and its size
EXPECTED = {
    "control_block": r"creating a (\d+)-byte control block",
    "arena": r"creating a (\d+)-byte overflow segment",
    "overflow": r"creating a (\d+)-byte overflow segment",
    "packed_build": r"writing a packed array \((\d+) bytes so far\)",
    "packed_share": r"creating a (\d+)-byte packed array segment",
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_out_of_shared_memory_is_a_memory_error_naming_the_size(scenario, strategy):
    got = run_scenario(scenario, strategy)
    assert got["type"] == "MemoryError", got
    m = re.search(EXPECTED[scenario], got["message"])
    assert m is not None, got["message"]
    assert int(m.group(1)) > 0
    if scenario == "overflow":   # the batch bigger than every slot: 6 MiB + the header
        assert int(m.group(1)) >= 6 << 20, got["message"]


def test_a_task_the_full_shm_cannot_take_is_that_batchs_memory_error_and_loses_nothing():
    """Only the task ring's first chunk is reserved up front. A later, bigger task
    whose pages /dev/shm cannot back is a MemoryError naming what it reserved,
    raised in that batch's turn (as a worker's error would be): the batches in
    hand before it are delivered, and the loop may go on after it."""
    got = run_scenario("task_ring", "file_system")
    assert got["type"] is None, got   # every next() answered; none died
    small, failed = got["value"][:2], got["value"][2:]
    assert small == [4, 4], got["value"]
    assert len(failed) == 4, got["value"]
    for kind, text in failed:
        assert kind == "MemoryError", (kind, text)
        m = re.search(r"reserving (\d+) bytes of the task ring", text)
        assert m is not None and int(m.group(1)) > 0, text
        assert "in the main process, sending batch" in text, text


def test_a_worker_moving_task_head_cannot_make_the_main_process_write_unreserved_pages():
    """With /dev/shm full, a worker that moves the shared task_head (and tail) to the
    ring's end, a page not reserved yet, made the main process write a pad record
    there: a SIGBUS. The main process keeps its own head: it reports the ring."""
    got = run_scenario("scribbled_task_head", "file_system")
    assert got["type"] == "RuntimeError", got
    assert "shared-memory data failed validation" in got["message"], got


def test_a_full_shm_at_the_next_epoch_after_the_ring_was_given_back_is_a_memory_error():
    got = run_scenario("next_epoch_after_release", "file_system")
    assert got["type"] is None, got   # nothing died
    first, error, after, same_worker = got["value"]
    assert first == after == [0.0, 1.0, 2.0, 3.0], got["value"]
    assert error is not None and error[0] == "MemoryError", error
    assert "worker(s) [0] found no shared memory to start the epoch" in error[1], error
    assert same_worker, "the persistent worker was replaced"


def test_big_tasks_go_through_the_lazily_reserved_ring():
    # memfd control block (file_descriptor): no /dev/shm to fill, every task arrives
    got = run_scenario("task_ring", "file_descriptor")
    assert got["type"] is None, got
    assert got["value"] == [4, 4] + [100 * 1506] * 4


def _kernel_populates_on_request():
    """Whether madvise(MADV_POPULATE_WRITE) exists here (Linux 5.14): without it the
    control block is reserved whole up front, as before."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    m = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        ok = libc.madvise(addr, mmap.PAGESIZE, 23) == 0   # MADV_POPULATE_WRITE
    finally:
        m.close()
    return ok


def test_control_block_reserves_little_up_front_and_the_rest_as_tasks_reach_it():
    """A worker's control block holds a task ring whose records wrap within a 1 MiB
    window (the rest is address space for bigger tasks, tests/conformance/
    test_big_tasks.py); a loader's tasks are a few hundred bytes, so only the
    ring's first chunk is reserved when it is made (each worker's start reserved,
    and zeroed, the whole of it before). Over an epoch the tasks go round the
    window, and it is reserved as they reach it, never more."""
    if not _kernel_populates_on_request():
        pytest.skip("no MADV_POPULATE_WRITE (Linux < 5.14): reserved whole up front")
    loader = DataLoader(OneBigSample(64, n=12800), batch_size=64, num_workers=1,
                        sharing_strategy="file_system", multiprocessing_context="fork",
                        persistent_workers=True)
    it = iter(loader)
    # the main process's mapping of it (the name is gone once the worker opened it)
    ctl = f"/dev/shm/{os.path.basename(it._pool.prefix)}-w0-c"
    with open("/proc/self/maps") as f:
        (rng,) = [line.split()[0] for line in f if ctl in line]
    path = "/proc/self/map_files/" + rng
    st = os.stat(path)
    assert st.st_size > 1 << 20, st.st_size   # the whole ring is there to be used
    assert st.st_blocks * 512 <= 256 << 10, st.st_blocks * 512
    n = sum(1 for _ in it)
    assert n == 200
    for _ in range(12):   # 200 tasks of 544 bytes per epoch: round the ring once
        for _batch in loader:
            pass
    del _batch
    reserved = os.stat(path).st_blocks * 512
    assert (1 << 20) - (64 << 10) <= reserved <= (1 << 20) + (256 << 10), reserved
    del it, loader
    gc.collect()


# ---- arena sizing -------------------------------------------------------------------

class OneBigSample(torch.utils.data.Dataset):
    def __init__(self, nbytes, n=1):
        self.nbytes, self.n = nbytes, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.nbytes // 4,), float(i))


def vma_of(addr, pid="self"):
    """(start, end, inode) of the mapping starting at `addr` in /proc/<pid>/maps."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            rng, _perm, _off, _dev, inode = line.split()[:5]
            start, end = (int(x, 16) for x in rng.split("-"))
            if start == addr:
                return start, end, int(inode)
    raise AssertionError(f"no mapping at {addr:#x}")


def allocated_bytes(start, end):
    """Pages the segment behind this mapping really holds (its inode's st_blocks)."""
    return os.stat(f"/proc/self/map_files/{start:x}-{end:x}").st_blocks * 512


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_big_batch_reserves_about_its_size(strategy):
    nbytes = 50 << 20
    loader = DataLoader(OneBigSample(nbytes), batch_size=None, num_workers=1,
                        sharing_strategy=strategy, multiprocessing_context="fork")
    it = iter(loader)
    batch = next(it)
    assert batch.numel() * 4 == nbytes
    stats = it.stats(memory=False)
    (w,) = stats["workers"]
    # the arena is sized (virtually) for 5 slots of 1.25x the batch; what it
    # reserves is the one slot the batch used
    assert w["arena_bytes"] >= 5 * nbytes
    assert nbytes <= w["arena_reserved_bytes"] <= nbytes + (1 << 20), w
    assert stats["arena_reserved_bytes"] == w["arena_reserved_bytes"]
    # and the segment really holds that, as /proc shows it: its pages (st_blocks)
    # are what stats() reports as reserved, and its mapping spans arena_bytes
    (addr, size), = it.segments()
    start, end, inode = vma_of(addr)
    assert end - start == size == w["arena_bytes"]
    held = allocated_bytes(start, end)
    assert w["arena_reserved_bytes"] - (64 << 10) <= held <= w["arena_reserved_bytes"] + (1 << 20)
    assert held <= nbytes + (2 << 20), "more than the one batch in flight is reserved"
    # the worker maps the very same segment (one copy of the pages, not one per side)
    with open(f"/proc/{w['pid']}/maps") as f:
        worker_vmas = [line for line in f if line.split()[4:5] == [str(inode)]]
    assert worker_vmas, "the worker does not map the arena the main process received"
    del batch
    for _ in it:
        pass
    del it, loader
    gc.collect()


def test_reservation_grows_with_what_is_in_flight():
    """Holding three batches (and one prefetched) reserves four slots; dropping them
    and reading on one at a time reuses those slots (no new reservation)."""
    nbytes = 4 << 20
    loader = DataLoader(OneBigSample(nbytes, n=12), batch_size=None, num_workers=1,
                        multiprocessing_context="fork", prefetch_factor=1)
    it = iter(loader)
    held = [next(it) for _ in range(3)]
    # the worker then builds the prefetched 4th batch into a 4th slot: wait for it
    deadline = time.monotonic() + 120
    while it.stats(memory=False)["workers"][0]["published"] < 4:
        assert time.monotonic() < deadline, "the worker did not publish its 4th batch"
        time.sleep(0.01)
    reserved = it.stats(memory=False)["arena_reserved_bytes"]
    assert 4 * nbytes <= reserved <= 4 * (nbytes + (64 << 10)), reserved
    del held
    for _batch in it:
        pass
    del _batch
    # one batch held, one in the making: the slots reserved already are reused
    assert it.stats(memory=False)["arena_reserved_bytes"] == reserved
    del it, loader
    gc.collect()


class Sizes(torch.utils.data.Dataset):
    """Sample i: a float tensor of sizes[i] bytes."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        return torch.full((self.sizes[i] // 4,), float(i))


SMALL, BIG = 256 << 10, 32 << 20
PATTERNS = {
    # one outlier batch, then small ones
    "outlier": [SMALL] * 6 + [BIG] + [SMALL] * 40,
    # big batches one at a time, each landing in another slot (the loop keeps the
    # last three batches), then small ones
    "spread": ([BIG] + [SMALL] * 5) * 6 + [SMALL] * 40,
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_big_batchs_memory_is_given_back_once_smaller_ones_reuse_the_ring(pattern,
                                                                            strategy):
    """A slot kept what the biggest batch it ever held reserved, for the worker's
    life: one 32 MiB batch among 256 KiB ones held 32 MiB to the epoch's end and
    after (persistent workers), and big batches spread over the slots held one big
    batch's memory per slot, where torch's shared memory goes with each batch. Now
    a free slot keeps what a typical batch needs (the last batches' sizes)."""
    sizes = PATTERNS[pattern]
    loader = DataLoader(Sizes(sizes), batch_size=None, num_workers=1, prefetch_factor=8,
                        persistent_workers=True, sharing_strategy=strategy,
                        multiprocessing_context="fork")
    it = iter(loader)
    kept = []
    for i, batch in enumerate(it):
        assert batch.numel() * 4 == sizes[i] and float(batch[0]) == i
        kept = kept[-2:] + [batch]
    del batch, kept
    gc.collect()
    stats = it.stats(memory=False)
    (w,) = stats["workers"]
    (addr, _size), = it.segments()
    start, end, _inode = vma_of(addr)
    held = allocated_bytes(start, end)
    # what 4 slots of small batches and the slack that keeps them from churning hold
    assert held <= 8 << 20, (held, w)
    assert w["arena_reserved_bytes"] - (64 << 10) <= held <= w["arena_reserved_bytes"] + (1 << 20)
    del it, loader
    gc.collect()


# ---- later forks --------------------------------------------------------------------

def maps_of_inode(pid, inode):
    """Bytes and entries of /proc/<pid>/maps that map file `inode`."""
    total, entries = 0, 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if int(parts[4]) == inode:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                total += end - start
                entries += 1
    return entries, total


class Values(torch.utils.data.Dataset):
    def __init__(self, n=8, size=256 << 10):
        self.n, self.size = n, size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.size // 4,), float(i))


def shared_inodes(pid="self"):
    """Inodes of the fastloader segments (memfd or /dev/shm) `pid` maps."""
    found = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            path = parts[5] if len(parts) > 5 else ""
            if path.startswith(("/memfd:fastloader ", "/dev/shm/fastloader-")):
                found.add(int(parts[4]))
    return found


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_later_fork_inherits_no_arena_of_an_earlier_loader(strategy):
    before = shared_inodes()
    a = DataLoader(Values(), batch_size=None, num_workers=1, persistent_workers=True,
                   sharing_strategy=strategy, multiprocessing_context="fork")
    it_a = iter(a)
    for _batch in it_a:
        pass
    del _batch
    gc.collect()
    inodes = [vma_of(addr)[2] for addr, _ in it_a.segments()]
    assert inodes and all(inodes)
    # every segment of loader A mapped here: its arena and its control block
    a_segments = shared_inodes() - before
    assert set(inodes) < a_segments
    b = DataLoader(Values(), batch_size=None, num_workers=2, persistent_workers=True,
                   sharing_strategy=strategy, multiprocessing_context="fork")
    it_b = iter(b)
    next(it_b)
    for pid in it_b.worker_pids:
        for inode in inodes:
            entries, nbytes = maps_of_inode(pid, inode)
            assert entries == 0, (f"worker {pid} of a later loader maps {nbytes} bytes of "
                                  f"the earlier loader's arena")
        assert not shared_inodes(pid) & a_segments, \
            f"worker {pid} of a later loader maps a segment of the earlier loader"
    # the earlier loader gone, nothing keeps its arena mapped
    del it_a, a
    gc.collect()
    for pid in it_b.worker_pids:
        assert all(maps_of_inode(pid, inode)[0] == 0 for inode in inodes)
    del it_b, b
    gc.collect()


def _sum_in_child(batch, conn):
    # numpy, not torch: torch's intra-op thread pool is not usable after a fork
    conn.send(float(batch.numpy().sum(dtype="float64")))
    # then again once the parent dropped the batch and read on (the worker has
    # reused every slot it could by then)
    assert conn.recv() == "read again"
    conn.send(float(batch.numpy().sum(dtype="float64")))
    conn.close()


def test_a_batch_held_across_a_fork_stays_readable_in_the_child():
    """The one exception: slots that a live batch points into are inherited, so a
    forked child reading a batch the parent kept sees its data (as with torch),
    even after the parent dropped it and the worker went on building batches."""
    slot_bytes = 256 << 10
    loader = DataLoader(Values(n=24, size=slot_bytes), batch_size=None, num_workers=1,
                        multiprocessing_context="fork")
    it = iter(loader)
    next(it)
    kept = next(it)                 # value 1.0 everywhere
    want = float(kept.numel())
    addr, _ = it.segments()[0]
    inode = vma_of(addr)[2] if addr else 0
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sum_in_child, args=(kept, child))
    proc.start()
    child.close()
    try:
        assert parent.poll(60), "child did not answer"
        # the child may have died of SIGSEGV reading the batch: then poll() sees EOF
        got = parent.recv()
        assert got == want, got
        # the parent lets the batch go and reads on: its slot must not be reused
        del kept
        gc.collect()
        seen = [float(b[0]) for b in it]
        assert seen == [float(i) for i in range(2, 24)], seen
        # its slot was retired: the others carried the rest of the epoch
        w = it.stats(memory=False)["workers"][0]
        assert w["slots_retired"] == 1, w
        parent.send("read again")
        assert parent.poll(60), "child did not answer"
        got_later = parent.recv()
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    assert got_later == want, (f"the batch the child inherited changed under it once "
                               f"the parent dropped it: sum {got_later}, not {want}")
    del it, loader
    gc.collect()
    assert inode


def test_fork_inherits_only_the_slots_of_live_batches():
    loader = DataLoader(Values(size=256 << 10), batch_size=None, num_workers=1,
                        multiprocessing_context="fork", prefetch_factor=1)
    it = iter(loader)
    kept = next(it)
    (addr, size), = it.segments()
    _, _, inode = vma_of(addr)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_report_maps, args=(inode, child))
    proc.start()
    child.close()
    try:
        assert parent.poll(60)
        entries, nbytes = parent.recv()
    finally:
        proc.join(60)
    slot_size = it.stats(memory=False)["workers"][0]["slot_size"]
    assert entries == 1 and nbytes == slot_size < size, (entries, nbytes, slot_size, size)
    del kept
    for _batch in it:
        pass
    del _batch, it, loader
    gc.collect()


def _report_maps(inode, conn):
    conn.send(maps_of_inode("self", inode))
    conn.close()


def test_a_received_segment_cannot_be_shrunk_or_grown():
    """memfd segments are sealed before their fd is sent: anything holding the fd
    (a worker, or what it hands the fd to) cannot truncate the pages under the
    main process's mapping (which would SIGBUS it)."""
    import errno

    loader = DataLoader(OneBigSample(1 << 20, n=2), batch_size=None, num_workers=1,
                        sharing_strategy="file_descriptor", multiprocessing_context="fork")
    it = iter(loader)
    batch = next(it)
    (addr, _size), = it.segments()
    start, end, _ = vma_of(addr)
    fd = os.open(f"/proc/self/map_files/{start:x}-{end:x}", os.O_RDWR)
    try:
        for new_size in (0, end - start - 4096, end - start + (1 << 20)):
            with pytest.raises(OSError) as info:
                os.ftruncate(fd, new_size)
            assert info.value.errno == errno.EPERM, info.value
    finally:
        os.close(fd)
    assert float(batch[0]) == 0.0
    del batch
    for _batch in it:
        pass
    del _batch, it, loader
    gc.collect()


class _ClaimsTooMuch(torch.utils.data.Dataset):
    """Samples 0 and 1 are real; sample 2's arrays claim 2**64 bytes together (each
    a broadcast view of one byte), which wrapped the encoder's size to 0."""

    def __len__(self):
        return 3

    def __getitem__(self, i):
        import numpy as np

        if i < 2:
            return torch.full((1000,), 7.0 + i)
        time.sleep(0.5)   # the consumer hands sample 0's slot back first
        return tuple(np.broadcast_to(np.zeros(1, np.uint8), (2 ** 62,)) for _ in range(4))


def _first(batch):
    return batch[0]


def test_a_batch_claiming_more_bytes_than_any_memory_is_that_batchs_error_and_spares_the_others():
    """It was written out of its slot, over a batch the consumer still held, and the
    worker died of SIGSEGV."""
    loader = DataLoader(_ClaimsTooMuch(), batch_size=1, num_workers=1,
                        multiprocessing_context="fork", collate_fn=_first)
    it = iter(loader)
    first = next(it)
    del first
    held = next(it)
    with pytest.raises(MemoryError, match="too large to send"):
        next(it)
    assert torch.equal(held, torch.full((1000,), 8.0))
    with pytest.raises(StopIteration):
        next(it)
