"""Loader statistics: where an epoch's time goes.

The main process knows how long it waited for data (the "data stall") and what
the rings carried; each worker accounts in its control block how long it was busy
(from taking a task to asking for the next) and idle (waiting for a task). Per
worker memory is read from /proc (USS/PSS) through psutil when it is installed."""
from __future__ import annotations

import os
import sys


def _memory(pid):
    try:
        import psutil

        info = psutil.Process(pid).memory_full_info()
        return {"uss_bytes": info.uss, "pss_bytes": getattr(info, "pss", None)}
    except Exception:   # psutil missing, or the worker is gone
        return {"uss_bytes": None, "pss_bytes": None}


def collect(it, memory=True):
    """The stats dict of a fastloader iterator (see README, "Loader stats").
    Epoch figures are this epoch's; the per-worker ring and busy/idle figures
    count from the worker's start (persistent workers span epochs)."""
    none, slot, overflow = it._delivered
    delivered = none + slot + overflow
    wall = max(it._clock() - it._epoch_started, 1e-9)
    workers = []
    for ch, pid in zip(it._channels, it.worker_pids):
        w = ch.stats()
        w["pid"] = pid
        busy, idle = w["busy_s"], w["idle_s"]
        w["busy_fraction"] = busy / (busy + idle) if busy + idle > 0 else 0.0
        w["ring_occupancy"] = w["slots_held"] / w["slots"] if w["slots"] else 0.0
        w.update(_memory(pid) if memory else {"uss_bytes": None, "pss_bytes": None})
        workers.append(w)
    return {
        "epoch": it._epoch,
        "batches": delivered,
        "slot_batches": slot + none,
        "overflow_batches": overflow,
        "wall_s": wall,
        "wait_s": it._wait_s,
        "data_stall_fraction": min(1.0, it._wait_s / wall),
        "batches_per_worker": list(it._delivered_by_worker),
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


def print_summary(it):
    print(summary_line(collect(it, memory=False)), file=sys.stderr, flush=True)
