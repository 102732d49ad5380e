"""Scribble over the rings' layout fields in a live loader's control block, then
read on: fastloader must carry on with the geometry it checked when it attached
(or raise), never index shared memory with the new values. Run as a child process
by tests/transport/test_ring_geometry.py, so that an out-of-bounds access kills only this
process. Prints one JSON line: the values of the batches read, or the error.

    python -m tests.support.ring_geometry_child"""
import json
import mmap
import os
import struct
import sys

import torch

MAGIC = struct.pack("<II", 0x464C4354, 1)


class Values(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.full((64,), float(i))


def control_blocks():
    """Writable maps of this process's fastloader control blocks."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 6 or "fastloader" not in line or "rw" not in parts[1]:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            fd = os.open(f"/proc/self/map_files/{start:x}-{end:x}", os.O_RDWR)
            try:
                m = mmap.mmap(fd, end - start)
            finally:
                os.close(fd)
            if m[:8] == MAGIC:
                found.append(m)
            else:
                m.close()
    return found


def main():
    from fastloader import DataLoader

    loader = DataLoader(Values(), batch_size=None, num_workers=1,
                        multiprocessing_context="fork", persistent_workers=True)
    it = iter(loader)
    seen = [float(next(it)[0]) for _ in range(3)]
    blocks = control_blocks()
    if len(blocks) != 1:
        print(json.dumps({"error": f"found {len(blocks)} control blocks"}))
        return
    (ctl,) = blocks
    # task_cap, res_cap, free_cap, res_off, free_off, task_off, total: far outside
    # the mapping, yet powers of two (what the old once-only check accepted)
    struct.pack_into("<QIIQQQQ", ctl, 16, 1 << 40, 1 << 30, 1 << 30,
                     1 << 41, 1 << 42, 1 << 43, 1 << 44)
    try:
        for batch in it:
            seen.append(float(batch[0]))
        for batch in loader:   # a second epoch: new tasks through the ring
            seen.append(float(batch[0]))
    except Exception as exc:   # reported to the parent, which asserts on it
        print(json.dumps({"seen": seen, "error": f"{type(exc).__name__}: {exc}"}))
        return
    print(json.dumps({"seen": seen, "error": None}))


if __name__ == "__main__":
    sys.exit(main())
