"""Loader statistics: where an epoch's time goes.

The main process knows how long it waited for data (the "data stall") and what
the rings carried; each worker accounts in its control block how long it was busy
(from taking a task to asking for the next) and idle (waiting for a task). Per
worker memory is read from /proc (USS/PSS) through psutil when it is installed."""
from __future__ import annotations

import os
import sys
import time

from .protocol import WHERE_NONE, WHERE_OVERFLOW, WHERE_SLOT


def _memory(pid):
    try:
        import psutil

        info = psutil.Process(pid).memory_full_info()
        return {"uss_bytes": info.uss, "pss_bytes": getattr(info, "pss", None)}
    except Exception:   # psutil missing, or the worker is gone
        return {"uss_bytes": None, "pss_bytes": None}


class EpochCounters:
    """What the main process counts during one epoch: batches delivered (by where
    they travelled, and per worker) and the time it waited for data. The waiting
    is timed in C by recv(), only when it waits (spinning or asleep), per channel
    (MainChannel.wait_s, which spans the channel's life): an epoch's is the growth
    since its start, plus
    what the main process waited for the pin thread (pinned_wait)."""

    __slots__ = ("epoch", "started", "by_where", "by_worker", "_channels", "_wait_base",
                 "_pin_wait")
    clock = staticmethod(time.perf_counter)

    def __init__(self, epoch: int, num_workers: int, channels=()):
        self.epoch = epoch
        self.started = self.clock()
        self.by_where = [0, 0, 0]   # indexed by protocol.WHERE_*
        self.by_worker = [0] * num_workers
        self._channels = tuple(channels)
        self._wait_base = self._waited_so_far()
        self._pin_wait = 0.0

    def _waited_so_far(self) -> float:
        return sum(ch.wait_s for ch in self._channels)

    @property
    def wait_s(self) -> float:
        return self._waited_so_far() - self._wait_base + self._pin_wait

    def pinned_wait(self, seconds: float) -> None:
        """The main process waited for its batch to be pinned (pin_ahead.py)."""
        self._pin_wait += seconds

    def delivered(self, worker: int, where: int) -> None:
        self.by_where[where] += 1
        self.by_worker[worker] += 1


def collect(counters, channels, pids, memory=True):
    """The stats dict of an epoch (see README, "Loader stats"): `counters` of the
    main process, and each worker's from its channel. Epoch figures are this
    epoch's; the per-worker ring and busy/idle figures count from the worker's
    start (persistent workers span epochs)."""
    none, slot, overflow = (counters.by_where[WHERE_NONE], counters.by_where[WHERE_SLOT],
                            counters.by_where[WHERE_OVERFLOW])
    delivered = none + slot + overflow
    wall = max(counters.clock() - counters.started, 1e-9)
    workers = []
    for ch, pid in zip(channels, pids):
        w = ch.stats()
        w["pid"] = pid
        busy, idle = w["busy_s"], w["idle_s"]
        w["busy_fraction"] = busy / (busy + idle) if busy + idle > 0 else 0.0
        w["ring_occupancy"] = w["slots_held"] / w["slots"] if w["slots"] else 0.0
        w.update(_memory(pid) if memory else {"uss_bytes": None, "pss_bytes": None})
        workers.append(w)
    return {
        "epoch": counters.epoch,
        "batches": delivered,
        "slot_batches": slot + none,
        "overflow_batches": overflow,
        "wall_s": wall,
        "wait_s": counters.wait_s,
        "data_stall_fraction": min(1.0, counters.wait_s / wall),
        "batches_per_worker": list(counters.by_worker),
        # shared memory of the workers' current ring arenas: mapped (their size)
        # and reserved (the slots batches have used so far: what was in flight)
        "arena_bytes": sum(w["arena_bytes"] for w in workers),
        "arena_reserved_bytes": sum(w["arena_reserved_bytes"] for w in workers),
        "workers": workers,
    }


def enabled() -> bool:
    return os.environ.get("FASTLOADER_STATS", "") not in ("", "0")


def summary_line(s) -> str:
    busy = "/".join(f"{w['busy_fraction']:.0%}" for w in s["workers"])
    return (f"fastloader: epoch {s['epoch']}: {s['batches']} batches in {s['wall_s']:.2f} s, "
            f"waited {s['wait_s']:.2f} s for data ({s['data_stall_fraction']:.0%} stall), "
            f"{s['overflow_batches']} via overflow segments, workers busy {busy}, "
            f"{s['arena_reserved_bytes'] / 2**20:.1f} MiB of ring arenas reserved")


def print_summary(stats):
    print(summary_line(stats), file=sys.stderr, flush=True)
