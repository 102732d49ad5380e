"""Whether the main process may spin for its next batch before it sleeps.

A worker that publishes a batch while the main process sleeps for it must wake
it: a system call, and an interrupt to the CPU the main process slept on. On a
VM that interrupt is an exit to the host, which also leaves the worker's caches
and branch predictors colder: measured on a 2-vCPU KVM guest, one worker and the
main process on the other CPU, the wake-up cost the worker ~65 us of CPU per
batch (tokens: 333 us per batch against 268 when it never had to wake anyone;
the in-process loop takes 227). A main process that spins for the batch needs
no wake-up.

Spinning pays only with a CPU to spare: where the workers (and the other ranks'
loaders on this node) already use every CPU, the spinning main process would
take CPU from a worker. CUDA's default host synchronisation follows the same
rule (it spins while there are more CPUs than active contexts), so a training
process on a GPU box with idle cores looks the same in `top` either way. The
spin also stops by itself while it rarely catches a batch (a slow dataset: see
csrc/spin.c), and `FASTLOADER_MAIN_SPIN=0` turns it off.
"""
from __future__ import annotations

import os

# The longest one wait spins (then it sleeps as before). Long enough for a batch
# that takes a worker a few hundred microseconds (tokens: ~300 us per batch).
MAIN_SPIN_NS = 1_000_000

_CGROUP_ROOT = "/sys/fs/cgroup"


def _quota_v2(directory: str) -> float | None:
    """CPUs allowed by cgroup v2's ``cpu.max`` ("200000 100000"; "max ..." is none)."""
    with open(os.path.join(directory, "cpu.max")) as f:
        quota, period = f.read().split()[:2]
    return None if quota == "max" else int(quota) / int(period)


def _quota_v1(directory: str) -> float | None:
    """CPUs allowed by cgroup v1's CFS quota (-1 is none)."""
    with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
        quota = int(f.read())
    with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
        period = int(f.read())
    return None if quota < 0 else quota / period


def _tightest(mount: str, path: str, read) -> float | None:
    """The smallest quota on the way from `path`'s cgroup up to the mount's root:
    a parent's quota caps its children."""
    parts = [p for p in path.split("/") if p]
    limit = None
    for depth in range(len(parts), -1, -1):
        try:
            cpus = read(os.path.join(mount, *parts[:depth]))
        except (OSError, ValueError, ZeroDivisionError):
            continue   # no such level here (a container sees only its own part)
        if cpus is not None:
            limit = cpus if limit is None else min(limit, cpus)
    return limit


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup",
                     root: str = _CGROUP_ROOT) -> float | None:
    """The CPUs a cgroup quota allows this process (``docker --cpus=2``, a
    Kubernetes CPU limit), cgroup v2 or v1; None where there is none or it cannot
    be read."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "":
            limits.append(_tightest(root, path, _quota_v2))
        elif "cpu" in controllers.split(","):
            # v1 mounts the cpu controller as "cpu" or "cpu,cpuacct"
            for name in (controllers, "cpu"):
                mount = os.path.join(root, name)
                if os.path.isdir(mount):
                    limits.append(_tightest(mount, path, _quota_v1))
                    break
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def usable_cpus() -> float:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup
    quota."""
    try:
        count: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    return count if quota is None else min(count, quota)


def _ranks_on_this_node() -> int:
    """Processes like this one on the node: torchrun sets LOCAL_WORLD_SIZE; each
    rank's main process and workers share the node's CPUs."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def main_spin_ns(num_workers: int) -> int:
    """How long recv() may spin for a batch: MAIN_SPIN_NS where the main process
    has a CPU of its own beside its workers (on every rank of the node), else 0."""
    if os.environ.get("FASTLOADER_MAIN_SPIN", "1").strip() == "0":
        return 0
    if (num_workers + 1) * _ranks_on_this_node() <= usable_cpus():
        return MAIN_SPIN_NS
    return 0
