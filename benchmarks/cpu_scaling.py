"""How much faster two busy processes are than one on this machine: the ceiling
for the efficiency column of `make bench` (which assumes 2 CPUs do 2x the work).

    python -m benchmarks.cpu_scaling [--seconds 3] [--repeats 3]

Each process runs a tiny-workload-like loop (torch row indexing, one intra-op
thread) for a fixed time; the samples/s of one process alone and of two at once
are compared, median over repeats. On a VM whose two vCPUs share a physical core,
or a host that is oversubscribed, the speed-up is below 2 and so is any loader's
attainable efficiency. Not a test: timings only.
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from benchmarks.harness import positive_int


def _work(queue, seconds):
    torch.set_num_threads(1)
    rows = torch.randn(1 << 18, 16)
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for i in range(0, 6400, 100):   # one "batch" of 64 row reads
            rows[i]
        n += 64
    queue.put(n / seconds)


def rate(processes, seconds):
    """Samples/s of `processes` loops running at once, summed."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_work, args=(queue, seconds)) for _ in range(processes)]
    for p in procs:
        p.start()
    total = sum(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_scaling",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=positive_int, default=3)
    parser.add_argument("--repeats", type=positive_int, default=3)
    args = parser.parse_args(argv)
    one, two = [], []
    for _ in range(args.repeats):   # interleaved, so drift in the box's load hits both
        one.append(rate(1, args.seconds))
        two.append(rate(2, args.seconds))
    a, b = statistics.median(one), statistics.median(two)
    print(f"1 process: {a:,.0f} samples/s; 2 processes: {b:,.0f} samples/s; "
          f"speed-up {b / a:.2f} (the efficiency ceiling is {b / a / 2:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
