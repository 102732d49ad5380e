"""What a wake-up costs on this machine, and what it costs a loader.

    python -m benchmarks.wake_cost [--repeats 3]

1. Raw: a process computes for a gap (0-300 us), then wakes a peer sleeping in
   poll() on an eventfd and waits for its answer. Reported: the CPU the waker's
   write() takes and the round trip, per gap. On a VM whose idle vCPUs halt (no
   guest halt-polling), waking a peer that has been idle for a while costs far
   more than waking one that was just running.
2. In a loader: tiny samples, one persistent fork worker (so the main process and
   the worker each have a core): the worker's CPU time per batch when the main
   process sleeps while it waits for a batch (what fastloader does) against a
   main process that polls the result ring without sleeping (an experiment: it
   burns a core, and is not what fastloader does).
Medians over repeats, interleaved. Not a test: timings only.
"""
from __future__ import annotations

import argparse
import os
import select
import statistics
import time

from benchmarks.harness import positive_int

GAPS_US = (0, 20, 100, 300)
ROUNDS = 2000


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def raw_wake(gap_us, rounds=ROUNDS):
    """(waker's write() us, round trip us) medians for one gap."""
    to_peer, to_me = os.eventfd(0), os.eventfd(0)
    pid = os.fork()
    if pid == 0:   # the peer: sleep until woken, answer
        try:
            poller = select.poll()
            poller.register(to_peer, select.POLLIN)
            for _ in range(rounds):
                poller.poll()
                os.eventfd_read(to_peer)
                os.eventfd_write(to_me, 1)
        finally:
            os._exit(0)
    poller = select.poll()
    poller.register(to_me, select.POLLIN)
    writes, trips = [], []
    for _ in range(rounds):
        _spin(gap_us / 1e6)
        t0 = time.perf_counter()
        os.eventfd_write(to_peer, 1)
        t1 = time.perf_counter()
        poller.poll()
        os.eventfd_read(to_me)
        t2 = time.perf_counter()
        writes.append(t1 - t0)
        trips.append(t2 - t0)
    os.waitpid(pid, 0)
    os.close(to_peer)
    os.close(to_me)
    return statistics.median(writes) * 1e6, statistics.median(trips) * 1e6


def _sched_cpu(pid):
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def loader_worker_cpu(poll_main, batches=3000):
    """(samples/s, worker CPU us per batch) for one epoch of a warm 1-worker loader."""
    from fastloader import DataLoader, _core
    from fastloader.iterator import FastMultiProcessingIter

    from benchmarks.datasets import TinyDataset

    sleeping = FastMultiProcessingIter._get_data

    def polling(it):
        prefer = it._task_info.get(it._rcvd_idx, (0,))[0]
        while True:
            got = _core.recv(it._channels, prefer, 0.0)
            if got is not None:
                return got

    FastMultiProcessingIter._get_data = polling if poll_main else sleeping
    try:
        loader = DataLoader(TinyDataset(64 * batches), batch_size=64, num_workers=1,
                            persistent_workers=True, multiprocessing_context="fork")
        for _ in loader:   # start-up stays out of it
            pass
        (pid,) = loader._iterator.worker_pids
        c0, t0, n = _sched_cpu(pid), time.perf_counter(), 0
        for _ in loader:
            n += 1
        dt, c1 = time.perf_counter() - t0, _sched_cpu(pid)
        del loader
    finally:
        FastMultiProcessingIter._get_data = sleeping
    return n * 64 / dt, (c1 - c0) / n * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wake_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=3)
    args = parser.parse_args(argv)
    raw = {gap: [] for gap in GAPS_US}
    runs = {False: [], True: []}
    for _ in range(args.repeats):
        for gap in GAPS_US:
            raw[gap].append(raw_wake(gap))
        for poll_main in (False, True):
            runs[poll_main].append(loader_worker_cpu(poll_main))
    print("| waker busy before the wake | write() us | round trip us |")
    print("|---:|---:|---:|")
    for gap, values in raw.items():
        print(f"| {gap} us | {statistics.median(v[0] for v in values):.1f} "
              f"| {statistics.median(v[1] for v in values):.1f} |")
    print("\n| tiny, 1 worker, main process | samples/s | worker CPU us/batch |")
    print("|---|---:|---:|")
    for poll_main, label in ((False, "sleeps while it waits (fastloader)"),
                             (True, "polls without sleeping (experiment)")):
        values = runs[poll_main]
        print(f"| {label} | {statistics.median(v[0] for v in values):,.0f} "
              f"| {statistics.median(v[1] for v in values):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
