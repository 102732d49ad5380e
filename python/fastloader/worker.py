"""The loop a worker process runs: attach to its channel, seed as torch seeds,
then fetch -> collate -> publish into the ring until told to stop."""
from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import traceback

import torch
from torch.utils.data import _DatasetKind
from torch.utils.data._utils import worker as _tw
from torch.utils.data._utils.worker import WorkerInfo

from . import _codec_hooks  # noqa: F401  (registers the codec hooks in this process)
from ._codec_hooks import failed_in_collate
from . import _core
from . import payload as _payload
from . import resume as _resume
from . import sigint
from .batch_fetch import with_batch_fetch
from .collate import worker_collate
from .protocol import (
    RES_BATCH, RES_BATCH_SNAP, RES_ERROR, RES_ITER_END, RES_RESUMED, TASK_CONTROL, TASK_PICKLE,
    TASK_RESUME, TASK_SHUTDOWN, Replay, Restore, decode_control,
)
from .seeding import seed_worker


_RANK_TEXT = ""   # set from the spec: " on rank R of W" in a distributed job


def _wrap_exception(worker_id: int, seq: int, index, context=None):
    # torch's ExceptionWrapper keeps the traceback text; we add the batch it was
    # building (and the rank), which torch does not say.
    from torch._utils import ExceptionWrapper

    detail = context or f"batch {seq}, index {_short(index)}"
    return ExceptionWrapper(where=f"in DataLoader worker process {worker_id}{_RANK_TEXT}"
                            f" ({detail})")


def _sendable_error(wrapper, exc):
    """A worker's error whose exception class cannot be pickled (one defined inside
    a function): the same traceback text, raised in the main process as a
    RuntimeError that names the class. (torch's worker cannot send it at all, and
    its main process waits for the batch for ever, or for `timeout`.)"""
    from torch._utils import ExceptionWrapper

    cls = wrapper.exc_type
    sendable = ExceptionWrapper.__new__(ExceptionWrapper)
    sendable.exc_type, sendable.exc_msg = RuntimeError, wrapper.exc_msg
    sendable.where = (f"{wrapper.where}, for a {cls.__module__}.{cls.__qualname__} that "
                      f"cannot be pickled ({type(exc).__name__}: {exc})")
    return sendable


def _no_fetcher(worker_id, seq, index):
    """A batch asked of a worker whose start failed (its worker_init_fn, or an
    IterableDataset's __iter__, raised: that error was the first batch's). torch's
    worker loop then fails each later batch with an UnboundLocalError (its fetcher
    was never bound); the same type here, saying why."""
    try:
        raise UnboundLocalError("this worker has no fetcher: its start failed (its "
                                "worker_init_fn or the dataset's __iter__ raised), and "
                                "that error was raised for an earlier batch")
    except UnboundLocalError:
        return _wrap_exception(worker_id, seq, index)


def _print_unsent(error) -> None:
    """The dataset's error (an ExceptionWrapper) could not be sent: to stderr, so
    that it is not lost."""
    try:
        print(f"fastloader: this error could not be sent to the main process:\n"
              f"{getattr(error, 'exc_msg', error)}", file=sys.stderr, flush=True)
    except Exception:   # stderr a file under the same file-size limit
        pass


def _short(index) -> str:
    try:
        text = repr(index)
    except Exception as exc:   # the error being reported is not this one
        text = f"<a {type(index).__name__} whose repr() raised {type(exc).__name__}>"
    return text if len(text) <= 120 else text[:117] + "..."


def _unencodable(worker_id, seq, index, data, exc):
    """A batch that neither the codec nor pickle can carry: say which object."""
    culprit = _find_unpicklable(data)
    what = f"{type(culprit).__module__}.{type(culprit).__qualname__}" if culprit is not None \
        else type(data).__qualname__
    err = TypeError(f"fastloader: cannot send the batch for index {_short(index)} from "
                    f"worker {worker_id} to the main process: an object of type {what} "
                    f"cannot be pickled ({type(exc).__name__}: {exc})")
    try:
        raise err from exc
    except TypeError:
        return _wrap_exception(worker_id, seq, index)


def _find_unpicklable(obj, depth=0):
    if depth > 50:
        return None
    children = ()
    if isinstance(obj, dict):
        children = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = obj
    for c in children:
        found = _find_unpicklable(c, depth + 1)
        if found is not None:
            return found
    if isinstance(obj, (dict, list, tuple)):
        return None
    try:
        pickle.dumps(obj)
    except Exception:
        return obj
    return None


