"""How much of the box stays idle while fastloader feeds a consumer.

    python -m benchmarks.idle_share [--repeats 3] [--batches 3000]

Efficiency (see `make bench`) can fall short for two reasons: the processes
together spend more CPU per sample than the in-process baseline, or the CPUs sit
idle although the main process and the workers have work between them (each
waits for the other once per batch). This tells the two apart for the tiny
workload (2 persistent fork workers, batch 64, the consumer checksums every batch
as `make bench` does), for several `prefetch_factor`s, interleaved per repeat, and
reports per setting, medians: samples/s, efficiency against the in-process
baseline (num_workers=0, same runs; per repeat: against that repeat's
baseline), the whole box's idle share over the timed
epoch (/proc/stat: idle + iowait), and the share of their time the workers waited
for a task (`loader.stats()`). Not a test: timings only.
"""
from __future__ import annotations

import argparse
import statistics
import time

import fastloader
from benchmarks import datasets
from benchmarks.harness import positive_int, touch
from benchmarks.throughput import usable_cpus

PREFETCH_FACTORS = (2, 4, 8)


def _box_idle():
    """(idle + iowait jiffies, all jiffies) of the whole machine."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)


def one_epoch(prefetch_factor, batches):
    """(samples/s, box idle share, workers' waiting share) of a warm epoch;
    prefetch_factor None: in-process."""
    kwargs = {}
    if prefetch_factor is not None:
        kwargs = dict(num_workers=usable_cpus(), persistent_workers=True,
                      multiprocessing_context="fork", prefetch_factor=prefetch_factor)
    loader = fastloader.DataLoader(datasets.TinyDataset(64 * batches), batch_size=64, **kwargs)
    for batch in loader:   # start-up and first use stay out of it
        touch(batch)
    it = iter(loader)
    idle0, started, n = _box_idle(), time.perf_counter(), 0
    for batch in it:
        touch(batch)
        n += 1
    elapsed = time.perf_counter() - started
    idle1 = _box_idle()
    waiting = 0.0
    if prefetch_factor is not None:
        workers = it.stats(memory=False)["workers"]
        waiting = statistics.mean(w["idle_s"] / max(w["idle_s"] + w["busy_s"], 1e-9)
                                  for w in workers)
    del it, loader
    return n * 64 / elapsed, (idle1[0] - idle0[0]) / max(idle1[1] - idle0[1], 1), waiting


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.idle_share", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--batches", type=positive_int, default=3000)
    args = parser.parse_args(argv)
    settings = (None, *PREFETCH_FACTORS)
    runs = {s: [] for s in settings}
    for repeat in range(args.repeats):
        order = settings if repeat % 2 == 0 else settings[::-1]
        for s in order:
            runs[s].append(one_epoch(s, args.batches))
            time.sleep(0.3)   # let the retired workers' exit finish off the clock
    cpus = usable_cpus()
    base = statistics.median(r[0] for r in runs[None])
    print(f"tiny, batch 64, {cpus} workers on {cpus} usable CPUs, {args.batches} batches; "
          f"{args.repeats} alternating repeats, medians\n")
    print("| setting | samples/s | efficiency (per repeat) | box idle | workers waiting for a task |")
    print("|---|---:|---|---:|---:|")
    for s in settings:
        rs = runs[s]
        rate = statistics.median(r[0] for r in rs)
        name = "in-process" if s is None else f"prefetch_factor {s}"
        eff = "-" if s is None else (f"{rate / base / cpus:.2f} ("
                                     + " / ".join(f"{r[0] / b[0] / cpus:.2f}"
                                                  for r, b in zip(rs, runs[None])) + ")")
        waiting = "-" if s is None else f"{statistics.median(r[2] for r in rs):.0%}"
        print(f"| {name} | {rate:,.0f} | {eff} | {statistics.median(r[1] for r in rs):.0%} "
              f"| {waiting} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
