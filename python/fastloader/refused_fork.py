"""What a refused fork leaves behind, and what it tells the user.

multiprocessing's fork start (`popen_fork.Popen._launch`) makes two pipes for the
child and then calls os.fork(); when the fork fails (EAGAIN at the process limit,
ENOMEM) the exception leaves `_launch` with all four pipe fds still open and no
object that owns them. torch's DataLoader leaks them the same way: a program that
retries `iter(loader)` while the machine is at its process limit runs out of fds
after a few hundred tries. The failed frame still holds the four numbers, so they
are closed from there: exactly those fds, made by this thread, that nothing else
knows. Reimplementing `_launch` instead would mean copying what the child does
after the fork, which changes between Python versions (3.12 added atexit handling).
"""
from __future__ import annotations

import errno
import os
import stat
from multiprocessing import popen_fork

# popen_fork.Popen._launch: parent_r, child_w = os.pipe(); child_r, parent_w = os.pipe()
_PIPES = (("parent_r", "child_w"), ("child_r", "parent_w"))   # (read end, write end)
_LAUNCH_CODE = popen_fork.Popen._launch.__code__

_WHY = {
    errno.EAGAIN: "the process limit was reached (`ulimit -u`, or the cgroup's pids.max "
                  "in a container)",
    errno.ENOMEM: "the kernel could not allocate memory for the new process (memory "
                  "is exhausted, or vm.overcommit_memory=2 and this process maps a lot "
                  "of memory)",
}


def close_pipes_of_refused_fork(exc: BaseException) -> list[int]:
    """Close the pipes that `popen_fork.Popen._launch` made for a child whose
    os.fork() raised `exc`; returns the fds closed. Closes nothing where the
    failure was not inside that function's fork (its frame not in the traceback,
    or a pipe not made yet)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code is not _LAUNCH_CODE:
        tb = tb.tb_next
    if tb is None:
        return []
    local = tb.tb_frame.f_locals
    if local.get("self") is None or getattr(local["self"], "pid", None) is not None:
        return []   # the fork returned: the Popen object owns its fds
    closed = []
    # only a pair that still is one pipe is closed, in case a later Python
    # closes them itself and the numbers are reused
    for read_name, write_name in _PIPES:
        pair = (local.get(read_name), local.get(write_name))
        if _one_pipe(*pair):
            for fd in pair:
                os.close(fd)
                closed.append(fd)
    return closed


def _one_pipe(read_fd, write_fd) -> bool:
    if not (isinstance(read_fd, int) and isinstance(write_fd, int)):
        return False
    try:
        a, b = os.fstat(read_fd), os.fstat(write_fd)
    except OSError:
        return False
    return (stat.S_ISFIFO(a.st_mode) and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino))


def explain(exc: BaseException, worker_id: int, workers: int) -> None:
    """Add a note naming the worker and the likely cause to an OSError of a
    refused fork; the exception itself (type, errno) stays what os.fork() raised,
    as torch's DataLoader raises it."""
    if not isinstance(exc, OSError) or not hasattr(exc, "add_note"):
        return
    why = _WHY.get(exc.errno, "")
    exc.add_note(f"fastloader: DataLoader worker {worker_id} of {workers} could not be "
                 "started" + (f": {why}" if why else ""))
