"""A forkserver that already holds torch.

Under the 'forkserver' start method (Python's default on Linux from 3.14),
every worker is forked from one server process. By default the server is meant
to preload only the main module, and on Python 3.11 not even that happens (the
main module's path is handed over under a key the server never reads). Each
worker then imports torch on its own (about a second), and does so again every
epoch unless the workers are persistent; torch's DataLoader pays that each time.

fastloader adds its worker module, and with it torch, to the server's preload
list, and starts the server as soon as a loader that will use it is built. The
import then overlaps whatever the script does before its first batch, and each
worker after that is a fork of a warm process: milliseconds, not seconds.

Nothing changes when the server already runs (a preload would come too late),
and ``FASTLOADER_FORKSERVER_PRELOAD=0`` turns the whole thing off.

torch's server starts at the first iter(), and its workers take the environment
(and the rest of start_state.py) as it is then. So when what the server took at
the loader's construction has changed by the first iter(), it is replaced by one
started then, unless live processes of the program's came from it or are coming.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from multiprocessing import context as _mp_context
from multiprocessing import forkserver as _mp_forkserver
from multiprocessing import resource_tracker, util
from multiprocessing.connection import wait as _wait_fds

from .per_process import PerProcess
from .sharing import resolve_start_method
from .sigint import DeferredCtrlC
from .start_state import start_state

PRELOAD_MODULE = "fastloader.worker"
SIGINT_MODULE = "fastloader._forkserver_sigint"   # always the last preload
_ENV = "FASTLOADER_FORKSERVER_PRELOAD"


class _Warmed:
    """The server warm_up() started, until workers are first started from it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pid = None
        self.state = None   # start_state() when it started


# This process's: a forked child shares the parent's server, which is not its to
# replace (per_process.py)
_WARMED = PerProcess(_Warmed)


def _server():
    # The process-wide ForkServer behind every 'forkserver' context; private in
    # multiprocessing, so every use below tolerates its absence.
    return getattr(_mp_forkserver, "_forkserver", None)


def server_pid():
    """The running forkserver's pid, or None."""
    server = _server()
    return getattr(server, "_forkserver_pid", None) if server is not None else None


def enabled() -> bool:
    return os.environ.get(_ENV, "1") != "0"


def add_preload() -> bool:
    """Put fastloader's worker module on the server's preload list, keeping the
    user's own entries. True when the server has yet to start, so the list will
    count."""
    server = _server()
    if not enabled() or server is None or not hasattr(server, "_preload_modules"):
        return False
    if server_pid() is not None:
        return False
    modules = list(server._preload_modules or [])
    if PRELOAD_MODULE not in modules:
        server.set_forkserver_preload(modules + [PRELOAD_MODULE])
    return True


def warm_up(context, num_workers: int) -> None:
    """Called when a loader is built: if it will start workers through the
    forkserver, start the server now with torch preloaded."""
    if num_workers <= 0:
        return
    try:
        method = resolve_start_method(context)
    except (ValueError, AttributeError):
        return   # an odd context object: leave everything to iteration time
    if method == "forkserver" and add_preload():
        # the tracker first: starting it unblocks SIGINT and SIGTERM in this
        # thread, which would make the state taken here differ from the server's
        resource_tracker.ensure_running()
        state = start_state()
        start_server(_server(), preloading=True)
        warmed = _WARMED.get()
        with warmed.lock:
            warmed.pid, warmed.state = server_pid(), state


def ensure_running() -> None:
    """Before workers start through the forkserver: the server runs, started
    here if it does not yet (with the preload, unless turned off), never inside
    the block in which the workers start with SIGINT ignored, which it would
    pass on to every process it forks."""
    server = _server()
    if server is not None:
        _replace_if_stale(server)
        start_server(server, preloading=add_preload())


def has_died(server, timeout: float = 10.0) -> bool:
    """Whether a ForkServer's process is dead or dies within `timeout` (it may be
    dying), without reaping it: ensure_running() reaps it and starts a new one."""
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return True
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:   # no pidfds (Linux < 5.3): it is not known to have died
        return False
    try:
        # readable once it exits (multiprocessing's wait polls: an fd above 1023,
        # which a process with many open files hands out, is fine)
        return bool(_wait_fds([fd], timeout))
    finally:
        os.close(fd)


# What a worker's start through the forkserver raises when the server died as it
# started, before it could have forked the worker: Python's connect_to_new_process()
# reads the server's address after letting go of its lock, so a thread whose check
# found the server running reads None (TypeError) while another that found it dead
# starts the next; a connect to a dead server's socket is refused or finds no file,
# and passing it the fds meets a closed socket. Counted only when raised inside
# connect_to_new_process(): the same errors from pickling the worker's data (a
# dataset whose __getstate__ opens a missing file), or a broken pipe writing it to a
# child that failed to unpickle it, are the user's, and must not wait on the server.
# Never EOFError: the server may have forked the worker before it died (and been
# sent its data), and a second start would give its channel two workers.
_LOST_SERVER_ERRORS = (TypeError, ConnectionError, FileNotFoundError)
_MP_FORKSERVER_PY = os.path.join("multiprocessing", "forkserver.py")


