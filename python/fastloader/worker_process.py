"""The worker processes as torch's iterator shows them: ``iter(loader)._workers``.

Libraries, tests and user code read torch's ``_MultiProcessingDataLoaderIter._workers``
(``w.pid``, ``w.is_alive()``, ``w.exitcode``, ``w.join()``) to watch, signal or wait
for the workers. fastloader's pool starts its workers as multiprocessing processes
too, but it closes them at shutdown to give back their sentinel fds at once, after
which a ``multiprocessing.Process`` raises ``ValueError`` on ``pid`` or ``exitcode``.
torch's workers stay readable after the iterator shut them down, so the pool keeps
each one in a ``WorkerProcess``: the Process surface, still answering (pid, name,
exit code) once closed, and never signalling a pid that may have been reused.

The pool's reaper thread (reaper.py) reaps and closes a worker after its epoch,
while user code may be joining or reading it: a lock makes close and every
read of the process object one step each (``join`` waits without it, on an fd of
its own, and reads the status under it)."""
from __future__ import annotations

import os
import threading
from multiprocessing.connection import wait as _wait_fds
from multiprocessing.process import BaseProcess
from typing import Optional

__all__ = ["WorkerProcess"]


class WorkerProcess(BaseProcess):
    """A started worker process with ``multiprocessing.Process``'s surface, and an
    instance of ``multiprocessing.process.BaseProcess`` (code checks isinstance).

    BaseProcess.__init__ is not called (as CPython's own _ParentProcess does not):
    it would make a second, unstarted process. Every public member is overridden
    here, so none of BaseProcess's reads the attributes __init__ would have set;
    the process is never registered as a child of this one (active_children() and
    multiprocessing's cleanup leave it to the pool, which reaps it)."""

    __slots__ = ("_proc", "_pid", "_name", "_daemon", "_exitcode", "_closed", "_lock")

    def __init__(self, proc):  # noqa: D107 -- BaseProcess.__init__ deliberately not called
        self._proc = proc
        self._pid = proc.pid
        self._name = proc.name
        self._daemon = proc.daemon
        self._exitcode: Optional[int] = None
        self._closed = False
        self._lock = threading.Lock()
        # reaped by someone else (see _poll_locked): its exit code 0 is a stand-in
        self.status_lost = False

    # -- identity (kept after close) --------------------------------------------------
    @property
    def pid(self) -> Optional[int]:
        return self._pid

    ident = pid

    @property
    def name(self) -> str:
        return self._name

    @property
    def daemon(self) -> bool:
        return self._daemon

    @property
    def authkey(self) -> bytes:
        return self._proc.authkey

    def start(self) -> None:
        raise AssertionError("cannot start a process twice")   # as multiprocessing says

    def run(self) -> None:
        raise RuntimeError("a fastloader worker runs in its own process only")

    def _check_closed(self) -> None:
        if self._closed:
            raise ValueError("process object is closed")

    @property
    def sentinel(self) -> int:
        if self._closed or self._proc_closed():
            raise ValueError("the worker has exited and its process object was closed")
        return self._proc.sentinel

    # -- state --------------------------------------------------------------------------
    @property
    def exitcode(self) -> Optional[int]:
        """None while running; the exit status, or -N for a death by signal N."""
        with self._lock:
            self._sync_closed()
            if not self._closed:
                self._exitcode = self._poll_locked()
            return self._exitcode

    def is_alive(self) -> bool:
        with self._lock:
            self._sync_closed()
            if self._closed:
                return False
            self._poll_locked()
            return self._proc.is_alive()

    def join(self, timeout: Optional[float] = None) -> None:
        # The wait holds no lock (a thread joining a stuck worker blocked every
        # shutdown's is_alive() and terminate() for as long as it waited): it waits
        # on an fd of its own (_exit_fd_locked), which a close() meanwhile leaves
        # open, and only then reads the status, under the lock (two readers of it
        # at once lose it: multiprocessing then says 255, or 0).
        fd = None
        try:
            with self._lock:
                self._sync_closed()
                if self._closed:
                    return
                self._exitcode = self._poll_locked()
                if self._exitcode is not None:
                    return
                fd = self._exit_fd_locked()
            exited = bool(_wait_fds([fd], timeout))
        finally:
            if fd is not None:
                os.close(fd)
        with self._lock:
            self._sync_closed()
            if self._closed:
                return
            if exited and self._poll_locked() is None:
                # (a sentinel closes as the process exits, a moment before it can
                # be reaped: wait for that moment, a blocking waitpid that returns
                # at once then, as multiprocessing's own join does)
                self._proc.join()
            self._exitcode = self._poll_locked()

    def _exit_fd_locked(self) -> int:
        """A new fd that reads as ready once the process has exited. Our own child
        (fork, spawn): a pidfd, since the sentinel, a pipe, stays open while
        anything the worker started holds its end (a forked helper, `cmd &`),
        long after the worker died. Otherwise (a forkserver's child) the sentinel
        is the server's status pipe, written once it reaped the process."""
        popen = getattr(self._proc, "_popen", None)
        if getattr(popen, "method", None) in ("fork", "spawn"):
            try:
                return os.pidfd_open(self._pid)
            except (OSError, AttributeError):   # a kernel or Python without pidfds
                pass
        return os.dup(self._proc.sentinel)

    def _poll_locked(self) -> Optional[int]:
        """The exit status, or None while the process runs.

        multiprocessing learns it from waitpid(), so once someone else has reaped
        the process (a program that ignores SIGCHLD, whose children the kernel
        reaps; an os.wait() elsewhere) it answers None for ever, and the reaper
        thread would wait for an exit that happened long ago. The sentinel, closed
        by the process's exit, tells that apart from a process still running: the
        status is then gone for good, and, as CPython's subprocess does in the same
        case, it is taken to be 0."""
        code = self._proc.exitcode
        popen = getattr(self._proc, "_popen", None)
        # forkserver's Popen reads the status from the server, not from waitpid
        if code is not None or getattr(popen, "method", None) not in ("fork", "spawn"):
            return code
        if not _wait_fds([self._proc.sentinel], 0):
            return None   # running
        try:
            pid, status = os.waitpid(self._pid, os.WNOHANG)
        except ChildProcessError:
            popen.returncode = 0   # reaped elsewhere: the status is lost
            self.status_lost = True
            return 0
        if pid == self._pid:   # it exited just now: it is reaped here, keep its status
            popen.returncode = os.waitstatus_to_exitcode(status)
        return popen.returncode

    # -- signals: only while the process is ours (not yet reaped) -----------------------
    def terminate(self) -> None:
        with self._lock:
            self._sync_closed()
            if not self._closed:
                self._proc.terminate()

    def kill(self) -> None:
        with self._lock:
            self._sync_closed()
            if not self._closed:
                self._proc.kill()

    def close(self) -> None:
        """Release the process object's resources (its sentinel fd). Raises
        ValueError, as multiprocessing does, while the process still runs."""
        with self._lock:
            self._close_locked()

    def _proc_closed(self) -> bool:
        """Whether the multiprocessing object is closed (or closing: a started
        process has no _popen only from close() on): a close interrupted (a
        Ctrl-C) before ours finished leaves it so, and it then raises on every
        question; it had exited, and its status was kept first."""
        return getattr(self._proc, "_closed", False) or getattr(self._proc, "_popen", 1) is None

    def _sync_closed(self) -> None:
        # (lock held)
        if not self._closed and self._proc_closed():
            self._closed = True

    def _close_locked(self) -> None:
        self._sync_closed()
        if self._closed:
            return
        code = self._proc.exitcode
        self._exitcode = code
        self._proc.close()   # raises while the process runs: nothing changes then
        self._closed = True

    # -- for the pool's reaper -------------------------------------------------------------
    def reap_and_close(self) -> bool:
        """Reap the process and close it if it has exited; never blocks (another
        thread reading its status holds the lock a moment: tried again later).
        True once closed."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._sync_closed()
            if not self._closed and self._poll_locked() is not None:
                self._close_locked()
            return self._closed
        finally:
            self._lock.release()

    def signal_nowait(self, sig: int) -> None:
        """Send `sig` unless the process was reaped; never waits for the lock
        (another thread reading the status holds it for one waitpid: the pid
        could be freed in that moment, not reused by then in practice)."""
        locked = self._lock.acquire(blocking=False)
        try:
            if locked:
                self._sync_closed()
            if locked and (self._closed or self._proc.exitcode is not None):
                return
            try:
                os.kill(self._pid, sig)
            except ProcessLookupError:
                pass
        finally:
            if locked:
                self._lock.release()

    def has_exited(self) -> bool:
        """Whether the process has exited (reaped or not); never blocks, and says
        False while another thread reading its status holds the lock."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._sync_closed()
            return self._closed or self._proc.exitcode is not None or bool(
                _wait_fds([self._proc.sentinel], 0))
        finally:
            self._lock.release()

    def exit_fd(self) -> Optional[int]:
        """The sentinel to wait on until the process exits; None once closed."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            self._sync_closed()
            return None if self._closed else self._proc.sentinel
        finally:
            self._lock.release()

    def __repr__(self) -> str:
        code = self.exitcode
        state = "started" if code is None else f"stopped exitcode={code}"
        return f"<WorkerProcess name={self._name!r} pid={self._pid} {state}>"
