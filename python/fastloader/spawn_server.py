"""Spawn workers without paying torch's import every epoch (opt-in:
FASTLOADER_SPAWN_SERVER=1).

Under 'spawn' each worker is a fresh interpreter, and before its first sample it
imports torch: about a second on a quiet box, every epoch unless the workers are
persistent (torch's DataLoader pays it each time). With this on, fastloader keeps
per process one clean interpreter that has imported only torch and fastloader's
worker module (never the main module, nothing of this process's state): a private
multiprocessing forkserver. Each 'spawn' worker is a fork of it, and then goes on
as a spawned one does: multiprocessing's spawn preparation runs in it (sys.path,
cwd, argv, process name, authkey, the main module imported again as __mp_main__),
then the worker, then its atexit handlers. A worker's start costs milliseconds.

A fresh interpreter takes the process's state at the moment it starts; the server
took it when it started. So a server serves only while what a spawned child would
inherit is unchanged (start_state.py: libc's environment, stdio,
executable, user and groups, process group and session, umask, CPU affinity, nice
value, resource limits, ignored and blocked signals); otherwise a new server
starts, which costs what spawning cost. NumPy's global random state, which a fork
would share and a fresh interpreter draws anew, is reseeded from the OS in each
worker (_spawn_server_child.py). A server that died is started again; one that
does not fork a worker in time (REPLY_TIMEOUT_S) is killed and replaced.

What stays different from spawn, and why it is not the default (README, "What
differs"): os.getppid() in a worker is the server; torch is imported before the
main module is imported again, by the server, from the path a fresh `python -c`
has (Python's forkserver ignores the sys.path it is handed), so a torch or NumPy
that only the script's own sys.path changes would find is not the one workers
use; the workers share the server's str hash seed; state the list above does not
name (cgroup, NUMA policy, capabilities) is the server's; and a Ctrl-C while the
first epoch's workers start waits until the server has imported torch.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import io
import os
import signal
import threading
from multiprocessing import context as _mp_context
from multiprocessing import forkserver as _mp_forkserver
from multiprocessing import popen_forkserver, reduction, resource_tracker, spawn, util
from multiprocessing import process as _mp_process
from multiprocessing.connection import wait as _wait_fds

from . import forkserver
from .sharing import default_start_method
from .start_state import start_state

__all__ = ["enabled", "serves", "launching", "warm_up", "server_pid", "ServerHung"]

_ENV = "FASTLOADER_SPAWN_SERVER"
CHILD_MODULE = "fastloader._spawn_server_child"


class _State:
    """This process's server. One owner: every read and change is under `lock`,
    which a pool holds from choosing the server until its workers have started, so
    that no server is retired while a launch is using it."""

    lock = threading.RLock()
    restart_lock = threading.Lock()   # a dead server is started again by one thread
    server = None          # a multiprocessing ForkServer, or None
    start_state = None     # start_state() when it started
    owner_pid = None       # the process that started it (a forked child must not use it)
    launching_with = None  # the server the current launch connects to
    retired: list = []     # pids of servers given up, to be reaped
    answered: set = set()  # pids of servers that have forked a worker


def enabled() -> bool:
    # opt-in: see the module's docstring for what differs from spawn
    return os.environ.get(_ENV, "0") == "1"


def serves(context) -> bool:
    """Whether workers of this multiprocessing context (a context object, or a
    module such as torch.multiprocessing standing for the default one) are started
    from the server: spawn, with the standard library's own process class; a
    context of another kind may start its processes its own way, and is left to it."""
    if not enabled():
        return False
    try:
        method = context.get_start_method()
    except (AttributeError, ValueError):
        return False
    return _served(method, getattr(context, "Process", None))


def _served(method, process_class) -> bool:
    return method == "spawn" and process_class in _SERVED


def server_pid():
    if not _forgets_in_children:
        return None   # no server was ever made here
    with _State.lock:
        server = _State.server if _State.owner_pid == os.getpid() else None
        return getattr(server, "_forkserver_pid", None)


def warm_up(context, num_workers: int) -> None:
    """Called when a loader is built: if its workers will come from the server,
    start the server now, so that importing torch overlaps whatever the script does
    before its first batch."""
    if num_workers <= 0 or not enabled():
        return
    if context is None:
        # the default context (iterator.py), read without fixing the process-wide
        # start method, which torch fixes only when the first iterator starts
        method, process_class = default_start_method(), _mp_context.Process
    else:
        try:
            if isinstance(context, str):
                context = _mp_context._default_context.get_context(context)
            method, process_class = context.get_start_method(), context.Process
        except (AttributeError, ValueError):
            return   # an odd context: the loader deals with it at iteration
    if not _served(method, process_class):
        return
    _in_use()
    # never blocks: another thread starting workers holds the lock, and will
    # have started a server by the time this loader's first iter() asks
    if _State.lock.acquire(blocking=False):
        try:
            _current_server()
        finally:
            _State.lock.release()


@contextlib.contextmanager
def launching(context):
    """`with launching(context) as served:` processes made with served.Process()
    inside start as forks of a server that matches this process's start state, each
    of the class context.Process would have made (its name, "SpawnProcess-3" or
    "Process-3", shows in the worker). Only for a context that serves() accepts."""
    _in_use()
    with _State.lock:
        _State.launching_with = _current_server()
        try:
            yield _ServedContext(_SERVED[context.Process])
        finally:
            _State.launching_with = None


def _current_server():
    _reap_retired()
    # the tracker first: starting it unblocks SIGINT and SIGTERM in this thread,
    # which would make the state taken here differ from the server's
    resource_tracker.ensure_running()
    state = start_state()
    if _State.owner_pid != os.getpid():
        _State.server = None   # the parent's, inherited by fork (see _forget_in_child)
    elif _State.server is not None and _State.start_state != state:
        _retire(_State.server)
        _State.server = None
    if _State.server is None:
        server = _mp_forkserver.ForkServer()
        server.set_forkserver_preload([forkserver.PRELOAD_MODULE, CHILD_MODULE])
        _State.server, _State.start_state, _State.owner_pid = server, state, os.getpid()
    # started (or started again, if it died) with SIGINT blocked, as workers are
    forkserver.start_server(_State.server, preloading=True)
    return _State.server


def _retire(server) -> None:
    # Closing our end of its "alive" pipe lets it exit once its last worker has
    # (each worker holds a copy): it reports their exit codes until then.
    pid, fd = server._forkserver_pid, server._forkserver_alive_fd
    server._forkserver_pid = server._forkserver_alive_fd = None
    if fd is not None:
        os.close(fd)
    if pid is not None:
        _State.retired.append(pid)


def _reap_retired() -> None:
    for pid in list(_State.retired):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _State.retired.remove(pid)


def _forget_in_child() -> None:
    # A forked child inherits the parent's server object and a copy of its alive
    # fd; the server is not the child's to wait for, and the copy would keep it
    # alive as long as the child lives.
    server = _State.server
    fd = getattr(server, "_forkserver_alive_fd", None)
    _State.server = _State.start_state = _State.owner_pid = None
    _State.launching_with = None
    _State.retired = []
    _State.answered = set()
    _State.lock = threading.RLock()
    _State.restart_lock = threading.Lock()
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


_forgets_in_children = False


def _in_use() -> None:
    """Called before this module's state is first used (its lock taken, a server
    made). Only from then on does a forked child run _forget_in_child: a process
    that never uses the spawn server does not make each of its forked children
    (every forked worker among them) pay for the hook's writes (see
    per_process.py). Two threads that both register: the hook runs twice, the
    second time with nothing to forget."""
    global _forgets_in_children
    if not _forgets_in_children:
        # registered before the flag says so: no thread can use the state while a
        # fork would not yet run the hook
        os.register_at_fork(after_in_child=_forget_in_child)
        _forgets_in_children = True


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, connecting to this module's server
    instead of the process-wide one."""

    def _launch(self, process_obj):
        server = _State.launching_with
        if server is None:
            raise RuntimeError("a spawn-server process is started only inside "
                               "spawn_server.launching()")
        buf = io.BytesIO()
        _mp_context.set_spawning_popen(self)
        try:
            reduction.dump(spawn.get_preparation_data(process_obj._name), buf)
            reduction.dump(process_obj, buf)
        finally:
            _mp_context.set_spawning_popen(None)
        try:
            data_w = self._request(server)
        except (EOFError, OSError, ServerHung):
            # The server died (the OOM killer's favourite: it is big and idle) and
            # its pid was not yet reapable when it was checked, or it hung and was
            # killed: start it again, once. A pool starts its workers from several
            # threads at once: the first to get here starts the new server, the
            # others use it.
            with _State.restart_lock:
                if server._forkserver_pid == self._tried:
                    if not forkserver.has_died(server):
                        raise
                    forkserver.start_server(server, preloading=True)
            if self.finalizer is not None:
                self.finalizer()
                self.finalizer = None
            data_w = self._request(server)
        # The child exists: it reads what it needs from this pipe. (Written only
        # now: a hung server reads nothing, and a write bigger than the pipe would
        # block before any deadline could be checked.)
        with open(data_w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())

    def _request(self, server):
        """Ask the server for a child; returns our end of the child's data pipe."""
        self._tried = server._forkserver_pid   # the one a failed connect tried
        self.sentinel, w, pid = _connect(server, self._fds)
        self._tried = pid   # the one that answers (ensure_running() may have started it)
        try:
            # the child learns of our death by EOF on a copy of the data pipe
            parent_w = os.dup(w)
            self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
            # a server that has answered before only forks; its first answer waits
            # for its import of torch (seconds, more on a loaded box)
            timeout = REPLY_TIMEOUT_S if pid in _State.answered else FIRST_REPLY_TIMEOUT_S
            if not _readable(self.sentinel, timeout):
                with _State.restart_lock:   # not one another thread has replaced
                    if server._forkserver_pid == pid:
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)   # ours, of no use now
                        _State.answered.discard(pid)   # a later server may reuse it
                raise ServerHung(f"fastloader's spawn server (pid {pid}) started no "
                                 f"worker in {timeout:.0f} s and was killed; the next "
                                 "start of workers starts a new one")
            self.pid = _mp_forkserver.read_signed(self.sentinel)
        except BaseException:
            os.close(w)
            raise
        _State.answered.add(pid)
        return w


