"""The CPU quota a process's cgroups give it (``docker --cpus=2``, a Kubernetes
CPU limit), cgroup v2 or v1.

Mounts are found through /proc/self/mountinfo, whatever their directories are
called, and a container without its own cgroup namespace (which sees its full
cgroup path while its mount starts below it) is handled. None where there is
nothing to find or it cannot be read: a hint for main_spin.py, never worth an
error.
"""
from __future__ import annotations

import os
import re
from time import monotonic as _monotonic

def _unescape(field: str) -> str:
    """A /proc/self/mountinfo path: spaces and the like are octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts(mountinfo: str, controller: str):
    """(version, mount root, mount point) of each cgroup2 mount and each v1 mount
    holding `controller`."""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or not tail:
            continue
        if tail[0] == "cgroup2":
            yield 2, _unescape(fields[3]), _unescape(fields[4])
        elif tail[0] == "cgroup" and len(tail) >= 3 and controller in tail[2].split(","):
            yield 1, _unescape(fields[3]), _unescape(fields[4])


def _relative(path: str, mount_root: str) -> str | None:
    """`path` (from /proc/self/cgroup) below the mount's root."""
    root = mount_root.rstrip("/")
    if path == root or path.startswith(root + "/"):
        return path[len(root):]
    return None


def _cgroups(controller: str, proc_cgroup: str, mountinfo: str):
    """(version, the directories from this process's cgroup up to its mount's
    top, innermost first) per hierarchy that holds `controller`."""
    try:
        # surrogateescape: a path need not be UTF-8
        with open(proc_cgroup, errors="surrogateescape") as f:
            memberships = f.read().splitlines()
        with open(mountinfo, errors="surrogateescape") as f:
            mounts = list(_mounts(f.read(), controller))
    except OSError:
        return
    for line in memberships:
        _hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        version = 2 if controllers == "" else 1 if controller in controllers.split(",") else 0
        for mount_version, mount_root, point in mounts:
            relative = _relative(path, mount_root)
            if mount_version != version or relative is None:
                continue
            parts = [p for p in relative.split("/") if p]
            yield version, [os.path.join(point, *parts[:depth])
                            for depth in range(len(parts), -1, -1)]


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name)) as f:
        return f.read()


def _quota(version: int, directory: str) -> float | None:
    """CPUs one cgroup's quota allows: v2 ``cpu.max`` ("200000 100000"; "max" is
    none), v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (-1 is none)."""
    if version == 2:
        quota, period = _read(directory, "cpu.max").split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    quota = int(_read(directory, "cpu.cfs_quota_us"))
    return None if quota < 0 else quota / int(_read(directory, "cpu.cfs_period_us"))


# Finding the quota reads mountinfo and a file per cgroup level, ~70 us, and
# main_spin.py asks whenever an iterator is made (every iter() without persistent
# workers: a short validation epoch paid it each time).
# A quota rarely changes: this process's answer is kept for a few seconds, for as
# long as it stays in the same cgroups (one moved elsewhere asks again).
_SELF_CGROUP = "/proc/self/cgroup"
_SELF_MOUNTINFO = "/proc/self/mountinfo"
_KEEP_S = 10.0
_kept = None   # (/proc/self/cgroup's text, _monotonic() when found, quota)


def _membership() -> str | None:
    try:
        with open(_SELF_CGROUP, errors="surrogateescape") as f:
            return f.read()
    except OSError:
        return None


def cpu_quota(proc_cgroup: str | None = None, mountinfo: str | None = None) -> float | None:
    """The tightest CPU quota on the way from this process's cgroup up (a
    parent's quota caps its children), in CPUs; None where there is none. Without
    arguments: this process's, found again at most every _KEEP_S seconds."""
    global _kept
    if proc_cgroup is not None or mountinfo is not None:
        return _tightest(proc_cgroup or _SELF_CGROUP, mountinfo or _SELF_MOUNTINFO)
    membership, now, kept = _membership(), _monotonic(), _kept
    if kept is not None and kept[0] == membership and 0 <= now - kept[1] < _KEEP_S:
        return kept[2]
    quota = _tightest(_SELF_CGROUP, _SELF_MOUNTINFO)
    _kept = (membership, now, quota)
    return quota


def _tightest(proc_cgroup: str, mountinfo: str) -> float | None:
    found = []
    for version, directories in _cgroups("cpu", proc_cgroup, mountinfo):
        for directory in directories:
            try:
                cpus = _quota(version, directory)
            except (OSError, ValueError, ZeroDivisionError):
                continue   # no such level here
            if cpus is not None:
                found.append(cpus)
    return min(found) if found else None
