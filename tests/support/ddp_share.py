"""Run by tests/distributed/test_distributed.py under torchrun: every local rank gets the same
2-rank-node PackedStringArray either shared (one segment per node, built by the
first local rank) or built by each rank, reads all of it, and reports the PSS of
the array's mapping read from /proc/self/smaps."""
import json
import os
import sys

import torch.distributed as dist

from fastloader import PackedStringArray
from fastloader.distributed import share_on_node

N = 400_000


def build():
    return PackedStringArray(f"/data/train/class_{i % 1000:04d}/image_{i:09d}.JPEG"
                             for i in range(N))


def mapping_pss_kib(address):
    """Pss of the /proc/self/smaps entry that contains `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= address < hi
            elif inside and head[0] == "Pss:":
                return int(head[1])
    raise LookupError(f"no mapping at {address:#x}")


def main(mode, out_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    names = share_on_node(build) if mode == "shared" else build()
    assert len(names) == N and names[N - 1].endswith(f"{N - 1:09d}.JPEG")
    total = sum(len(s) for s in names)   # every page read in this rank
    dist.barrier()                        # both ranks mapped and read it: now measure
    pss = mapping_pss_kib(names._storage.mapping.address)
    dist.barrier()
    with open(os.path.join(out_dir, f"{mode}-{rank}.json"), "w") as f:
        json.dump({"pss_kib": pss, "nbytes": names.nbytes, "chars": total}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
