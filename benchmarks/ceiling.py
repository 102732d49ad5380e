"""The machine's own parallel ceiling for a workload: what k processes doing the
dataset's work at the same time, with no loader between them, get out of k CPUs.

Efficiency compares a loader with k times the in-process rate, which assumes that k
CPUs run k copies of the work k times as fast as one. On a shared VM they need not:
two vCPUs may be two hyperthreads of one host core, or share its caches and memory
bandwidth with other guests. This runs the in-process loader's epoch (the dataset's
__getitem__, the collate, the consumer's checksum: everything the efficiency
baseline does) in one forked process, then in k forked processes started together,
and reports

    ceiling = one process's epoch time / the k processes' mean epoch time

1.0 means the CPUs scale linearly; 0.8 means that even a loader costing nothing
could reach no more than an efficiency of 0.8 here. Reported beside the
efficiency, in the same run; it does not change how the efficiency is computed.
"""
from __future__ import annotations

import os
import select
import statistics

_CHILD_TIMEOUT_S = 600.0


def _run_children(loader, measure, warmup_batches, count):
    """Fork ``count`` children that each time one epoch of ``loader`` once told to
    start together; returns their timed windows (seconds)."""
    go_read, go_write = os.pipe()
    children = []   # (pid, read end of its result pipe)
    try:
        for _ in range(count):
            result_read, result_write = os.pipe()
            pid = os.fork()
            if pid == 0:   # child: wait for the start, time the epoch, report, exit
                status = 1
                try:
                    os.close(result_read)
                    os.close(go_write)
                    os.read(go_read, 1)
                    result = measure(loader, warmup_batches)
                    os.write(result_write, repr(result.timed_s).encode())
                    status = 0
                finally:
                    os._exit(status)
            os.close(result_write)
            children.append((pid, result_read))
        os.write(go_write, b"x" * count)
        times = []
        for pid, result_read in children:
            ready, _, _ = select.select([result_read], [], [], _CHILD_TIMEOUT_S)
            text = os.read(result_read, 64) if ready else b""
            if not text:
                raise RuntimeError(f"ceiling: child {pid} reported no epoch time")
            times.append(float(text))
        return times
    finally:
        os.close(go_read)
        os.close(go_write)
        for pid, result_read in children:
            os.close(result_read)
            os.waitpid(pid, 0)


def machine_ceiling(loader, measure, warmup_batches, parallel):
    """One process's epoch time over the mean of ``parallel`` processes' epoch times,
    all running ``measure(loader, warmup_batches)`` (``loader`` has no workers)."""
    alone = _run_children(loader, measure, warmup_batches, 1)[0]
    together = _run_children(loader, measure, warmup_batches, parallel)
    return alone / statistics.mean(together)