def _connect(server, fds):
    """server.connect_to_new_process(fds), with the server's address, "alive" fd
    and pid read together under its lock. connect_to_new_process() reads them after
    it has let the lock go, and a pool starts its workers from several threads: one
    that finds the server dead clears them while it starts the next, and another
    thread read None (a TypeError, not an error that starts the server again). So
    the request goes through a copy of the server taken under the lock, whose
    ensure_running() does nothing: the fields it reads are one server's, and if
    that one has died since, the connect or the send fails with an OSError, which
    _launch() answers by starting the server again. (Through CPython's own method,
    so the protocol is each Python version's: 3.14 adds an authentication step.)
    Returns (the fd the child's pid and exit code come on, our end of its data
    pipe, the pid of the server asked)."""
    server.ensure_running()
    with server._lock:
        one = copy.copy(server)
    if (one._forkserver_address is None or one._forkserver_alive_fd is None
            or one._forkserver_pid is None):
        # a start that failed in another thread: _launch() tries once more
        raise ConnectionError("fastloader's spawn server is not running")
    one.ensure_running = lambda: None   # checked above, under the lock
    status_r, data_w = one.connect_to_new_process(fds)
    return status_r, data_w, one._forkserver_pid


# How long the server may take to fork a worker. One that has not answered by then
# is stuck (stopped, or deadlocked by a lock some thread held when it forked) and
# would otherwise hold the training loop for ever.
REPLY_TIMEOUT_S = 60.0
FIRST_REPLY_TIMEOUT_S = 600.0


