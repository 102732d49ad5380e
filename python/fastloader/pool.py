"""Starting, watching and stopping worker processes.

Processes are started through the loader's multiprocessing context ('fork',
'spawn', 'forkserver' or a context object), so every start method torch supports
works (with FASTLOADER_SPAWN_SERVER=1, 'spawn' workers are forks of a clean
server: spawn_server.py). Each worker's channel fds cross to the child with
multiprocessing's own fd passing (inherited under fork, passed under
spawn/forkserver). Liveness is watched from C through a pidfd per worker; this
module turns a death into a clear error."""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import inspect
import os
import pickle
import signal
import sys
import threading
import time
import warnings
import weakref
from multiprocessing import popen_fork, process as _mp_process, reduction, resource_tracker
from multiprocessing import util as _mp_util
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import (_core, forkserver, payload, reaper, refused_fork, sharing, shm_sweep,
               spawn_server, torch_sites)
from .per_process import PerProcess
from .fork_prep import prepare_for_fork
from .distributed import rank_info
from .packed import loader_strategy, starting_strategy
from .protocol import TASK_SHUTDOWN
from .sigint import DeferredCtrlC
from .warn_site import stacklevel_outside
from .worker import worker_main
from .worker_process import WorkerProcess

class _Live:
    """This process's pools, the fds of their channels and the count of their
    workers. One per process (per_process.py): a forked child starts with none
    of its own, the parent's are never the child's to list, stop or count, and
    locks that fork copied held by another thread (the reaper's) are not used."""

    def __init__(self):
        # Main-process ends of live channels: a worker forked later is told to
        # close them at start (worker.close_inherited_fds).
        self.main_fds: set = set()
        self.pools: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()
        # re-entrant: a signal handler that shuts a loader down may run while this
        # thread holds it
        self.lock = threading.RLock()
        # The workers of this process's pools, from their start until they are
        # reaped: the main process's spin rule (main_spin.py) reads it per batch,
        # so it is one int, not a walk over the pools. Counted off where a pool
        # leaves `pools` (shut down, or reaped by the reaper thread), not when it
        # is collected: a collected iterator hands its pool to the reaper, whose
        # workers run on until reaped. A pool leaked without either stays counted:
        # the spin then stays off, which costs speed, never CPU taken from a
        # worker. (One the reaper gives up on is counted off: see abandon().)
        self.workers = 0
        # re-entrant: a signal handler (or, from 3.12, a collection) that shuts a
        # loader down may run between the lines of _count_workers, on the same
        # thread
        self.count_lock = threading.RLock()


_LIVE = PerProcess(_Live)


def main_fds() -> set:
    """The main-process ends of this process's live channels."""
    return _LIVE.get().main_fds


def live_workers() -> int:
    """Worker processes this process has started and not yet reaped."""
    return _LIVE.get().workers


def _count_workers(pool, n: int) -> None:
    """Count `n` workers of `pool` on (n > 0) or all of its workers off (n == 0),
    once: the main thread's shutdown and the reaper thread may both get there."""
    live = _LIVE.get()
    mine = os.getpid() == pool.owner_pid   # a forked child's copy counts nothing
    with live.count_lock:
        # two stores, no call between them that a signal handler could interrupt
        before, pool._counted = pool._counted, n
        live.workers += (n - before) if mine else 0


def _unregister_child(proc) -> None:
    """Take a started worker out of multiprocessing's children: the pool reaps it
    (reaper.py). Left in, a process forked from this one (os.fork()) that exits
    normally had multiprocessing's exit hook SIGTERM it (the loop here then failed
    with WorkerError), and multiprocessing.active_children() reaped it, taking its
    exit status from the pool."""
    children = getattr(_mp_process, "_children", None)
    if isinstance(children, set):
        children.discard(proc)


@dataclass
class WorkerSpec:
    """Everything a worker needs; pickled per worker under spawn/forkserver,
    except the heavy part when payload.py can send that once."""
    dataset_kind: int
    dataset: Any
    auto_collation: bool
    collate_fn: Callable
    drop_last: bool
    base_seed: int
    worker_init_fn: Optional[Callable]
    worker_id: int
    num_workers: int
    nslots: int
    snapshot_every: int = 0   # see resume.py
    rank_text: str = ""       # " on rank R of W" in a distributed job, for messages
    shared_seed: Optional[int] = None   # IterDataPipe: one seed for all workers
    # (fd, size) of the dataset, collate_fn and worker_init_fn pickled once for
    # all workers (see payload.py); those three fields are None then
    payload: Any = None


