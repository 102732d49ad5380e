"""Sharing policy, in one place: which strategies exist and which is the default,
how a strategy name is validated, how fastloader names its shared segments (and
how a name is read back: by the stale-segment sweep, the doctor and the tests),
and which start method a loader's workers will use.

A strategy travels through the Python layer as its name; it becomes the C core's
integer flag only at the call into ``_core`` (``core_strategy``)."""
from __future__ import annotations

import multiprocessing
import os
import re
import uuid
from typing import NamedTuple, Optional

__all__ = ["STRATEGIES", "DEFAULT_STRATEGY", "check_strategy", "core_strategy",
           "loader_prefix", "pid_namespace", "UNKNOWN_NAMESPACE", "packed_segment_name", "SegmentName", "parse_segment_name",
           "resolve_start_method", "default_start_method"]

# ---- strategies ------------------------------------------------------------------------

# "file_descriptor": anonymous memfd segments passed by fd, nothing in /dev/shm;
# "file_system": named /dev/shm segments (0600), for processes short of fds.
STRATEGIES = ("file_descriptor", "file_system")
DEFAULT_STRATEGY = "file_descriptor"


def check_strategy(value) -> str:
    """`value` if it names a strategy, else the ValueError torch-style code expects."""
    if value not in STRATEGIES:
        valid = ", ".join(repr(s) for s in STRATEGIES)
        raise ValueError(f"sharing_strategy should be one of {valid}, but got {value!r}")
    return value


_CORE_FLAGS = {"file_descriptor": "STRATEGY_FD", "file_system": "STRATEGY_FS"}


def core_strategy(name: str, core) -> int:
    """The C core's flag for a strategy name, used only at the call into ``core``
    (the ``_core`` module: not imported here, so that the doctor can load this
    module even when the extension is broken)."""
    return getattr(core, _CORE_FLAGS[check_strategy(name)])


# ---- segment names ---------------------------------------------------------------------
#
# Every name embeds the pid of the process whose lifetime the segment belongs to and
# the identity of that pid's PID namespace, so a segment left behind by a SIGKILLed
# process can be recognised as stale, and only by a process that sees the same pids
# (containers sharing /dev/shm each have their own namespace):
#   loader channels: fastloader-<main pid>-<8 hex ns><10 hex>-w<worker>-<kind><id>-<token>
#                    (the C core appends everything after the prefix)
#   packed arrays:   fastloader-pack-<pid>-<8 hex ns><12 hex>

NAME_ROOT = "fastloader"
PACKED_ROOT = NAME_ROOT + "-pack"
_LOADER_TAG_HEX = 10
_PACKED_TAG_HEX = 12
# Written when our namespace cannot be read: matches no namespace, so never swept.
UNKNOWN_NAMESPACE = "00000000"

_LOADER_CHANNEL = re.compile(r"fastloader-(\d+)-[0-9a-f]{8}[0-9a-f]{%d}-w\d+-" % _LOADER_TAG_HEX)
_PACKED = re.compile(r"fastloader-pack-(\d+)-")
_ANY_LOADER = re.compile(r"fastloader-(\d+)-")
_NAMESPACED = re.compile(r"fastloader-(?:pack-)?(\d+)-([0-9a-f]{8})[0-9a-f]{10}")


def pid_namespace() -> Optional[str]:
    """Our PID namespace as 8 hex digits (its inode in nsfs), or None when it cannot be
    read, or when the /proc we see belongs to another namespace (then its pids are not
    ours to judge). Not cached: a process may unshare or be forked into a new one."""
    try:
        ino = os.stat("/proc/self/ns/pid").st_ino
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
    except OSError:
        return None
    return f"{ino & 0xFFFFFFFF:08x}"


def loader_prefix(pid: Optional[int] = None) -> str:
    """The finished prefix of one loader's channel segments, handed to the C core.
    Unpredictable (random tag), so another user cannot pre-create our names."""
    pid = os.getpid() if pid is None else pid
    namespace = pid_namespace() or UNKNOWN_NAMESPACE
    return f"{NAME_ROOT}-{pid}-{namespace}{uuid.uuid4().hex[:_LOADER_TAG_HEX]}"


def packed_segment_name(pid: Optional[int] = None) -> str:
    """A fresh name for a packed array's named segment (file_system strategy)."""
    pid = os.getpid() if pid is None else pid
    namespace = pid_namespace() or UNKNOWN_NAMESPACE
    return f"{PACKED_ROOT}-{pid}-{namespace}{uuid.uuid4().hex[:_PACKED_TAG_HEX]}"


class SegmentName(NamedTuple):
    kind: str          # "fastloader-pack" (a packed array) or "fastloader" (a loader's)
    pid: int           # the process whose lifetime it belongs to
    channel: bool      # a loader channel segment in full (what the sweep may remove)
    namespace: Optional[str]   # the pid's PID namespace (8 hex), None in older names


def parse_segment_name(name: str) -> Optional[SegmentName]:
    """What a /dev/shm name of ours is, or None for a name fastloader never makes."""
    ns = _NAMESPACED.match(name)
    namespace = ns.group(2) if ns else None
    match = _PACKED.match(name)
    if match:
        return SegmentName(PACKED_ROOT, int(match.group(1)), False, namespace)
    match = _ANY_LOADER.match(name)
    if match:
        return SegmentName(NAME_ROOT, int(match.group(1)),
                           _LOADER_CHANNEL.match(name) is not None, namespace)
    return None


# ---- start methods ---------------------------------------------------------------------

def default_start_method() -> str:
    """The method a context-less loader's workers use, found without fixing the
    process-wide default (torch fixes it only when the first iterator starts, and
    so must we; the doctor may run inside a user's program). The first entry of
    get_all_start_methods() is the platform default: 'fork' on Linux up to Python
    3.13, 'forkserver' from 3.14, 'spawn' on macOS and Windows."""
    return (multiprocessing.get_start_method(allow_none=True)
            or multiprocessing.get_all_start_methods()[0])


def resolve_start_method(context) -> str:
    """The start method of a ``multiprocessing_context`` (None, a method name or a
    context object)."""
    if context is None:
        return default_start_method()
    if isinstance(context, str):
        return context
    return context.get_start_method()
