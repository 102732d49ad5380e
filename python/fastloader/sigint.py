"""Ctrl-C while child processes start (workers, the forkserver).

A child inherits the SIGINT disposition across fork and exec; started with SIGINT
ignored, a Ctrl-C during its start-up cannot print tracebacks from half-imported
modules: the main process handles Ctrl-C and stops the children. SIGINT is also
blocked here meanwhile, so a Ctrl-C meant for the main process stays pending
instead of being dropped. Used by pool.py (workers) and forkserver.py (the server).

Python's forkserver is one per process and also forks the program's own
processes, each with the SIGINT handler the server had once its preloads were
imported: restore_default_in_forkserver(), run by the last of them
(_forkserver_sigint.py), gives it Python's default back there, so those processes
see Ctrl-C as without fastloader. fastloader's own workers leave Ctrl-C to the
main process first thing (worker.worker_main, leave_ctrl_c_to_the_main_process);
under forkserver, the server's children run the main
module's imports before that, as torch's workers do."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

__all__ = ["children_ignore_sigint", "restore_default_in_forkserver",
           "leave_ctrl_c_to_the_main_process", "ignore_while_exiting"]


def _quiet_sigint():
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    old_handler = None
    if threading.current_thread() is threading.main_thread():
        current = signal.getsignal(signal.SIGINT)
        if current is not None:   # None: a handler installed outside Python
            old_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    return old_mask, old_handler


def _restore_sigint(old_mask, old_handler):
    if old_handler is not None:
        signal.signal(signal.SIGINT, old_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


@contextlib.contextmanager
def children_ignore_sigint():
    """Children started inside this block ignore SIGINT; a Ctrl-C that arrives
    meanwhile is delivered to this process when the block ends."""
    old_mask, old_handler = _quiet_sigint()
    try:
        yield
    finally:
        _restore_sigint(old_mask, old_handler)


def _in_forkserver_preload() -> bool:
    """Whether this runs inside Python's forkserver main(), preloading modules (not
    in a child it forked, whose stack also starts in main(), then _serve_one())."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    codes = {name: getattr(getattr(forkserver, name, None), "__code__", None)
             for name in ("main", "_serve_one")}
    if codes["main"] is None:
        return False
    in_main, frame = False, sys._getframe(1)
    while frame is not None:
        if frame.f_code is codes["_serve_one"]:
            return False
        in_main = in_main or frame.f_code is codes["main"]
        frame = frame.f_back
    return in_main


def restore_default_in_forkserver() -> None:
    """In a forkserver that fastloader started with SIGINT ignored (so that a
    Ctrl-C could not kill it half-way through importing torch), put Python's
    default handler back before the server's main() saves it for every child it
    forks. Run by the server's last preload (_forkserver_sigint.py)."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            and _in_forkserver_preload()):
        signal.signal(signal.SIGINT, signal.default_int_handler)


_worker_pid = None


def _main_process_handles_it(signum, frame):
    if os.getpid() != _worker_pid:
        # a process the worker forked (the dataset's own): Python's default, as it
        # has in a child of torch's worker
        signal.default_int_handler(signum, frame)


def leave_ctrl_c_to_the_main_process() -> None:
    """In a worker: Ctrl-C goes to the whole process group, and the main process
    handles it and stops the workers, so a worker must not raise KeyboardInterrupt
    (a traceback per worker). A handler that does nothing, not SIG_IGN: an ignored
    signal stays ignored across exec, so ffmpeg or a shell tool that the dataset
    starts would ignore Ctrl-C and outlive the program, where a handler goes back
    to the default at exec (as in a child of torch's worker, which does not
    ignore SIGINT)."""
    global _worker_pid
    _worker_pid = os.getpid()
    signal.signal(signal.SIGINT, _main_process_handles_it)


def ignore_while_exiting() -> None:
    """A worker leaving its loop: the interpreter's finalization puts a handler
    written in Python back to the default (SIG_IGN it keeps), so a Ctrl-C then
    would kill a worker still flushing its files (a generator's `finally`, a
    Finalize of its worker_init_fn). Nothing it starts from here on needs Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