class _Fd:
    """An fd argument of the worker process: inherited as is under fork, passed by
    multiprocessing (SCM_RIGHTS / pass_fds) when the process object is pickled."""

    def __init__(self, fd: int):
        self.fd = fd

    def detach(self) -> int:
        return self.fd

    def __reduce__(self):
        return _Fd._rebuild, (reduction.DupFd(self.fd),)

    @staticmethod
    def _rebuild(dup):
        return _Fd(dup.detach())


def _fd_arg(fd: int):
    return _Fd(fd) if fd >= 0 else -1


def _share_heavy_part(specs):
    """The workers' dataset, collate_fn and worker_init_fn in one shared pickle,
    or None where each worker's start must pickle its own (see payload.py)."""
    first = specs[0]
    heavy = (first.dataset, first.collate_fn, first.worker_init_fn)
    if any(s.dataset is not heavy[0] or s.collate_fn is not heavy[1]
           or s.worker_init_fn is not heavy[2] for s in specs):
        return None
    blob = payload.pickle_once(heavy)
    if blob is None or len(blob) < payload.MIN_BYTES:
        return None
    return payload.SharedPickle(blob)


def _explain_start_error(exc, method):
    """Warn as torch's DataLoader does when a worker's arguments do not pickle,
    then re-raise the error unchanged. torch's warning points at the line of its
    own dataloader module where its iterator is made, so a filter on that module
    silences it; fastloader's points at the first frame outside fastloader: for
    `iter(loader)` that same line (torch_sites.new_multiprocessing_iter)."""
    # the installed torch's hint, or none where its DataLoader gives none (2.5 and
    # older; torch_sites reads it from torch's code)
    if torch_sites.pickle_hint is not None and isinstance(
            exc, (TypeError, AttributeError, pickle.PicklingError)):
        warnings.warn(torch_sites.pickle_hint, stacklevel=stacklevel_outside("fastloader"))
    raise exc


# What Python 3.12+ warns at os.fork() in a process with other threads, from there
_FORK_WARNING = ("This process (pid={pid}) is multi-threaded, use of fork() may lead "
                 "to deadlocks in the child.")
_FORK_WARNING_MODULE = "multiprocessing.popen_fork"


def _fork_warning_would_show() -> bool:
    """Whether the warnings filters let that DeprecationWarning be shown: by
    default they ignore it outside __main__, and CPython drops it where a filter
    makes it an error (it cannot raise from inside fork)."""
    text = _FORK_WARNING.format(pid=os.getpid())
    for action, message, category, module, lineno in warnings.filters:
        if (_filter_matches(message, text) and issubclass(DeprecationWarning, category)
                and _filter_matches(module, _FORK_WARNING_MODULE)
                and lineno in (0, _fork_call_line())):
            return action not in ("ignore", "error")
    return warnings.defaultaction not in ("ignore", "error")


@functools.lru_cache(maxsize=None)
def _fork_call_line() -> int:
    """The line of multiprocessing's os.fork() call, where that warning points."""
    try:
        lines, first = inspect.getsourcelines(popen_fork.Popen._launch)
    except (OSError, TypeError, AttributeError):
        return -1
    return next((first + i for i, line in enumerate(lines) if "os.fork()" in line), -1)


def _filter_matches(pattern, text) -> bool:
    # as the warnings machinery reads a filter: None matches anything, a compiled
    # pattern matches from the start, a plain string (interpreter-made filters,
    # such as the one for __main__) must be equal
    if pattern is None:
        return True
    if isinstance(pattern, str):
        return pattern == text
    return pattern.match(text) is not None


@contextlib.contextmanager
def _reaper_thread_is_fork_safe(method):
    """Python 3.12+ warns at fork() when the process has other threads. While the
    reaper thread (reaper.py) waits for a past epoch's workers, that warning is
    about our own thread, which no fork catches holding a lock (see
    reaper._before_fork), and the child starts with a fresh reaper state: do not
    let it fire for it. Only where it would fire and be seen: catch_warnings()
    resets every module's record of the warnings it has shown, so a warning shown
    "once per location" would show again after each epoch's fork (no such warning
    before 3.12, and the default filters ignore it)."""
    if (method != "fork" or sys.version_info < (3, 12) or not reaper.busy()
            or not _fork_warning_would_show()):
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"This process \(pid=\d+\) is multi-threaded",
                                category=DeprecationWarning)
        yield


