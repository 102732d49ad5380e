"""How much of the box stays idle while fastloader feeds a consumer.

    python -m benchmarks.idle_share [--repeats 3] [--batches 20000]

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
for a task (`loader.stats()`).

A second table puts the CPU each process spent (/proc/<pid>/schedstat, ns) beside
two bounds on the time per batch: m, the main process's CPU per batch (how much
of it in the kernel: /proc/<pid>/stat), and W, the workers' CPU per batch (each
builds every other batch, W per batch it builds). Balanced, the two CPUs share
all of it: (m + W) / 2 per batch. If the main process instead runs on one worker's
CPU (where the kernel keeps it), that CPU does m for every batch and W for every
other one: m + W / 2, and round-robin in-order delivery makes the other worker
wait for it. The last column: tasks that found their worker asleep, per batch
(each costs the main process a wake-up system call; a worker spins briefly for
its next task while that pays, see csrc/spin.c). Not a test: timings only.
"""
from __future__ import annotations

import argparse
import os
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


def _cpu(pid):
    """(on-CPU seconds from schedstat, kernel seconds from stat) of a process."""
    with open(f"/proc/{pid}/schedstat") as f:
        on_cpu = int(f.read().split()[0]) / 1e9
    with open(f"/proc/{pid}/stat") as f:
        kernel = int(f.read().rsplit(")", 1)[1].split()[12]) / _TICK
    return on_cpu, kernel


_TICK = os.sysconf("SC_CLK_TCK")


def _wakeups(it, prefetch_factor):
    """Tasks so far that found their worker asleep (a system call each for the
    main process; persistent workers count from their start)."""
    if prefetch_factor is None:
        return 0
    return sum(w["wakeups"] for w in it.stats(memory=False)["workers"])


def one_epoch(prefetch_factor, batches):
    """(samples/s, box idle share, workers' waiting share, {us per batch: wall, m,
    m_kernel, W}) of a warm epoch; prefetch_factor None: in-process."""
    kwargs = {}
    if prefetch_factor is not None:
        kwargs = dict(num_workers=usable_cpus(), persistent_workers=True,
                      multiprocessing_context="fork", prefetch_factor=prefetch_factor)
    loader = fastloader.DataLoader(datasets.TinyDataset(64 * batches), batch_size=64, **kwargs)
    for batch in loader:   # start-up and first use stay out of it
        touch(batch)
    it = iter(loader)
    pids = [os.getpid()] + list(getattr(it, "worker_pids", ()))
    wakeups0 = _wakeups(it, prefetch_factor)
    cpu0 = [_cpu(pid) for pid in pids]
    idle0, started, n = _box_idle(), time.perf_counter(), 0
    for batch in it:
        touch(batch)
        n += 1
    elapsed = time.perf_counter() - started
    idle1 = _box_idle()
    cpu1 = [_cpu(pid) for pid in pids]
    per_batch = {
        "wall": elapsed / n * 1e6,
        "m": (cpu1[0][0] - cpu0[0][0]) / n * 1e6,
        "m_kernel": (cpu1[0][1] - cpu0[0][1]) / n * 1e6,
        "W": sum(b[0] - a[0] for a, b in zip(cpu0[1:], cpu1[1:])) / n * 1e6,
        "wakeups": (_wakeups(it, prefetch_factor) - wakeups0) / n,
    }
    waiting = 0.0
    if prefetch_factor is not None:
        workers = it.stats(memory=False)["workers"]
        waiting = statistics.mean(w["idle_s"] / max(w["idle_s"] + w["busy_s"], 1e-9)
                                  for w in workers)
    del it, loader
    return (n * 64 / elapsed, (idle1[0] - idle0[0]) / max(idle1[1] - idle0[1], 1), waiting,
            per_batch)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.idle_share", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--batches", type=positive_int, default=20000)
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
    print("\nCPU per batch (us, medians): m = main process, W = workers together\n")
    print("| setting | time per batch | m (kernel) | W | balanced (m + W) / 2 "
          "| main on one worker's CPU: m + W / 2 | worker wake-ups per batch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s in settings:
        def med(key, rs=runs[s]):
            return statistics.median(r[3][key] for r in rs)
        name = "in-process" if s is None else f"prefetch_factor {s}"
        m, w = med("m"), med("W")
        bounds = ("- | - | -" if s is None else
                  f"{(m + w) / 2:.1f} | {m + w / 2:.1f} | {med('wakeups'):.2f}")
        print(f"| {name} | {med('wall'):.1f} | {m:.1f} ({med('m_kernel'):.1f}) | "
              f"{'-' if s is None else f'{w:.1f}'} | {bounds} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
