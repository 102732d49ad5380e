"""Tiny samples, torch's DataLoader vs fastloader, plain map dataset and one with
batched access (``__getitems__`` returning CollatedSamples): samples/s and CPU
microseconds per sample (main process + workers), persistent workers.

    python -m benchmarks.tiny_profile [--repeats 3] [--samples 262144]

Every configuration runs in the same process, interleaved per repeat; medians are
printed with ratios to torch's plain-dataset figure. Not a test: timings only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.utils.data import DataLoader as TorchDataLoader

import fastloader
from benchmarks.datasets import TinyBatchedDataset, TinyDataset

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _cpu(pids):
    """(main process CPU s, workers' CPU s)"""
    return time.process_time(), sum(_proc_cpu(p) for p in pids)


def _epoch(loader, it_holder):
    it = iter(loader)
    it_holder[0] = it
    n = 0
    for features, _labels in it:
        n += len(features)
    return n


def _measure(loader):
    holder = [None]
    _epoch(loader, holder)                      # start the workers, warm up
    pids = [w.pid for w in holder[0]._workers]
    (m0, w0), t0 = _cpu(pids), time.perf_counter()
    n = _epoch(loader, holder)
    t1, (m1, w1) = time.perf_counter(), _cpu(pids)
    return n / (t1 - t0), (m1 - m0) / n * 1e6, (w1 - w0) / n * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1 << 18)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    datasets = {"tiny": TinyDataset(args.samples), "tiny_batched": TinyBatchedDataset(args.samples)}
    kinds = {"torch": TorchDataLoader, "fastloader": fastloader.DataLoader}
    results = {}
    for _ in range(args.repeats):
        for dname, ds in datasets.items():
            for lname, cls in kinds.items():
                loader = cls(ds, batch_size=64, num_workers=2, persistent_workers=True,
                             multiprocessing_context="fork")
                results.setdefault((dname, lname), []).append(_measure(loader))
                del loader
    base = statistics.median(r[0] for r in results[("tiny", "torch")])
    print(f"{'dataset':14} {'loader':11} {'samples/s':>11} {'x torch':>8} "
          f"{'CPU us/sample: main':>20} {'workers':>8} {'total':>6}")
    for (dname, lname), runs in results.items():
        rate, main_cpu, worker_cpu = (statistics.median(r[k] for r in runs) for k in range(3))
        print(f"{dname:14} {lname:11} {rate:11,.0f} {rate / base:8.2f} "
              f"{main_cpu:20.2f} {worker_cpu:8.2f} {main_cpu + worker_cpu:6.2f}")


if __name__ == "__main__":
    main()