class WorkerPool:
    def __init__(self, context, specs, strategy: str, task_capacity: int,
                 result_capacity: int, task_window: int = 0):
        self.owner_pid = os.getpid()
        self.strategy_name = sharing.check_strategy(strategy)
        self.prefix = sharing.loader_prefix(self.owner_pid)
        self.channels: list = []
        self.procs: list = []
        self._pids: list = []
        self._closed = False
        self._channels_released = False
        self._deadline = 0.0
        self._escalated = 0
        if self.strategy_name == "file_system":
            # segments a SIGKILLed loader of ours left behind (see shm_sweep.py)
            shm_sweep.sweep_dead_loaders()
        live = _LIVE.get()
        with live.lock:
            live.pools.add(self)
        self._counted = 0
        _count_workers(self, len(specs))
        _exit_hook_for_this_process()
        try:
            self._start_all(context, specs, strategy, (task_capacity, result_capacity, task_window))
        except BaseException:
            self.shutdown()
            raise
        self.channel_tuple = tuple(self.channels)

    def _start_all(self, context, specs, strategy, rings):
        reaper.flush()   # a past epoch's workers that no thread could reap yet
        method = context.get_start_method()
        if method == "spawn" and spawn_server.serves(context):
            # opt-in: forks of a clean interpreter that has imported torch
            # (spawn_server.py)
            with spawn_server.launching(context) as served:
                self._start_all_of(served, method, specs, strategy, rings)
        else:
            self._start_all_of(context, method, specs, strategy, rings)

    def _start_all_of(self, context, method, specs, strategy, rings):
        if method == "forkserver":
            forkserver.ensure_running()   # in case the loader did not start it already
        if method == "fork":
            prepare_for_fork()
        if method == "fork":
            # Every channel first, then the forks one right after the other: after
            # the first fork each page the main process writes is a copy-on-write
            # fault, and making a channel and a Process object between two forks
            # wrote ~270 pages (~1.1 ms between the forks; ~0.4 ms now, on a 2-vCPU
            # VM). A worker then inherits its later siblings' channel ends too,
            # and closes them with the rest (_fork_close_list). A listed number
            # that another thread (the reaper's) closes before a later fork can go
            # to that fork's own pipe: a worker closes a number only where it
            # still names what was listed (worker.close_inherited_fds).
            channels = [self._open_channel(spec, strategy, rings) for spec in specs]
            inherited = self._fork_close_list(channels)
            self._launch([self._process(context, spec, ch, inherited)
                          for spec, ch in zip(specs, channels)], method)
            return
        if len(specs) == 1:
            self._launch([self._prepare(context, specs[0], strategy, rings)], method)
            return
        # spawn/forkserver: Process.start() writes the pickled dataset into a pipe
        # that the child reads only after importing the main module (seconds,
        # with torch); started one after the other, big datasets would serialise
        # the workers' start-up. Start them all at once instead.
        # The dataset is pickled once for all of them where that is valid.
        with loader_strategy(self.strategy_name):
            shared = _share_heavy_part(specs)
        try:
            if shared is not None:
                specs = [dataclasses.replace(spec, dataset=None, collate_fn=None,
                                             worker_init_fn=None,
                                             payload=(_Fd(shared.fd), shared.size))
                         for spec in specs]
            procs = [self._prepare(context, spec, strategy, rings)
                     for spec in specs]
            self._launch(procs, method)
        finally:
            if shared is not None:
                shared.close()   # every child has its own copy of the fd by now

    def _prepare(self, context, spec, strategy, rings):
        """A spawned or forkserver worker's process (it inherits no fds of ours)."""
        return self._process(context, spec, self._open_channel(spec, strategy, rings), ())

    def _open_channel(self, spec, strategy, rings):
        """rings: (task_capacity, result_capacity, task_window), see _core.MainChannel"""
        ch = _core.MainChannel(spec.worker_id, sharing.core_strategy(strategy, _core), self.prefix,
                               *rings)
        self.channels.append(ch)
        main_fds().update(ch.main_fds())
        return ch

    @staticmethod
    def _fork_close_list(channels):
        """The fds a forked worker inherits and must close (worker_main keeps its
        own channel's), as (fd, st_dev, st_ino): the main ends of every live
        channel, and the worker ends of its siblings' channels, which the main
        process holds until each sibling has started."""
        fds = set(main_fds())
        for ch in channels:
            h = ch.handle()
            fds.update((h["ctl_fd"], h["efd_main"], h["efd_worker"], h["sock"]))
        listed = []
        for fd in sorted(fd for fd in fds if fd >= 0):
            try:
                st = os.fstat(fd)
            except OSError:   # not open: nothing for a worker to close
                continue
            listed.append((fd, st.st_dev, st.st_ino))
        return tuple(listed)

    @staticmethod
    def _process(context, spec, ch, inherited):
        h = ch.handle()
        fds = (_fd_arg(h["ctl_fd"]), _fd_arg(h["efd_main"]), _fd_arg(h["efd_worker"]),
               _fd_arg(h["sock"]))
        return context.Process(target=worker_main, args=(spec, h, fds, inherited),
                               daemon=True)

    def _launch(self, procs, method):
        errors = [None] * len(procs)
        started = [False] * len(procs)

        server_before = forkserver.server_pid() if method == "forkserver" else None

        def start(i):
            try:
                try:
                    procs[i].start()
                except BaseException as exc:
                    if not (method == "forkserver"
                            and forkserver.lost_during_start(exc, server_before)):
                        raise
                    # the server died as this worker started, before it forked
                    # it: once more, from the next server
                    procs[i].start()
            except BaseException as exc:   # re-raised below, in the caller's thread
                errors[i] = exc
                # a refused fork: multiprocessing leaves the child's pipes open
                refused_fork.close_pipes_of_refused_fork(exc)
                if method in ("fork", "spawn"):
                    refused_fork.explain(exc, len(self.procs) + i, len(procs))
                return False
            # at once: the next Process.start() would reap it, were it dead
            # already, before its pidfd is opened (_record_started)
            _unregister_child(procs[i])
            started[i] = True
            return True

        if method != "fork":
            # starting it unblocks SIGINT in the calling thread (see forkserver.py)
            resource_tracker.ensure_running()
        deferred = DeferredCtrlC()
        try:
            with deferred, loader_strategy(self.strategy_name), \
                    _reaper_thread_is_fork_safe(method):
                self._start_procs(procs, start, method)
                self._record_started(procs, started, errors, method)
        finally:
            # a Ctrl-C during the start only now: every started worker is the
            # pool's to stop
            deferred.deliver()

    @staticmethod
    def _start_procs(procs, start, method):
        # (a thread-local strategy would not reach the threads: pass it along)
        strategy = starting_strategy()

        def start_in_thread(i):
            with loader_strategy(strategy):
                start(i)

        if len(procs) == 1 or method == "fork":
            # fork: one after the other in this thread (a fork is the main
            # process's own work; threads would only add theirs between the forks),
            # none after one that failed: the pool stops the started ones anyway
            for i in range(len(procs)):
                if not start(i):
                    return
            return
        threads = []
        for i in range(len(procs)):
            t = threading.Thread(target=start_in_thread, args=(i,), daemon=True)
            try:
                t.start()
            except RuntimeError:   # "can't start new thread" (the process limit)
                start_in_thread(i)   # this one here, the others go on meanwhile
                continue
            threads.append(t)
        for t in threads:
            t.join()

    def _record_started(self, procs, started, errors, method):
        first = len(self.procs)
        for i, proc in enumerate(procs):
            if started[i]:
                self.procs.append(WorkerProcess(proc))
                self._pids.append(proc.pid)
                ch = self.channels[first + i]
                ch.started(proc.pid)
                main_fds().update(ch.main_fds())
        for exc in errors:
            if exc is not None:
                _explain_start_error(exc, method)

    @property
    def pids(self):
        return list(self._pids)

    def death_message(self, worker_id: int) -> str:
        proc = self.procs[worker_id]
        proc.join(timeout=2.0)
        code = proc.exitcode
        head = f"DataLoader worker {worker_id} (pid {self._pids[worker_id]}){rank_info()}"
        if code is None:
            return f"{head} exited unexpectedly"
        if proc.status_lost:
            return (f"{head} exited unexpectedly; how is unknown: it was reaped before "
                    f"this process could read its exit status (SIGCHLD is ignored, or an "
                    f"os.wait() elsewhere took it)")
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            hint = {
                "SIGKILL": " (killed by someone, or by the out-of-memory killer)",
                "SIGBUS": " (often: shared memory ran out)",
                "SIGSEGV": " (a crash in native code the dataset called)",
            }.get(name, "")
            return f"{head} was killed by signal {-code} ({name}){hint}"
        return f"{head} exited unexpectedly with exit code {code}"

    def stop_worker(self, worker_id: int):
        """Ask one worker to exit (its iterable replica is exhausted); its exit is
        then expected, not a failure."""
        if os.getpid() != self.owner_pid:
            return
        ch = self.channels[worker_id]
        ch.watch = False
        # no room (its ring still holds tasks it will answer as exhausted): it is
        # stopped with the others at the end instead
        if not ch.closed:
            ch.offer_task(TASK_SHUTDOWN, -1)

    def _tell_workers_to_stop(self) -> bool:
        """First step of every shutdown; False if it is not ours to do (done
        already, or in a forked child that holds a copy of this object)."""
        # A forked worker holds a copy of this object; if its garbage collector
        # ever reaches it, it must not stop its siblings.
        if self._closed or os.getpid() != self.owner_pid:
            return False
        self._closed = True
        for ch in self.channels:
            ch.watch = False
            if not ch.closed:
                # the tasks still queued are skipped (as torch's workers skip
                # theirs): a `break`, a framework's _shutdown_workers() or Ctrl-C
                # does not wait for batches nobody will take
                ch.stop()
                try:
                    ch.put_task(TASK_SHUTDOWN, -1)
                except Exception:
                    pass   # no room: the stop flag ends it all the same
        return True

    def shutdown(self, timeout: float = 5.0):
        """Stop the workers and wait for them (failure paths: Ctrl-C, a death). If
        that is interrupted (a second Ctrl-C), the reaper thread takes over: it
        escalates at once (a worker not yet told to stop gets SIGTERM), reaps the
        workers, releases the channels and counts the workers off."""
        if self._closed or os.getpid() != self.owner_pid:
            return
        try:
            self._tell_workers_to_stop()
            self._wait_for_workers(time.monotonic() + timeout)
        except BaseException:
            self._closed = True
            self._deadline = time.monotonic()
            self._escalated = 0
            reaper.retire(self)
            raise

    def _wait_for_workers(self, deadline: float):
        """The rest of shutdown(), once the workers were told: join them until
        `deadline`, then terminate (and kill) what still runs, and release."""
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        # those still busy: SIGTERM all, then SIGKILL whichever lives a second later
        busy = [proc for proc in self.procs if proc.is_alive()]
        for proc in busy:
            proc.terminate()
        give_up = time.monotonic() + 1.0
        for proc in busy:
            proc.join(max(0.0, give_up - time.monotonic()))
        for proc in busy:
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._release_channels()
        for proc in self.procs:
            try:
                proc.close()
            except Exception:
                pass
        live = _LIVE.get()
        with live.lock:
            live.pools.discard(self)
        self._uncount()

    def _uncount(self):
        _count_workers(self, 0)

    def abandon(self):
        """The reaper gave up on this pool (its step kept failing): release its
        channels, so that no fd number of theirs stays in main_fds() for a later
        worker to close (the number may be a dataset's file by then), and count
        its workers off, so that a pool past saving does not keep the main
        process's spin off for good. The workers are killed first (at most a
        second's wait), so that none can still make a named segment once the
        channels have removed theirs; multiprocessing's exit hook joins them."""
        try:
            try:
                for proc in self.procs:
                    if not proc.has_exited():
                        proc.signal_nowait(signal.SIGKILL)
                give_up = time.monotonic() + 1.0
                while (time.monotonic() < give_up
                       and not all(proc.has_exited() for proc in self.procs)):
                    time.sleep(0.01)
            finally:
                self._release_channels()
        finally:
            self._uncount()

    def _release_channels(self):
        """Close the main process's ends of the channels, once: an interrupted
        release is finished by the next call (closing a channel twice is
        harmless), and only a complete one counts."""
        if self._channels_released:
            return
        for ch in self.channels:
            main_fds().difference_update(ch.main_fds())
            ch.close()
        self._channels_released = True

    # -- deferred shutdown (reaper.py) ----------------------------------------------------
    def retire(self, timeout: float = 5.0):
        """Tell the workers to stop and return at once: the reaper thread waits for
        them, releases the channels (named segments are removed only once no
        worker can make one), reaps them, and terminates (then kills) one still
        running `timeout` seconds from now."""
        if self._closed or os.getpid() != self.owner_pid:
            return
        self._deadline = time.monotonic() + timeout
        self._escalated = 0
        try:
            self._tell_workers_to_stop()
        except BaseException:   # interrupted: escalate at once (the untold get SIGTERM)
            self._closed = True
            self._deadline = time.monotonic()
            raise
        finally:
            reaper.retire(self)

    def hurry(self, seconds: float):
        """Interpreter exit: no more than `seconds` before escalating."""
        self._deadline = min(self._deadline, time.monotonic() + seconds)

    def wait_fds(self):
        return [fd for fd in (p.exit_fd() for p in self.procs) if fd is not None]

    def step(self, now: float) -> bool:
        running = [p for p in self.procs if not p.has_exited()]
        if running and now >= self._deadline:
            # as shutdown(): SIGTERM first, SIGKILL a second later
            sig = signal.SIGTERM if self._escalated == 0 else signal.SIGKILL
            if self._escalated < 2 and now >= self._deadline + self._escalated:
                for p in running:
                    p.signal_nowait(sig)
                self._escalated += 1
        if running:
            return False
        self._release_channels()
        if not all(p.reap_and_close() for p in self.procs):
            return False   # a join elsewhere holds one: look again shortly
        live = _LIVE.get()
        with live.lock:
            live.pools.discard(self)
        self._uncount()
        return True