def lost_during_start(exc: BaseException, pid_before) -> bool:
    """Whether a worker's start failed with `exc` because the forkserver (pid
    `pid_before` when the pool began starting workers) died as it started, before
    it forked the worker: then starting it once more is safe, and starts the next
    server (or uses the one another thread's start has started). The pool starts
    workers from several threads at once, which torch does not."""
    server = _server()
    if (pid_before is None or server is None or not isinstance(exc, _LOST_SERVER_ERRORS)
            or not _raised_connecting(exc)):
        return False
    if getattr(server, "_forkserver_pid", None) != pid_before:
        return True   # replaced, or being replaced, by another thread's start
    return has_died(server, timeout=5.0)


def _raised_connecting(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if (code.co_name == "connect_to_new_process"
                and code.co_filename.endswith(_MP_FORKSERVER_PY)):
            return True
        tb = tb.tb_next
    return False


def _replace_if_stale(server) -> None:
    # The first start of workers from a server warm_up() started: if what a
    # server takes from this process changed since (an environment variable set
    # after the loader was built), replace it, and a new one starts now, as torch's
    # would. Not while processes of the program's that came from it live (they
    # learn their exit codes from it; one that has exited does not count), nor
    # while another thread is starting
    # one (its request may wait in the server's queue while the server imports
    # torch, and would be lost). The lock is held throughout, so that another
    # loader's first iter() waits for the new server instead of connecting to the
    # old one.
    warmed = _WARMED.get()
    with warmed.lock:
        pid, state = warmed.pid, warmed.state
        warmed.pid = warmed.state = None
        if pid is None or pid != server_pid() or start_state() == state:
            return
        with server._lock:   # what ensure_running() does for a server found dead
            if (server._forkserver_pid != pid or _has_children(pid)
                    or _another_thread_starts_a_process()):
                return
            try:
                # maybe half-way through importing torch. With SIGCHLD ignored the
                # kernel reaps it itself (and it may be gone already).
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                os.close(server._forkserver_alive_fd)
                address = server._forkserver_address
                if isinstance(address, str) and not util.is_abstract_socket_namespace(
                        address):
                    with contextlib.suppress(OSError):
                        os.unlink(address)
            finally:
                server._forkserver_address = server._forkserver_alive_fd = None
                server._forkserver_pid = None


def _another_thread_starts_a_process() -> bool:
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        while ident != me and frame is not None:
            if frame.f_code.co_filename.endswith(_MP_FORKSERVER_FILES):
                return True
            frame = frame.f_back
    return False


_MP_FORKSERVER_FILES = tuple(os.path.join("multiprocessing", name)
                             for name in ("forkserver.py", "popen_forkserver.py"))


def _has_children(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return bool(f.read().split())
    except OSError:
        return True   # not known: leave it


def start_server(server, preloading: bool) -> None:
    """Start a multiprocessing ForkServer (Python's, or spawn_server.py's own) unless
    it runs; preloading: its preload list holds fastloader's worker module."""
    # Started with SIGINT blocked (below), the server unblocks it in every process
    # it forks, by a last preload (for the program's own forkserver processes,
    # see sigint.py)
    modules = [m for m in (getattr(server, "_preload_modules", None) or [])
               if m != SIGINT_MODULE]
    if hasattr(server, "_preload_modules"):
        server.set_forkserver_preload(modules + [SIGINT_MODULE] if preloading else modules)
    with _start_method_left_unfixed():
        if preloading:
            _start_blocking_sigint(server)
        else:
            server.ensure_running()   # as Python would start it


@contextlib.contextmanager
def _start_method_left_unfixed():
    # With a preload list, starting a server reads multiprocessing's preparation
    # data, which fixes the process-wide start method; torch fixes it only when its
    # first iterator starts, and building a loader must not (a later
    # multiprocessing.set_start_method() would raise): undo exactly that.
    default = _mp_context._default_context
    unset = getattr(default, "_actual_context", True) is None
    try:
        yield
    finally:
        if unset and getattr(default, "_actual_context", None) is getattr(
                default, "_default_context", False):
            default._actual_context = None


def _start_blocking_sigint(server) -> None:
    # SIGINT blocked while it starts, as for workers (see sigint.py): a Ctrl-C
    # must not kill the server half-way through importing torch. The resource
    # tracker first: starting it unblocks SIGINT in the calling thread
    # (multiprocessing.resource_tracker), which would undo the block.
    resource_tracker.ensure_running()
    deferred = DeferredCtrlC()
    try:
        with deferred:
            server.ensure_running()
    finally:
        deferred.deliver()
