"""Efficiency with and without a core left for the main process.

    python -m benchmarks.efficiency [--repeats 3] [--workloads tiny,tokens]

`make bench` reports efficiency = rate / (in-process rate x min(workers, CPUs))
with 2 workers on this 2-CPU box, where the main process (which receives every
batch and hands out every task) has no core of its own and preempts a worker for
each batch. This runs, interleaved per repeat, fastloader with num_workers=0
(the baseline), 1 worker (the main process keeps the other CPU) and as many
workers as CPUs, persistent workers, fork, batch 64, one warm-up epoch each, and
reports per configuration: samples/s (median), efficiency against the baseline,
and CPU microseconds per batch of the main process and of each worker (a worker
handles 1/W of the batches, so its figure per batch *it* built is W times that).
Not a test: timings only.
"""
from __future__ import annotations

import argparse
import statistics
import time

import fastloader
from benchmarks import datasets
from benchmarks.harness import positive_int
from benchmarks.throughput import usable_cpus

WORKLOADS = {
    "tiny": (lambda n: datasets.TinyDataset(64 * n), None, 3000),
    "tiny_batched": (lambda n: datasets.TinyBatchedDataset(64 * n), None, 3000),
    "tokens": (lambda n: datasets.TokenDataset(64 * n), datasets.pad_tokens, 800),
}


def _cpu_s(pid):
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def one_epoch(workload, num_workers):
    """(samples/s, [main CPU us/batch, worker CPU us/batch ...]) of a warm epoch."""
    import os

    make, collate_fn, batches = WORKLOADS[workload]
    kwargs = {} if collate_fn is None else {"collate_fn": collate_fn}
    if num_workers:
        kwargs.update(persistent_workers=True, multiprocessing_context="fork")
    loader = fastloader.DataLoader(make(batches), batch_size=64, num_workers=num_workers,
                                   **kwargs)
    for _ in loader:   # start-up and first use stay out of it
        pass
    pids = [os.getpid(), *(loader._iterator.worker_pids if num_workers else ())]
    before, started, n = [_cpu_s(p) for p in pids], time.perf_counter(), 0
    for _ in loader:
        n += 1
    elapsed = time.perf_counter() - started
    cpu = [(_cpu_s(p) - b) / n * 1e6 for p, b in zip(pids, before)]
    del loader
    return n * 64 / elapsed, cpu


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.efficiency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--workloads", default="tiny,tokens")
    args = parser.parse_args(argv)
    cpus = usable_cpus()
    counts = sorted({0, 1, cpus})
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    runs = {(w, k): [] for w in names for k in counts}
    for _ in range(args.repeats):
        for w in names:
            for k in counts:
                runs[(w, k)].append(one_epoch(w, k))
    print(f"{cpus} usable CPUs; {args.repeats} repeats, medians\n")
    print("| workload | workers | samples/s | efficiency | CPU us/batch: main, workers |")
    print("|---|---:|---:|---:|---|")
    for w in names:
        base = statistics.median(r[0] for r in runs[(w, 0)])
        for k in counts:
            rs = runs[(w, k)]
            rate = statistics.median(r[0] for r in rs)
            cpu = [statistics.median(r[1][i] for r in rs) for i in range(k + 1)]
            eff = "-" if k == 0 else f"{rate / (base * min(k, cpus)):.2f}"
            print(f"| {w} | {k} | {rate:,.0f} | {eff} | {', '.join(f'{c:.0f}' for c in cpu)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
