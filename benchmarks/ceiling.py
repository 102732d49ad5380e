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

1.0 means the CPUs scale linearly. It is an estimate of the moment it was taken
(a VM's speed drifts between that moment and the loader's runs), and a slightly
optimistic one: a process that finishes first leaves the others a CPU to
themselves for the rest of their epoch. Reported beside the efficiency, in the
same run; it does not change how the efficiency is computed.
"""
from __future__ import annotations

import os
import select
import signal
import statistics
import sys
import time
import traceback

_TIMEOUT_S = 600.0   # for all the children of one measurement together


def _child(go_read, result_write, loader, measure, warmup_batches):
    """In the forked child: wait for the start, time the epoch, report, exit."""
    status = 1
    try:
        if os.read(go_read, 1) == b"x":   # EOF: the parent gave up before the start
            result = measure(loader, warmup_batches)
            os.write(result_write, repr(result.timed_s).encode())
            status = 0
    except BaseException:   # noqa: BLE001 - said on stderr, then the exit status
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(status)


def _run_children(loader, measure, warmup_batches, count):
    """Fork ``count`` children that each time one epoch of ``loader`` once told to
    start together; returns their timed windows (seconds). A child that fails or
    does not report within the timeout is killed, and this raises."""
    go_read, go_write = os.pipe()
    children = {}   # read end of its result pipe -> pid
    times = []
    try:
        for _ in range(count):
            result_read, result_write = os.pipe()
            try:
                pid = os.fork()
            except OSError:
                os.close(result_read)
                os.close(result_write)
                raise
            if pid == 0:
                os.close(result_read)
                os.close(go_write)
                _child(go_read, result_write, loader, measure, warmup_batches)
            os.close(result_write)
            children[result_read] = pid
        os.write(go_write, b"x" * count)
        poller = select.poll()
        for fd in children:
            poller.register(fd, select.POLLIN)
        waiting = set(children)
        deadline = time.monotonic() + _TIMEOUT_S
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"ceiling: no epoch time from {len(waiting)} child(ren) "
                                   f"within {_TIMEOUT_S:.0f} s")
            for fd, _ in poller.poll(left * 1000):
                text = os.read(fd, 64)
                if not text:
                    raise RuntimeError(f"ceiling: child {children[fd]} exited without an "
                                       "epoch time (its error, if any, is on stderr)")
                times.append(float(text))
                poller.unregister(fd)
                waiting.discard(fd)
        return times
    finally:
        os.close(go_read)
        os.close(go_write)
        if len(times) < len(children):   # failed: nobody is left running an epoch
            for pid in children.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for fd, pid in children.items():
            os.close(fd)
            os.waitpid(pid, 0)


def machine_ceiling(loader, measure, warmup_batches, parallel):
    """One process's epoch time over the mean of ``parallel`` processes' epoch times,
    all running ``measure(loader, warmup_batches)`` (``loader`` has no workers)."""
    alone = _run_children(loader, measure, warmup_batches, 1)[0]
    together = _run_children(loader, measure, warmup_batches, parallel)
    return alone / statistics.mean(together)