def _seed_datapipe(dataset, shared_seed):
    """An IterDataPipe shuffles with one seed shared by all workers (torch)."""
    from torch.utils.data import IterDataPipe

    if not isinstance(dataset, IterDataPipe) or shared_seed is None:
        return dataset
    from torch.utils.data.graph_settings import apply_random_seed

    rng = torch.Generator()
    rng.manual_seed(shared_seed)
    return apply_random_seed(dataset, rng)


def close_inherited_fds(inherited, keep):
    """Under fork a worker inherits the main process's ends of every live channel
    and its siblings' (the pool lists them in `inherited` as (fd, st_dev, st_ino));
    close them so that fd counts stay constant. A number is closed only where it
    still names what the pool listed: had the main process closed it before the
    fork (the reaper thread releasing a retired pool, another thread shutting a
    loader down), the number may belong to this worker's own pipe by now, the
    only fds the pool makes between listing and forking. (Every eventfd shares
    one inode, as does every pidfd: a number reused by another of the same kind
    would still be closed.)"""
    for fd, dev, ino in inherited:
        if fd < 0 or fd in keep:
            continue
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (dev, ino):
                os.close(fd)
        except OSError:
            pass


def worker_main(spec, handle, fds, inherited_fds=()):
    """Entry point of a worker process (the multiprocessing target)."""
    # A forked worker inherits the main process's heap, garbage included: its
    # collector must neither run finalizers of the parent's objects (e.g. another
    # loader's iterator stopping workers that are not its own) nor walk, and so
    # dirty, every inherited page. Freezing moves them out of its sight.
    gc.freeze()
    # Ctrl-C goes to the whole process group; the main process handles it and
    # shuts us down, so a worker must not print a KeyboardInterrupt traceback.
    sigint.leave_ctrl_c_to_the_main_process()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked for start-up
    ctl_fd, efd_main, efd_worker, sock = (f.detach() if hasattr(f, "detach") else f
                                          for f in fds)
    if spec.payload is not None:   # the heavy part, pickled once for all workers
        fd, size = spec.payload
        spec.dataset, spec.collate_fn, spec.worker_init_fn = _payload.load(fd.detach(), size)
    close_inherited_fds(inherited_fds, {ctl_fd, efd_main, efd_worker, sock})
    chan = _core.WorkerChannel(handle, ctl_fd, efd_main, efd_worker, sock, spec.nslots)
    current = _Current()
    try:
        _serve(spec, chan, current)
    except SystemExit:
        raise   # an exit code: the main process reports it once it took our results
    except BaseException as exc:
        # Leaving the loop by an exception: what we published stays (the channel
        # keeps it for the main process), and this error follows it, so the main
        # process delivers every earlier batch and then raises it.
        current.report(chan, spec.worker_id, exc)
        raise
    finally:
        sigint.ignore_while_exiting()
        chan.cleanup()


class _Current:
    """The fetch task being served, whose result is not published yet."""

    seq = None
    index = None

    def report(self, chan, worker_id, exc):
        if self.seq is None:
            return   # between tasks: the main process reports our exit instead
        try:
            chan.publish(RES_ERROR, self.seq, _exit_error(worker_id, self.seq, self.index,
                                                          exc))
        except BaseException:
            pass   # the exit code still tells the main process


def _exit_error(worker_id, seq, index, exc):
    """The error for a worker leaving its loop by `exc`. An Exception is re-raised
    in the main process as itself. Anything else (a KeyboardInterrupt or
    GeneratorExit raised by the dataset; Ctrl-C raises nothing here, see
    sigint.leave_ctrl_c_to_the_main_process, so it is never the user's) kills torch's worker, and torch's main process raises
    RuntimeError ("exited unexpectedly"): raising `exc` itself in the main process
    would look like Ctrl-C there, so it is a WorkerError (a RuntimeError) that
    names it, with its traceback."""
    if isinstance(exc, Exception):
        return _wrap_exception(worker_id, seq, index)
    try:
        raise _core.WorkerError(
            f"DataLoader worker {worker_id} (pid {os.getpid()}) exited unexpectedly: "
            f"{type(exc).__name__} raised while building batch {seq}") from exc
    except _core.WorkerError:
        return _wrap_exception(worker_id, seq, index)


