"""What a child process that starts a fresh interpreter (spawn, or a server that
forks workers later) takes from this process at the moment it starts, as one
comparable value: a server started earlier serves workers faithfully only while
this is unchanged (spawn_server.py, forkserver.py)."""
from __future__ import annotations

import ctypes
import os
import resource
import signal
from multiprocessing import spawn

__all__ = ["start_state"]


def _stdio_identity(fd: int):
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _umask():
    # read, not set: os.umask() would change it for every thread meanwhile
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return line.split()[1]
    except OSError:
        pass
    return None


def _ignored_signals():
    ignored = []
    for sig in signal.valid_signals():
        try:
            if signal.getsignal(sig) is signal.SIG_IGN:
                ignored.append(int(sig))
        except (ValueError, OSError):
            pass
    return tuple(ignored)


def _c_environ():
    # what exec passes on is libc's environ, which os.putenv() and C libraries'
    # setenv() change without os.environ knowing
    try:
        entries = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    except (OSError, ValueError, AttributeError):
        return tuple(sorted(kv for kv in os.environb.items()
                            if not (kv[0] + b"=").startswith(_SET_BY_TORCH)))
    out = []
    i = 0
    while entries[i] is not None:
        if not entries[i].startswith(_SET_BY_TORCH):
            out.append(entries[i])
        i += 1
    return tuple(sorted(out))


# torch sets this at its first CUDA use, when unset (to LAZY): building the loaders,
# then `model.cuda()`, then training would otherwise cost a new server (a second)
# for a variable a worker's own CUDA use sets the same way
_SET_BY_TORCH = b"CUDA_MODULE_LOADING="


_RLIMITS = tuple(getattr(resource, name) for name in dir(resource)
                 if name.startswith("RLIMIT_"))


def start_state() -> tuple:
    """The executable, libc's environment, stdio, user and groups, process group
    and session, umask, CPU affinity, nice value, resource limits, ignored and
    blocked signals."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    return (
        spawn.get_executable(),
        _c_environ(),
        tuple(_stdio_identity(fd) for fd in (0, 1, 2)),
        os.geteuid(), os.getegid(), tuple(sorted(os.getgroups())),
        os.getpgrp(), os.getsid(0),
        _umask(),
        tuple(sorted(os.sched_getaffinity(0))),
        os.getpriority(os.PRIO_PROCESS, 0),
        tuple(resource.getrlimit(r) for r in _RLIMITS),
        _ignored_signals(),
        # SIGINT is blocked by fastloader itself while workers start (sigint.py)
        tuple(sorted(int(s) for s in blocked if s != signal.SIGINT)),
    )