class ServerHung(RuntimeError):
    """The spawn server did not answer a worker's start in REPLY_TIMEOUT_S."""


def _readable(fd: int, timeout: float) -> bool:
    # multiprocessing's wait polls (as reaper.py's does): select() cannot take an
    # fd above 1023, which a process with many open files hands out
    return bool(_wait_fds([fd], timeout))


class _Served:
    """What a served process does differently from the class it stands for."""

    _Popen = staticmethod(_Popen)
    # it was forked: the server's finalizers are not this process's to run, and
    # multiprocessing's after-fork hooks run, as in any forked process
    _after_fork = staticmethod(_mp_process.BaseProcess._after_fork)

    def _bootstrap(self, parent_sentinel=None):
        code = super()._bootstrap(parent_sentinel)
        # The forkserver ends its children with os._exit(); a spawned child's
        # interpreter runs its atexit handlers (weakref.finalize, TemporaryDirectory,
        # logging.shutdown, a profiler's dump) as it exits: run them here. (CPython
        # clears the list as it runs it: a server that runs them too runs none twice.)
        atexit._run_exitfuncs()
        return code


class _ServedSpawnProcess(_Served, _mp_context.SpawnProcess):
    pass


class _ServedProcess(_Served, _mp_context.Process):
    pass


# Named as the classes they stand for (BaseProcess names a process after its
# class); pickled by their qualified names, which are this module's.
_ServedSpawnProcess.__name__ = "SpawnProcess"
_ServedProcess.__name__ = "Process"
_SERVED = {_mp_context.SpawnProcess: _ServedSpawnProcess,
           _mp_context.Process: _ServedProcess}


class _ServedContext:
    """What pool.py needs of a context: Process() and get_start_method()."""

    def __init__(self, process_class):
        self.Process = process_class

    @staticmethod
    def get_start_method(allow_none=False):
        return "spawn"
