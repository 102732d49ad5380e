"""Whether the main process may spin for its next batch before it sleeps.

A worker that publishes a batch while the main process sleeps for it must wake
it: a system call, and an interrupt to the CPU the main process slept on. On a
VM that interrupt is an exit to the host, which also leaves the worker's caches
and branch predictors colder: measured on a 2-vCPU KVM guest, one worker and the
main process on the other CPU, the wake-up cost the worker ~65 us of CPU per
batch (tokens: 333 us per batch against 268 when it never had to wake anyone;
the in-process loop takes 227). A main process that spins for the batch needs
no wake-up.

Spinning pays only with a CPU to spare: where the workers (of every loader this
process runs, and the other ranks' on this node) already use every CPU, the
spinning main process would take CPU from a worker. CUDA's default host
synchronisation follows the same rule (it spins while there are more CPUs than
active contexts), so a training process on a GPU box with idle cores looks the
same in `top` either way. The
spin also stops by itself while it rarely catches a batch (a slow dataset: see
csrc/spin.c), and `FASTLOADER_MAIN_SPIN=0` turns it off.
"""
from __future__ import annotations

import os
import re

from .distributed import rank_and_world

# The longest one wait spins (then it sleeps as before). Long enough for a batch
# that takes a worker a few hundred microseconds (tokens: ~300 us per batch).
MAIN_SPIN_NS = 1_000_000

def _unescape(field: str) -> str:
    """A /proc/self/mountinfo path: spaces and the like are octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cpu_cgroup_mounts(mountinfo: str):
    """(version, mount root, mount point) of each cgroup2 mount and each v1 mount
    holding the cpu controller, whatever its directory is called."""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or not tail:
            continue
        if tail[0] == "cgroup2":
            yield 2, _unescape(fields[3]), _unescape(fields[4])
        elif tail[0] == "cgroup" and len(tail) >= 3 and "cpu" in tail[2].split(","):
            yield 1, _unescape(fields[3]), _unescape(fields[4])


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


def _tightest(point: str, relative: str, read) -> float | None:
    """The smallest quota from the cgroup at `relative` under the mount `point` up
    to the mount's top: a parent's quota caps its children."""
    parts = [p for p in relative.split("/") if p]
    limit = None
    for depth in range(len(parts), -1, -1):
        try:
            cpus = read(os.path.join(point, *parts[:depth]))
        except (OSError, ValueError, ZeroDivisionError):
            continue   # no such level here
        if cpus is not None:
            limit = cpus if limit is None else min(limit, cpus)
    return limit


def _relative(path: str, mount_root: str) -> str | None:
    """`path` (from /proc/self/cgroup) below the mount's root: a container without
    its own cgroup namespace sees its full path, and the mount starts below it."""
    root = mount_root.rstrip("/")
    if path == root or path.startswith(root + "/"):
        return path[len(root):]
    return None


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup",
                     mountinfo: str = "/proc/self/mountinfo") -> float | None:
    """The CPUs a cgroup quota allows this process (``docker --cpus=2``, a
    Kubernetes CPU limit), cgroup v2 or v1; None where there is none or it cannot
    be read."""
    try:
        # surrogateescape: a path need not be UTF-8
        with open(proc_cgroup, errors="surrogateescape") as f:
            memberships = f.read().splitlines()
        with open(mountinfo, errors="surrogateescape") as f:
            mounts = list(_cpu_cgroup_mounts(f.read()))
    except OSError:
        return None
    found = []
    for line in memberships:
        _hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        version = 2 if controllers == "" else 1 if "cpu" in controllers.split(",") else 0
        for mount_version, mount_root, point in mounts:
            relative = _relative(path, mount_root)
            if mount_version != version or relative is None:
                continue
            limit = _tightest(point, relative, _quota_v2 if version == 2 else _quota_v1)
            if limit is not None:
                found.append(limit)
    return min(found) if found else None


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def usable_cpus() -> float:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup
    quota."""
    quota = cgroup_cpu_limit()
    return _affinity() if quota is None else min(_affinity(), quota)


# What launchers call the number of ranks on this node.
_LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE",               # torchrun
                         "SLURM_NTASKS_PER_NODE",          # srun --ntasks-per-node
                         "OMPI_COMM_WORLD_LOCAL_SIZE",     # Open MPI
                         "MPI_LOCALNRANKS")                # MPICH, Intel MPI


def ranks_on_this_node() -> int:
    """Processes like this one on the node, each with its own loader. Where the
    launcher names no local size (Lightning's own sets only WORLD_SIZE and
    LOCAL_RANK), every rank of the job may be here: counting them all can only
    turn the spin off."""
    for name in _LOCAL_SIZE_VARIABLES:
        try:
            return max(1, int(os.environ[name]))
        except (KeyError, ValueError):
            continue
    return max(1, rank_and_world()[1])


def _cpu_room() -> float:
    """This rank's share of the CPUs. A CFS quota, once used up, stops every
    thread of the group (the workers too) until its period ends, so one CPU of it
    is left for the process's other threads."""
    room = float(_affinity())
    quota = cgroup_cpu_limit()
    if quota is not None:
        room = min(room, quota - 1)
    return room / ranks_on_this_node()


class MainSpin:
    """One iterator's rule: spin while the workers of every live loader of this
    process, this thread and (with pin_memory) the pin thread fit in this rank's
    CPUs. Decided once, checked per batch against the live workers."""

    __slots__ = ("_room",)

    def __init__(self, pin_memory: bool = False):
        room = None
        if os.environ.get("FASTLOADER_MAIN_SPIN", "1").strip() != "0":
            try:
                room = _cpu_room() - 1 - (1 if pin_memory else 0)
            except Exception:   # an odd /proc or environment: never spin
                room = None
        self._room = room

    def ns(self, live_workers: int) -> int:
        """recv()'s spin_ns, with `live_workers` running in this process."""
        room = self._room
        return MAIN_SPIN_NS if room is not None and live_workers <= room else 0


def main_spin_ns(num_workers: int, pin_memory: bool = False) -> int:
    """The spin for a process whose only loader has `num_workers` workers."""
    return MainSpin(pin_memory).ns(num_workers)
