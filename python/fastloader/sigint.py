"""Ctrl-C while child processes start (workers, the forkserver).

A child inherits the SIGINT disposition across fork and exec; started with SIGINT
ignored, a Ctrl-C during its start-up cannot print tracebacks from half-imported
modules: the main process handles Ctrl-C and stops the children. SIGINT is also
blocked here meanwhile, so a Ctrl-C meant for the main process stays pending
instead of being dropped. Used by pool.py (workers) and forkserver.py (the server)."""
from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["children_ignore_sigint"]


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