class _Loop:
    """One worker's loop: dispatch on each task's kind to the handler of that kind.
    Holds what persists between tasks: the dataset (re-seeded per epoch for an
    IterDataPipe), its fetcher, whether the replica is exhausted, and the count of
    tasks taken this epoch (snapshots fall on the same tasks when resumed)."""

    def __init__(self, spec, chan, current):
        self.spec, self.chan, self.current = spec, chan, current
        self.wid = spec.worker_id
        self.dataset = _seed_datapipe(spec.dataset, spec.shared_seed)
        self.collate_fn = worker_collate(spec.collate_fn)
        self.init_error = None
        self.end_after_error = False   # a failed resume ends an iterable's replica
        self.fetcher = None
        self.iteration_end = False
        self.done = 0
        # the snapshot of this very point, when one was taken or restored since the
        # last task (a persistent epoch's start, a Restore): a snapshot falling due
        # now is that one. Asking the dataset again would be wrong for one that
        # resets its position only once its __iter__'s body runs (see
        # resume.with_state_after_first_task), and would ask it twice.
        self.ready_snapshot = None
        # The RNGs are exactly as seed_worker() left them: from a start with no
        # worker_init_fn and a map-style dataset (no user code ran since the
        # seeding) until the first task is taken. A snapshot due then is the
        # seeds, not the states (resume.seeded_snapshot).
        self.as_seeded = False

    def start(self, seed):
        spec = self.spec
        _tw._worker_info = WorkerInfo(id=self.wid, num_workers=spec.num_workers, seed=seed,
                                      dataset=self.dataset)
        try:
            if spec.worker_init_fn is not None:
                spec.worker_init_fn(self.wid)
        except Exception:
            self.init_error = _wrap_exception(self.wid, -1, None, context="in worker_init_fn")
            return
        try:
            self._new_fetcher()   # an IterableDataset's __iter__ runs here
        except Exception:
            self.init_error = _wrap_exception(self.wid, -1, None,
                                              context="in the dataset's __iter__")
            return
        self.as_seeded = (spec.worker_init_fn is None
                          and spec.dataset_kind == _DatasetKind.Map)

    def _new_fetcher(self):
        spec = self.spec
        fetcher = _DatasetKind.create_fetcher(spec.dataset_kind, self.dataset,
                                              spec.auto_collation, self.collate_fn,
                                              spec.drop_last)
        if spec.dataset_kind == _DatasetKind.Map:
            fetcher = with_batch_fetch(fetcher, self.dataset, spec.auto_collation,
                                       self.collate_fn)
        self.fetcher = fetcher

    # -- dispatch ------------------------------------------------------------------
    def run(self):
        chan, current = self.chan, self.current
        while True:
            current.seq = None
            task = chan.get_task()
            if task is None:          # the main process is gone
                return
            kind, seq, payload = task
            if kind == TASK_SHUTDOWN:
                return
            if kind == TASK_RESUME:
                self.on_resume(seq, payload)
            elif kind == TASK_CONTROL:
                self.on_control(decode_control(payload))
            else:
                self.on_fetch(kind, seq, payload)

    # -- handlers ------------------------------------------------------------------
    def on_resume(self, seq, payload):
        """Persistent workers: a new epoch restarts the replica as torch does. An
        error in an IterableDataset's __iter__ is the epoch's first batch's, as in
        the first epoch (torch's worker exits on it instead, "exited unexpectedly")."""
        self.iteration_end, self.done, self.as_seeded = False, 0, False
        if payload:
            self.dataset = _seed_datapipe(self.dataset, pickle.loads(payload))
        try:
            self._new_fetcher()
        except Exception:
            self.fetcher = None   # as after a failed start: later batches fail too
            self.init_error = _wrap_exception(self.wid, -1, None,
                                              context="in the dataset's __iter__")
        # the RNGs carry on from the last epoch: the main process keeps this, for a
        # state_dict() taken before this worker's first batch of the epoch arrives;
        # the first task's snapshot is the same one (the dataset is asked once)
        self.ready_snapshot = _resume.take_snapshot(self.dataset, 0)
        try:
            self.chan.publish(RES_RESUMED, seq, self.ready_snapshot)
        except MemoryError:
            # no shared memory for the snapshot (/dev/shm full: the slots' pages
            # were given back between epochs, csrc/channel_worker.c): a bare
            # acknowledgement, which makes iter() raise the MemoryError in the main
            # process (iterator._reset); this worker lives on for the next iter()
            self.chan.publish(RES_RESUMED, seq)

    def on_control(self, message):
        """Resume messages from the main process (resume.py)."""
        self.as_seeded = False
        if isinstance(message, Restore):
            self.iteration_end = False
            self.ready_snapshot = None
            try:
                self.done = _resume.restore_snapshot(self.dataset, message.snapshot,
                                                     self._new_fetcher)
                self.ready_snapshot = message.snapshot
            except Exception:
                # as a failing __iter__ at an epoch's start: the worker lives on,
                # and its first batch of the resumed epoch raises this, traceback
                # and all (it used to die: "exited unexpectedly")
                self.fetcher = None
                self.init_error = _wrap_exception(
                    self.wid, -1, None,
                    context="resuming: in the dataset's load_state_dict or __iter__")
                # an iterable replica that could not be put back has nothing more to
                # give: after its error it ends (else a loop that catches errors
                # would get one per task for ever)
                self.end_after_error = self.spec.dataset_kind == _DatasetKind.Iterable
        elif isinstance(message, Replay):
            # re-run a task the interrupted run delivered, for its side effects on
            # RNGs and iterator position; the batch is dropped
            self.done += 1
            self.ready_snapshot = None
            try:
                self.fetcher.fetch(message.index)
            except Exception:
                pass

    def on_fetch(self, kind, seq, index):
        """A batch task: fetch, collate, publish (or publish the error)."""
        spec, chan, current, wid = self.spec, self.chan, self.current, self.wid
        current.seq, current.index = seq, index
        if kind == TASK_PICKLE:
            index = pickle.loads(index)
            current.index = index
        if self.iteration_end:
            chan.publish(RES_ITER_END, seq)
            return
        every = spec.snapshot_every
        snapshot = None
        ready, self.ready_snapshot = self.ready_snapshot, None
        # (an index that came pickled ran its unpickling, which may draw, above)
        as_seeded, self.as_seeded = self.as_seeded and kind != TASK_PICKLE, False
        if self.done == 0 or (every > 0 and self.done % every == 0):
            if ready is not None:
                snapshot = ready
            elif as_seeded:
                snapshot = _resume.seeded_snapshot(spec.base_seed, wid)
            else:
                snapshot = _resume.take_snapshot(self.dataset, self.done)
        self.done += 1
        if self.init_error is not None:
            data, rkind, self.init_error = self.init_error, RES_ERROR, None
            self.iteration_end, self.end_after_error = self.end_after_error, False
        elif self.fetcher is None:
            data, rkind = _no_fetcher(wid, seq, index), RES_ERROR
        else:
            try:
                data, rkind = self.fetcher.fetch(index), RES_BATCH
            except StopIteration:
                if spec.dataset_kind != _DatasetKind.Iterable:
                    data, rkind = _wrap_exception(wid, seq, index), RES_ERROR
                else:
                    self.iteration_end = True
                    chan.publish(RES_ITER_END, seq)
                    return
            except Exception:
                data, rkind = _wrap_exception(wid, seq, index), RES_ERROR
        if snapshot is not None and rkind == RES_BATCH:
            if self.done == 1:
                snapshot = _resume.with_state_after_first_task(self.dataset, snapshot, 1)
            data, rkind = (data, snapshot), RES_BATCH_SNAP
        try:
            chan.publish(rkind, seq, data)
        except Exception as exc:
            unpicklable = isinstance(exc, (pickle.PicklingError, TypeError, AttributeError))
            try:
                if unpicklable and rkind == RES_ERROR:
                    chan.publish(RES_ERROR, seq, _sendable_error(data, exc))
                elif unpicklable and not failed_in_collate(exc):
                    chan.publish(RES_ERROR, seq, _unencodable(wid, seq, index, data, exc))
                else:
                    # e.g. stacking into the slot failed (torch's collate error), or
                    # no memory for a segment: the main process re-raises it with
                    # this worker's traceback
                    if rkind == RES_ERROR:   # what is sent in its place
                        _print_unsent(data)
                    chan.publish(RES_ERROR, seq, _wrap_exception(wid, seq, index))
            except Exception:
                # The error needs shared memory too, and none could be made (the
                # first batch, before any ring arena: /dev/shm full, a memory or
                # file-size limit, no fd left). The errors go to stderr (the
                # dataset's own, if it raised, first), and a bare error notice (no
                # payload) makes the batch raise in its turn (iterator._accept); the
                # worker lives on for the next task.
                if rkind == RES_ERROR and unpicklable:   # (else printed above)
                    _print_unsent(data)
                try:
                    traceback.print_exc()
                except Exception:   # stderr a file under the same file-size limit
                    pass
                chan.publish(RES_ERROR, seq)
        del data


def _serve(spec, chan, current):
    global _RANK_TEXT
    _RANK_TEXT = spec.rank_text
    name_thread = getattr(torch.multiprocessing, "_set_thread_name", None)
    if name_thread is not None:
        name_thread("pt_data_worker")   # what top/ps/py-spy show for torch's workers
    torch.set_num_threads(1)
    seed = seed_worker(spec.base_seed, spec.worker_id)
    loop = _Loop(spec, chan, current)
    loop.start(seed)
    loop.run()