_exit_hook_pid = None


def _exit_hook_for_this_process():
    """Also run _shutdown_all from multiprocessing's exit function. A process that
    multiprocessing started (e.g. a ddp_spawn rank) runs that function directly
    when its target returns, before any atexit hook, and it joins every child
    Process it knows; our reaper thread may close one of them meanwhile ("process
    object is closed"). A finalizer with an exit priority runs before those joins.
    Registered per process: a forked child starts with the registry cleared."""
    global _exit_hook_pid
    if _exit_hook_pid != os.getpid():
        _exit_hook_pid = os.getpid()
        _mp_util.Finalize(None, _shutdown_all, exitpriority=100)


# At interpreter exit, before a worker is terminated. One whose epoch ended (a
# retired pool) keeps the 5 s it was given then, as torch's loop would have waited
# for it at the epoch's end: its exit may be flushing a dataset's files. One still
# serving a live iterator gets 2 s, shared by all such pools (torch's are
# terminated at once, by multiprocessing's exit handler).
_EXIT_GRACE_RETIRED_S = 5.0
_EXIT_GRACE_LIVE_S = 2.0


@atexit.register
def _shutdown_all():
    # Registered after multiprocessing's own atexit hook, so it runs before it:
    # our workers stop cleanly instead of being terminated with a warning.
    told = []
    try:
        live = _LIVE.get()
        with live.lock:
            pools = list(live.pools)
        for pool in pools:   # every pool's workers first, so that they stop side by side
            try:
                if pool._tell_workers_to_stop():
                    told.append(pool)
            except Exception:
                pass
        _wait_at_exit(told, _EXIT_GRACE_LIVE_S, _EXIT_GRACE_RETIRED_S)
    except KeyboardInterrupt:
        # Ctrl-C while exit waits for busy workers: the user wants out now. What
        # still runs is ended at once (SIGTERM, SIGKILL a second later, as when a
        # grace runs out), with Ctrl-C ignored for that second so that it is not
        # cut short too, and the exit stays quiet (the interrupted callback's
        # traceback is all Python would add: the process is exiting as asked).
        previous = _ignore_sigint()
        try:
            _wait_at_exit(told, 0.0, 0.0)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)


def _wait_at_exit(told, live_grace, retired_grace):
    """Wait for the workers of the pools told to stop at exit (then terminate
    them) within `live_grace` seconds, and for the retired pools' within
    `retired_grace` more (reaper.py)."""
    deadline = time.monotonic() + live_grace
    for pool in told:
        live = _LIVE.get()
        with live.lock:
            done = pool not in live.pools   # finished before a Ctrl-C
        if done:
            continue
        try:
            pool._wait_for_workers(deadline)
        except Exception:
            pass
    # pools retired earlier (epochs that ended): their workers were told to stop
    reaper.drain(retired_grace)


def _ignore_sigint():
    """Ignore SIGINT; the handler it had, or None where it cannot be changed (not
    the main thread)."""
    try:
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:
        return None
