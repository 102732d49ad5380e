"""Ctrl-C while child processes start (workers, the forkserver).

While children start, SIGINT is blocked in the starting thread (and in the threads
it starts): a child inherits that mask, across exec too, so a Ctrl-C during its
start-up stays pending in it, and it cannot print tracebacks from half-imported
modules. A fastloader worker unblocks SIGINT once it has set its own handling
(worker.worker_main, leave_ctrl_c_to_the_main_process); a forkserver that
fastloader started unblocks it in every process it forks
(_forkserver_sigint.py), so that the program's own forkserver processes take
Ctrl-C as without fastloader.

In this process the SIGINT disposition is never set to ignore meanwhile: the
kernel hands a process-wide signal to any thread that does not block it (every
process that imported NumPy has one), and an ignored one would be dropped there.
Instead a Ctrl-C is held (DeferredCtrlC) and delivered once the caller has
recorded the children it started, so that none is left behind untracked.
Under forkserver, the server's children run the main module's imports with
Python's default handler, as torch's workers do. Used by pool.py and
forkserver.py."""
from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["DeferredCtrlC", "unblock_sigint", "leave_ctrl_c_to_the_main_process",
           "ignore_while_exiting"]


class DeferredCtrlC:
    """`with deferred:` children started inside start with SIGINT blocked; a Ctrl-C
    for this process meanwhile is held, and `deferred.deliver()` (after the block,
    once the caller's bookkeeping is done) acts on it as the handler this process
    had would have. Only the main thread can hold it (Python runs handlers there);
    elsewhere only the mask is set, and the main thread gets Ctrl-C as ever."""

    def __init__(self):
        self._old_mask = None
        self._old_handler = None
        self._held = False

    def _hold(self, signum, frame):
        self._held = True

    def __enter__(self):
        self._held = False
        self._old_mask = None
        self._old_handler = None
        if threading.current_thread() is threading.main_thread():
            current = signal.getsignal(signal.SIGINT)
            # SIG_IGN: nothing to hold (children ignore it too, as without us);
            # None: a handler installed outside Python, not ours to replace
            if current is not None and current is not signal.SIG_IGN:
                # first: pthread_sigmask runs pending handlers once it changed the
                # mask, and a Ctrl-C raised there would leave SIGINT blocked
                self._old_handler = signal.signal(signal.SIGINT, self._hold)
        try:
            self._old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())   # read only
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        except BaseException:   # another signal's handler raised: put all back
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        # Unblocking runs a pending handler at once (pthread_sigmask checks for
        # signals): with _hold still in place, a Ctrl-C that waited is held too.
        # (Another signal's handler may raise there: the handler goes back anyway.)
        try:
            if self._old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, self._old_mask)
        finally:
            if self._old_handler is not None:
                signal.signal(signal.SIGINT, self._old_handler)
        return False

    def deliver(self):
        """Act on a held Ctrl-C as this process's handler would have: Python's
        default raises KeyboardInterrupt here, a user's handler is called, SIG_DFL
        ends the process."""
        if not self._held:
            return
        self._held = False
        handler = self._old_handler
        if handler is signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)
        elif callable(handler):
            handler(signal.SIGINT, sys._getframe(1))


def unblock_sigint() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


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
