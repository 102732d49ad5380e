"""The multi-worker iterator: sampler -> tasks -> workers -> ring -> batches.

It follows torch's _MultiProcessingDataLoaderIter task for task (round-robin
dispatch, prefetch_factor tasks per worker, in-order delivery with a reorder
buffer, IterableDataset exhaustion per worker, persistent workers, timeout), so
batches come out identical; only the transport differs. What it remembers for
`DataLoader.state_dict()` lives in resume.EpochTracker, its counters in
stats.EpochCounters, and what outlives it in the loader's session.LoaderSession."""
from __future__ import annotations

import collections
import copy
import functools
import heapq
import operator
import pickle
import time

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import IterDataPipe, MapDataPipe, _DatasetKind
from torch.utils.data.dataloader import (_BaseDataLoaderIter, _MultiProcessingDataLoaderIter,
                                         _sharding_worker_init_fn)

from . import _core
from . import resume as _resume
from . import sampler_generators
from . import stats as _stats
from . import torch_sites
from .distributed import rank_info
from .index_batches import as_list, sequential_batches
from .index_pickle import dumps_indices
from .main_spin import MainSpin
from .metadata_warning import warn_if_heavy_metadata
from .pin_ahead import PinAhead, ask_device_before_accelerator
from .pool import WorkerPool, WorkerSpec, live_workers
from .protocol import (
    RES_BATCH, RES_BATCH_SNAP, RES_DEAD, RES_ERROR, RES_ITER_END, RES_RESUMED, TASK_CONTROL,
    TASK_PICKLE, TASK_RESUME, WHERE_NONE, encode_control,
)
from .session import LoaderSession
from .sharing import DEFAULT_STRATEGY

# Slots per worker beyond its prefetched batches: the one the consumer holds, the
# one it is about to drop, and one of slack for a pin-memory or prefetch stage.
_EXTRA_SLOTS = 3

# On Ctrl-C or a worker's death, how long busy siblings may take to stop by
# themselves before they are terminated (idle ones stop at once).
_FAILURE_GRACE_S = 0.2

# Each worker's task ring: its records wrap within a window sized from the batch
# size, and the rest is address space that a bigger task (a batch sampler of
# unknown or varying size) widens the window into; a task may be half of it.
_TASK_RING_BYTES = 64 << 20

# The `snap` of a batch whose task never reached its worker (see _try_put_index):
# no worker ran it, so it is not one to replay on resume.
_NOT_SENT = object()


_REBUILD_NOTE = "fastloader: raised in the main process while rebuilding "


class _Unrebuilt:
    """A batch the main process could not rebuild: what it raised, kept for the
    batch's turn (a batch may itself be an exception object), and whose it was."""

    __slots__ = ("error", "whose")

    def __init__(self, error, whose=""):
        self.error, self.whose = error, whose

    def noted(self):
        """The error, unchanged in type and text, with a note saying whose batch
        it is (Python 3.11+): one such note at a time, as the same object may be
        raised for several batches; none where notes cannot be added (an
        exception class of the user's whose __notes__ is no list)."""
        error = self.error
        if not self.whose:
            return error
        try:
            notes = getattr(error, "__notes__", None)
            if isinstance(notes, list):
                notes[:] = [n for n in notes
                            if not (isinstance(n, str) and n.startswith(_REBUILD_NOTE))]
            error.add_note(f"{_REBUILD_NOTE}{self.whose}")
        except Exception:
            pass
        return error


def _check_positive(value, args):
    """As the installed torch checks: `if value <= 0: raise AssertionError(text)`
    (2.13), or `assert value > 0` (no args; 2.5 and older), which `python -O` drops.
    The comparison is torch's too, so that a None (prefetch_factor left None,
    num_workers set after construction) raises the TypeError torch's raises, naming
    the same operator."""
    if args:
        if value <= 0:
            raise AssertionError(*args)
    elif __debug__ and not value > 0:
        raise AssertionError


def _task_bytes_estimate(loader) -> int:
    """About how many bytes one task (a batch of indices) takes in the task ring.
    A guess only: a custom batch_sampler's `batch_size` may be anything (sizes per
    bucket, "dynamic") or raise, and torch never reads it, so neither may that
    stop a loader here."""
    try:
        size = operator.index(getattr(loader.batch_sampler, "batch_size", None)
                              or loader.batch_size or 1)
    except Exception:
        size = 1
    return 64 + 8 * max(size, 1)


class FastMultiProcessingIter(_BaseDataLoaderIter):
    _epoch = 0   # set from the loader's session when an epoch starts (_reset)
    # the global RNG where the epoch's sampler started, if it draws from it while
    # the loader has a generator (sampler_generators.py)
    _global_sampler_rng = None

    def __init__(self, loader, session=None, strategy=DEFAULT_STRATEGY):
        # the loader's state across epochs (session.py)
        session = session if session is not None else LoaderSession()
        resume_state = session.take_resume()
        # put in place once the resumed epoch's first indices are drawn (_reset)
        self._global_rng_kept = _resume.GlobalRngAfterResume(loader.generator, resume_state)
        before_base_seed = _resume.rng_before_base_seed(loader.generator, resume_state,
                                                        loader.persistent_workers)
        # from torch's line, so that its pin_memory warnings point where torch's do
        torch_sites.base_iter_init(super().__init__, loader)
        # torch names the profiler event after its iterator's class: the name a
        # trace, or a filter on it, expects (not this class's name)
        self._profile_name = (f"enumerate(DataLoader)#"
                              f"{_MultiProcessingDataLoaderIter.__name__}.__next__")
        self._session = session
        self._loader_generator = loader.generator
        self._prefetch_factor = loader.prefetch_factor
        # the same checks, in the same order, with the same errors as the installed
        # torch's multi-process iterator
        _check_positive(self._num_workers, torch_sites.num_workers_check)
        _check_positive(self._prefetch_factor, torch_sites.prefetch_factor_check)
        if self._pin_memory and torch_sites.asks_pin_device_in_main:
            # before any worker starts: torch's error, from iter(), and nothing to stop
            ask_device_before_accelerator(self._pin_memory_device)
        self._in_order = getattr(loader, "in_order", True)
        self._recv_timeout = self._timeout if self._timeout > 0 else None
        # In order, only the due batch's worker can let the main process go on:
        # the others need not wake it (a wake-up costs more CPU than a batch's
        # bookkeeping, and a worker that runs ahead would wake it for each result).
        # With a timeout, any result restarts the clock, as in torch: all wake it.
        self._wake_on_due_only = self._in_order and self._recv_timeout is None
        self._pin_timed = self._pin_memory and self._recv_timeout is not None
        # with a CPU to spare, spin for a batch rather than make its worker wake us
        self._main_spin = MainSpin(self._pin_memory)
        # a torch DataLoader given fastloader's transport by install() has none
        self.sharing_strategy = getattr(loader, "sharing_strategy", strategy)
        self._shutdown = False
        self._stopped_by = None   # why the workers were stopped mid-epoch, if they were
        self._stop_reported = False
        self._pool = None
        self._resume_state = resume_state
        if resume_state is not None and resume_state.get("epoch_done"):
            session.epoch = resume_state["epoch"]   # the next one starts afresh
            if before_base_seed is not None:
                # The saving run's persistent workers drew no seed for this epoch:
                # undo this new iterator's draw (only it: a draw the job made since
                # the state was loaded stays), so its sampler draws that run's
                # order (its workers start freshly seeded)
                _resume.restore_rng(self._loader_generator, before_base_seed)
                self._base_seed = resume_state["base_seed"]
        elif resume_state is not None:
            # the workers must be seeded as in the interrupted run
            self._base_seed = resume_state["base_seed"]
            session.epoch = resume_state["epoch"] - 1
        context = loader.multiprocessing_context
        if context is None:
            # the default context itself, as torch's iterator uses: its workers are
            # multiprocessing.Process ("Process-N"), not the start method's class
            context = torch.multiprocessing
        # a big Python list/dict in the dataset costs every worker a copy
        warn_if_heavy_metadata(self._dataset, self._num_workers, context)
        max_tasks = self._prefetch_factor * self._num_workers
        worker_init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):
            # DataPipes shard across workers and ranks in the worker, as in torch
            worker_init_fn = functools.partial(_sharding_worker_init_fn, worker_init_fn,
                                               self._world_size, self._rank)
        specs = [
            WorkerSpec(self._dataset_kind, self._dataset, self._auto_collation,
                       self._collate_fn, self._drop_last, self._base_seed,
                       worker_init_fn, wid, self._num_workers,
                       self._prefetch_factor + _EXTRA_SLOTS,
                       getattr(loader, "snapshot_every_n_steps", 0), rank_info(),
                       self._shared_seed)
            for wid in range(self._num_workers)
        ]
        window = max(1 << 20, 4 * max_tasks * _task_bytes_estimate(loader))
        self._pool = WorkerPool(
            context, specs, self.sharing_strategy,
            task_capacity=max(window, _TASK_RING_BYTES), result_capacity=max_tasks + 2,
            task_window=window)
        self._channels = self._pool.channel_tuple
        try:
            self._reset(loader, first_iter=True)
        except BaseException as exc:
            # the first tasks failed (a sampler that raised, Ctrl-C): the workers
            # stop now, not whenever the traceback holding this iterator goes;
            # off the caller's path, unless it is Ctrl-C
            if isinstance(exc, Exception):
                self._shutdown_workers(deferred=True)
            else:
                self._shutdown_workers(grace=_FAILURE_GRACE_S)
            raise

    def __next__(self):
        # torch's __next__ opens a profiler range per batch (a few microseconds,
        # a large share of our per-batch cost). Take that path whenever the
        # profiler runs; otherwise do the same bookkeeping without the range. (An
        # IterableDataset whose len() was asked gets torch's __next__ itself:
        # _LengthCheckedIter.)
        if torch.autograd._profiler_enabled():
            return super().__next__()
        if self._sampler_iter is None:
            self._reset()
        data = self._next_data()
        self._num_yielded += 1
        return data

    # -- introspection -----------------------------------------------------------
    @property
    def worker_pids(self):
        return self._pool.pids

    # torch's multi-process iterator keeps its worker processes in `_workers` and
    # says with `_worker_pids_set` whether they are running; code written for torch
    # reads both (w.pid, w.is_alive(), w.exitcode, w.join()): see worker_process.py.
    @property
    def _workers(self):
        return self._pool.procs if self._pool is not None else []

    @property
    def _worker_pids_set(self):
        return self._pool is not None and not self._shutdown

    def segments(self):
        """(address, nbytes) of the ring arenas mapped in this process."""
        return [a for a in (ch.arena() for ch in self._channels) if a is not None]

    def stats(self, memory=True):
        """This epoch so far: batches delivered (by transport), time waited for
        data, and per worker: batches, busy/idle time, ring occupancy, USS/PSS."""
        return _stats.collect(self._counters, self._channels, self.worker_pids, memory=memory)

    # -- epoch control -------------------------------------------------------------
    def _reset(self, loader, first_iter=False):
        if not first_iter and self._shutdown:
            # torch's own __iter__ (a torch DataLoader given this transport by
            # install()) resets a persistent iterator whose workers were stopped
            # (a worker's death, Ctrl-C, a framework's _shutdown_workers()): the
            # next epoch starts new workers, as fastloader.DataLoader.__iter__
            # does by dropping it (torch's iterator would fail on its dead ones,
            # and this one's closed channels raised ValueError)
            epoch = self._session.epoch
            try:
                self.__init__(loader, self._session, self.sharing_strategy)
            except BaseException:
                # no workers (fds, processes or memory ran out), or they started and
                # the first tasks failed (a sampler that raised): none left running,
                # and still stopped, so that the next epoch tries again (with the
                # number this one would have had)
                self._session.epoch = epoch
                if self.__dict__.get("_pool") is not None:
                    self._shutdown_workers(grace=_FAILURE_GRACE_S)
                self._shutdown = True
                raise
            return
        super()._reset(loader, first_iter)
        if type(self) in (FastMultiProcessingIter, _LengthCheckedIter):   # not a user's subclass
            checks_length = (self._dataset_kind == _DatasetKind.Iterable
                             and self._IterableDataset_len_called is not None)
            self.__class__ = _LengthCheckedIter if checks_length else FastMultiProcessingIter
        # torch's default unshuffled sampler: the same batches as ranges (no int
        # object per index in the main process; see index_batches.py)
        ranges = sequential_batches(self._index_sampler)
        self._sends_ranges = ranges is not None
        self._sampler_iter = ranges or self._sampler_iter
        self._epoch = self._session.begin_epoch()
        self._counters = _stats.EpochCounters(self._epoch, self._num_workers, self._channels)
        self._stats_printed = False
        self._epoch_done = False
        self._send_idx = 0
        self._rcvd_idx = 0
        self._task_info = {}
        self._tasks_outstanding = 0
        self._workers_status = [True] * self._num_workers
        # per worker, the batch number its end of stream (IterableDataset) came with
        self._ended_at = [None] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        # per worker, in order, the tasks its ring had no room for yet (_offer keeps
        # them, _send_unsent sends them before the next wait)
        self._unsent = [collections.deque() for _ in range(self._num_workers)]
        self._unsent_count = 0
        # torch cycles with itertools.cycle; an explicit position can be saved
        self._cycle_order = list(range(self._num_workers))
        self._cycle_pos = 0
        self._ahead_to_skip = set()
        self._tracker = _resume.EpochTracker(self._num_workers)   # for state_dict()
        # a new epoch's batch numbers start again at 0: none of the last epoch's
        # pinned batches may answer them
        if getattr(self, "_pin_ahead", None) is not None:
            self._pin_ahead.close()
        self._pin_ahead = (PinAhead(self._pin_memory_device, self._counters.pinned_wait)
                           if self._pin_memory else None)
        # in_order=False with pin_memory: the numbers of the batches taken ahead
        # (kept in _task_info, given to the pin thread), a heap: the lowest is
        # handed out first, as the pin thread pins the lowest first
        self._ready = []
        if not first_iter:
            # an IterDataPipe gets the epoch's new shared seed with the resume
            seed = pickle.dumps(self._shared_seed)
            for ch in self._channels:
                ch.between_epochs(False)
            unsent = list(self._channels)
            waiting, unsent_state = self._num_workers, []
            while waiting > 0:
                # a ring still full of an abandoned epoch's tasks takes the resume
                # once its worker has read on
                unsent = [ch for ch in unsent if not ch.offer_task(TASK_RESUME, -1, seed)]
                wid, seq, kind, data, _where = self._get_data()
                if kind == RES_RESUMED:
                    waiting -= 1
                    if data is None:
                        unsent_state.append(wid)
                    else:   # a copy: it must not pin a ring slot
                        self._tracker.epoch_started(wid, copy.deepcopy(data))
                # anything else is left over from an abandoned epoch: dropped
            if unsent_state:
                # The worker had no shared memory to send its RNGs' state with (its
                # slots' pages were given back between epochs, and /dev/shm or the
                # memory limit is full: worker.py on_resume). Without it a
                # state_dict() of this epoch would resume other random numbers:
                # the epoch does not start; the workers live on, and the next
                # iter() asks them again.
                raise MemoryError(
                    f"fastloader: DataLoader worker(s) {unsent_state} found no shared "
                    "memory to start the epoch with (to send their random state, "
                    "which state_dict() needs); shared memory (/dev/shm, or the "
                    "memory limit for memfd) is full: free some and call iter() again")
        state, self._resume_state = self._resume_state, None
        if state is not None and not state.get("epoch_done"):
            # the epoch's starting RNG, for a later state_dict(): the fast-forward
            # draws from the generator (a resumed resume shuffled otherwise)
            self._sampler_rng = state["sampler_rng"].clone()
            self._sampler_gens = [s.clone() for s in state.get("sampler_generators", ())]
            self._global_sampler_rng = state.get("global_rng")
            global_start = self._fast_forward(state)
        else:
            self._sampler_rng = _resume.capture_rng(self._loader_generator)
            self._sampler_gens = sampler_generators.capture(self._index_sampler,
                                                            self._loader_generator)
            global_start = sampler_generators.global_rng_start(self._loader_generator)
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()
        if global_start is not None:   # the sampler has drawn its first batches
            self._global_sampler_rng = sampler_generators.global_rng_drawn(
                global_start, self._index_sampler, drawn=self._send_idx > 0)
        self._global_rng_kept.apply()   # the sampler has drawn its seed by now

    def _fast_forward(self, state):
        """Skip the batches the interrupted run already yielded, and bring every
        worker's RNG (and iterable position) to where it was. Returns where the
        global RNG stands as this epoch's sampler starts, to be told whether it
        draws from it (sampler_generators.global_rng_drawn), where the state could
        not tell; else None."""
        _resume.restore_rng(self._loader_generator, state["sampler_rng"])
        sampler_generators.restore_global(self._loader_generator, state)
        sampler_generators.restore(self._index_sampler, self._loader_generator,
                                   state.get("sampler_generators"))
        global_start = None
        if not _resume.sampler_had_drawn(state):
            # saved without workers before its first batch: that run's sampler would
            # draw from the RNGs as they were when saved (and leave them moved on),
            # so this epoch's sampler starts there, as a fresh epoch's would
            self._global_rng_kept.apply()
            self._sampler_rng = _resume.capture_rng(self._loader_generator)
            global_start = sampler_generators.global_rng_start(self._loader_generator)
        target = _resume.next_seq(state)
        draw = (lambda: as_list(self._next_index())) if self._sends_ranges else self._next_index
        index_of = _resume.indices_to_replay(state, draw,
                                             self._dataset_kind == _DatasetKind.Iterable)
        # tasks the interrupted run had handed out past `target` are sent anew,
        # except those it delivered already (in_order=False)
        self._ahead_to_skip = set(state.get("delivered_ahead", ()))
        for wid, w in enumerate(state["workers"]):
            self._workers_status[wid] = w["active"]
            for message in _resume.control_messages(w, index_of):
                self._channels[wid].put_task(TASK_CONTROL, -1, encode_control(message))
        self._tracker.restore(state)
        self._send_idx = self._rcvd_idx = target
        start = state["next_worker"]
        self._cycle_order = [(start + i) % self._num_workers for i in range(self._num_workers)]
        self._cycle_pos = 0
        self._num_yielded = state["yielded"]
        return global_start

    def state_dict(self):
        """Where this epoch stands; see DataLoader.state_dict()."""
        nxt = self._task_info.get(self._rcvd_idx, (None,))[0]
        if nxt is None:   # nothing outstanding: the cycle's next pick
            nxt = self._cycle_order[self._cycle_pos % self._num_workers]
        return {
            "version": _resume.VERSION,
            "epoch": self._epoch,
            # every batch yielded: each batch taken asked the sampler for another,
            # so it has ended, and the generator is where the epoch leaves it: this
            # is the epoch's end (see resume.as_epoch_end)
            "epoch_done": self._epoch_done or _resume.yielded_every_batch(
                self._dataset_kind, self._index_sampler, self._rcvd_idx,
                self._tracker.ahead_of(self._rcvd_idx), sent=self._send_idx),
            "base_seed": self._base_seed,
            "sampler_rng": self._sampler_rng,
            "sampler_generators": self._sampler_gens,
            "global_rng": self._global_sampler_rng,
            "sampler_drawn": True,   # iter() drew the first tasks' batches
            "next_seq": self._rcvd_idx,
            "next_worker": nxt,
            "yielded": self._num_yielded,
            "delivered_ahead": self._tracker.ahead_of(self._rcvd_idx),
            "workers": self._tracker.worker_states(self._active_at_next_seq(), self._dataset),
        }

    def _active_at_next_seq(self):
        """Which workers a resume gives tasks to. A worker whose end of stream
        arrived with a batch number not yet reached may still have a batch before
        it waiting to be yielded (its end came while another worker's batch was
        awaited): at the point saved, it had not ended, and the resumed run must
        fetch that batch from it again (it ends again after it)."""
        return [active or (end is not None and end >= self._rcvd_idx)
                for active, end in zip(self._workers_status, self._ended_at)]

    # -- receiving -------------------------------------------------------------------
    def _timed_out(self):
        """The error of a wait past `timeout` (torch's text), whether for a worker's
        result or for the pin thread."""
        return RuntimeError(f"DataLoader timed out after {self._timeout} seconds")

    def _get_data(self, prefer=0, only_prefer=False):
        """The next result of any worker, starting with worker `prefer` (the one
        whose batch is due; with `only_prefer`, only its result ends a sleep, see
        _core.recv); recv() times any wait for the epoch's stats."""
        try:
            got = _core.recv(self._channels, prefer, self._recv_timeout, only_prefer,
                             self._main_spin.ns(live_workers()))
        except KeyboardInterrupt:
            self._interrupted()
            raise
        if got is None:
            raise self._timed_out()
        wid, seq, kind, data, where = got
        if kind == RES_DEAD:
            message = self._pool.death_message(wid)
            # The epoch is lost: as for Ctrl-C, do not let a sibling busy in a long
            # sample hold the error back for the full grace (contract: within 2 s).
            self._shutdown_workers(grace=_FAILURE_GRACE_S)
            self._stopped_by = message
            raise _core.WorkerError(message)
        return got

    def _interrupted(self):
        """Ctrl-C in a wait: stop the workers now (briefly let idle ones exit by
        themselves, terminate busy ones) so the program can exit at once."""
        self._shutdown_workers(grace=_FAILURE_GRACE_S)
        self._stopped_by = "KeyboardInterrupt"

    def _next_data(self):
        if self._shutdown:
            if self._epoch_done or self._stop_reported:
                raise StopIteration
            # torch's iterator goes on with the workers left, then ends; ours
            # stopped them all (the failure contract: fail fast, leave nothing
            # running): it says so once, then ends, so that a loop that skips
            # failed batches ends too (the epoch is not done: state_dict() says so)
            self._stop_reported = True
            why = f" after {self._stopped_by}" if self._stopped_by else ""
            raise RuntimeError(f"DataLoader iterator: its workers were stopped{why}; "
                               "iter(loader) starts a new epoch with new workers")
        while True:
            while self._rcvd_idx < self._send_idx:
                info = self._task_info.get(self._rcvd_idx, None)
                if info:
                    if len(info) == 2 or self._workers_status[info[0]]:
                        break
                    del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
            else:
                self._epoch_done = True
                if self._pin_ahead is not None:
                    self._pin_ahead.close()   # an ended epoch leaves no thread
                if _stats.enabled() and not self._stats_printed:
                    self._stats_printed = True
                    _stats.print_summary(self.stats(memory=False))
                if not self._persistent_workers:
                    self._shutdown_workers(deferred=True)
                else:
                    # idle long enough, they give their free slots' pages back
                    for ch in self._channels:
                        ch.between_epochs(True)
                raise StopIteration

            if len(info) == 2:
                seq = self._rcvd_idx
                del self._task_info[seq]
                self._rcvd_idx += 1
                if self._ready and self._ready[0] == seq:
                    # taken ahead, now handed out in its turn (the lowest there: the
                    # others are past the cursor); left in, _ready would keep one
                    # number per batch of an epoch whose loop is slower than the workers
                    heapq.heappop(self._ready)
                return self._process_data(info[1], info[0], seq)

            if self._ready:
                # in_order=False, pin_memory: a batch taken ahead (the due one, if
                # it was, went just above)
                seq = heapq.heappop(self._ready)
                info = self._task_info.get(seq, ())
                if len(info) == 2:
                    del self._task_info[seq]
                    return self._process_data(info[1], info[0], seq, ahead=True)
                continue   # handed out in its turn already

            if self._unsent_count:
                self._send_unsent()
                if len(self._task_info[self._rcvd_idx]) == 2:
                    continue   # the due task could not be sent: its error is due
            # pin_memory with a timeout: torch's loop waits once, with the timeout,
            # for its pin thread's output, which is the worker's time and the
            # pinning's together; a batch got in this wait is pinned by then
            waited_from = time.perf_counter() if self._pin_timed else None
            got = self._accept(self._get_data(info[0], self._wake_on_due_only))
            if got is None:
                continue
            wid, seq, result = got
            if seq != self._rcvd_idx:
                if not self._in_order:
                    self._task_info.pop(seq)
                    return self._process_data(result, wid, seq, ahead=True,
                                              waited_from=waited_from)
                self._keep_for_turn(seq, result)
            else:
                self._task_info.pop(seq)
                self._rcvd_idx += 1
                return self._process_data(result, wid, seq, waited_from=waited_from)

    def _try_put_index(self):
        max_tasks = self._prefetch_factor * self._num_workers
        if self._tasks_outstanding >= max_tasks:
            raise AssertionError("Number of outstanding tasks exceeded maximum allowed tasks")
        while True:
            try:
                index = self._next_index()
            except StopIteration:
                return
            if self._send_idx not in self._ahead_to_skip:
                break
            # resumed with in_order=False: this batch was delivered already
            self._ahead_to_skip.discard(self._send_idx)
            self._send_idx += 1
        for _ in range(self._num_workers):
            worker_queue_idx = self._cycle_order[self._cycle_pos % self._num_workers]
            self._cycle_pos += 1
            if self._workers_status[worker_queue_idx]:
                if self._in_order:
                    break
                if self._workers_num_tasks[worker_queue_idx] < max_tasks // sum(
                        self._workers_status):
                    break
        else:
            return
        self._task_info[self._send_idx] = (worker_queue_idx,)
        self._tasks_outstanding += 1
        # in order: behind any task this worker's ring had no room for yet
        unsent = self._unsent[worker_queue_idx]
        task = [self._send_idx, index, None]
        if unsent or not self._offer(worker_queue_idx, task):
            unsent.append(task)
            self._unsent_count += 1
        self._workers_num_tasks[worker_queue_idx] += 1
        self._send_idx += 1

    def _send_unsent(self):
        """Before the main process waits for a batch: the tasks whose ring had no
        room for them (a task much bigger than those before it may have to wait
        for the worker to read them), in order, as far as the rings take them now.
        The due batch's worker has read every task before it, so that one goes."""
        for wid, unsent in enumerate(self._unsent):
            while unsent and self._offer(wid, unsent[0]):
                unsent.popleft()
                self._unsent_count -= 1

    def _offer(self, wid, task):
        """Put task [seq, index, pickled index or None] in worker `wid`'s ring:
        True once it is there, or its error is in the batch's place; False if the
        ring has no room for it yet."""
        seq, index, pickled = task
        ch = self._channels[wid]
        try:
            if pickled is None:
                # put_index writes a range as its list of ints: right for ours, not
                # for a range the user's sampler yields (the dataset must get the range)
                if not (type(index) is range and not self._sends_ranges) \
                        and ch.put_index(seq, index):
                    return True
                if self._sends_ranges:
                    index = as_list(index)
                try:
                    pickled = dumps_indices(index)
                except Exception:
                    # indices that cannot be pickled (an object holding a lambda):
                    # torch's queue thread prints the error and its loader waits for
                    # ever; here the batch raises it in its turn (see below)
                    return self._fail_in_turn(wid, seq, f"in the main process, pickling "
                                                        f"batch {seq}'s indices for worker {wid}")
                task[2] = pickled
            return ch.offer_task(TASK_PICKLE, seq, pickled)
        except (MemoryError, ValueError):
            # The task ring's pages could not be reserved (shared memory is full),
            # or the task is larger than a ring can ever take.
            if ch.closed:
                raise
            return self._fail_in_turn(wid, seq, f"in the main process, sending batch {seq}'s "
                                                f"task to worker {wid}")

    def _fail_in_turn(self, wid, seq, where):
        """Batch `seq`'s task could not be sent (the exception being handled says
        why): the batch raises it in its turn, as a worker's error would, and the
        batches before and after it are delivered; raised here, inside the caller's
        next(), it would lose the batch in hand. True: the task is dealt with."""
        error = ExceptionWrapper(where=where)
        self._task_info[seq] = (wid, (error, WHERE_NONE, _NOT_SENT))
        self._tasks_outstanding -= 1
        return True

    def _accept(self, got):
        """A received result's bookkeeping. A resume's answer or a worker's end of
        stream is done with here (None); a batch or an error is returned as
        (worker, seq, (data, where, snapshot)) for its turn."""
        wid, seq, kind, data, where = got
        if not self._expected(wid, seq, kind, data):
            self._refuse(wid, seq, kind, data)
        self._tasks_outstanding -= 1
        if kind == RES_ITER_END:
            self._ended_at[wid] = seq
            if self._persistent_workers:
                self._workers_status[wid] = False
            else:
                self._mark_worker_as_unavailable(wid)
            self._try_put_index()
            return None
        snap = None
        if kind == RES_BATCH_SNAP:
            data, snap = data
            # kept for state_dict() for long: a copy, so that it does not pin a
            # ring slot (nor make later forks inherit it, see segment.c)
            snap = copy.deepcopy(snap)
        elif kind == RES_ERROR and isinstance(data, BaseException):
            # the batch arrived but could not be rebuilt here (see
            # fl_mainchan_take): its error is raised, unchanged (the type torch's
            # unpickling would raise), in its turn, noted with whose batch it was
            # (an iterable dataset's task numbers count its workers' ends too)
            which = ("a batch" if self._dataset_kind == _DatasetKind.Iterable
                     else f"batch {seq} of the epoch (counted from 0)")
            data = _Unrebuilt(data, f"{which}, which DataLoader worker process {wid} "
                                    f"built and sent without error")
        elif kind == RES_ERROR and data is None:
            # a bare notice: the worker had no shared memory to send its error in
            # (worker.py, on_fetch)
            data = _Unrebuilt(RuntimeError(
                f"fastloader: DataLoader worker process {wid} could not send batch {seq}'s "
                f"result, nor the error it got (most often: no shared memory could be "
                f"created for either: /dev/shm full, a memory or file-size limit, or no "
                f"file descriptor left in the worker). The worker printed the error and "
                f"its traceback to its stderr."))
        return wid, seq, (data, where, snap)

    def _expected(self, wid, seq, kind, data) -> bool:
        """Whether a result is one that worker `wid` can send now: the answer to a
        task it was given and has not answered (a worker answers each task once),
        of a kind its dataset has, with a payload of that kind. The ring is shared
        memory: a worker whose memory was corrupted (a native extension writing
        out of bounds), or another process, can write any descriptor there."""
        info = self._task_info.get(seq)
        if info is None:
            # an ended replica answers the tasks it was still given with more ends;
            # the cursor may have dropped their entries already
            return (kind == RES_ITER_END and not self._workers_status[wid]
                    and 0 <= seq < self._send_idx)
        if len(info) != 1 or info[0] != wid:
            return False
        if kind == RES_BATCH:
            return True
        if kind == RES_ERROR:
            return data is None or isinstance(data, (ExceptionWrapper, BaseException))
        if kind == RES_BATCH_SNAP:
            return type(data) is tuple and len(data) == 2
        # a resume's answers are all taken by _reset
        return kind == RES_ITER_END and self._dataset_kind == _DatasetKind.Iterable

    def _refuse(self, wid, seq, kind, data):
        """A result no task asked for: the epoch cannot go on (which batch it was
        meant to be is unknown), so it stops as for a worker's death."""
        message = (f"DataLoader worker {wid} (pid {self._pool.pids[wid]}) sent a result "
                   f"that this process cannot accept (kind {kind}, batch {seq}, a "
                   f"{type(data).__name__}): not the answer to a task it was given. Its "
                   f"ring, in shared memory, was written by something else than "
                   f"fastloader's worker loop: most often memory corruption in the worker "
                   f"(a native extension writing out of bounds).")
        self._shutdown_workers(grace=_FAILURE_GRACE_S)
        self._stopped_by = message
        raise _core.WorkerError(message)

    def _take_ahead(self):
        """pin_memory: take every batch already published, each kept for its turn
        (out of order: to be handed out before any still to come), and have the pin
        thread pin them while the loop works on the batch handed out now
        (pin_ahead.py). Never sleeps: with timeout 0, recv returns what is published
        or None (a worker's death is seen by the next wait)."""
        taken = []
        while True:
            got = _core.recv(self._channels, 0, 0.0)
            if got is None:
                break
            got = self._accept(got)
            if got is not None:
                taken.append(got)
        # the rings are read worker by worker: the batch due first goes first, so
        # that the thread cannot start on a later one before it is given
        for _wid, seq, result in sorted(taken, key=operator.itemgetter(1)):
            self._keep_for_turn(seq, result)

    def _keep_for_turn(self, seq, result):
        """In order: a result that arrived before its turn waits in _task_info;
        with pin_memory a batch is given to the pin thread meanwhile. Out of order
        (taken ahead with pin_memory): it waits there too, its number in _ready."""
        data, where, snap = result
        if self._pin_ahead is not None and not isinstance(data, (ExceptionWrapper,
                                                                 _Unrebuilt)):
            result = (self._pin_ahead.give(seq, data), where, snap)
        self._task_info[seq] += (result,)
        if not self._in_order:
            heapq.heappush(self._ready, seq)

    def _pinned_result(self, result, worker_idx, seq, ahead, waited_from):
        """pin_memory: batch `seq`'s result, pinned, before anything of it is
        counted. A Ctrl-C or a timeout while it is being pinned puts the batch back
        as not yet handed out (a state saved then, as the workers stop, still has it
        to come; after a timeout, the next next() gets it, or, out of order, an
        earlier batch that has come meanwhile)."""
        data, where, snap = result
        is_error = isinstance(data, (ExceptionWrapper, _Unrebuilt))
        try:
            if not is_error:
                self._pin_ahead.at_turn(seq, data, self._recv_timeout)
            # taking the others decodes them: a Ctrl-C may land there too
            self._take_ahead()
            if is_error:
                return result
            return self._pin_ahead.take(seq, data, self._recv_timeout,
                                        since=waited_from), where, snap
        except (KeyboardInterrupt, TimeoutError) as e:
            # the caller took it off _task_info and, unless it came out of order
            # (`ahead`), moved _rcvd_idx past it
            self._task_info[seq] = (worker_idx, result)
            if ahead:
                heapq.heappush(self._ready, seq)
            else:
                self._rcvd_idx = seq
            if isinstance(e, KeyboardInterrupt):
                self._interrupted()
                raise
            raise self._timed_out() from None

    def _process_data(self, result, worker_idx, seq, ahead=False, waited_from=None):
        """Hand out batch `seq`, taken off _task_info (`ahead`: out of order, before
        _rcvd_idx's batch; else _rcvd_idx is past it). `waited_from`: when the wait
        that received it began, if it was received in this next()."""
        if self._pin_ahead is not None:
            result = self._pinned_result(result, worker_idx, seq, ahead, waited_from)
        if ahead:
            self._tracker.delivered_ahead(seq, self._rcvd_idx)
        data, where, snap = result
        self._workers_num_tasks[worker_idx] -= 1
        self._counters.delivered(worker_idx, where)
        if snap is not _NOT_SENT:
            self._tracker.delivered(worker_idx, seq, snap)
        self._try_put_index()
        if isinstance(data, ExceptionWrapper):   # a pinning error too
            data.reraise()
        if type(data) is _Unrebuilt:
            raise data.noted()
        return data

    def _mark_worker_as_unavailable(self, worker_id, shutdown=False):
        self._pool.stop_worker(worker_id)
        self._workers_status[worker_id] = False
        # its tasks not sent yet will not be: torch's are lost with the worker's
        # queue too, and _next_data skips the batches of an unavailable worker
        self._unsent_count -= len(self._unsent[worker_id])
        self._unsent[worker_id].clear()

    # -- shutdown ---------------------------------------------------------------------
    def _shutdown_workers(self, grace=5.0, deferred=False):
        """Stop the workers. `deferred` (an epoch's end, a dropped iterator): tell
        them to stop and return; reaper.py waits for and reaps them off the
        training loop's path. Otherwise (Ctrl-C, a death, and torch's own callers
        of this method) wait for them here, terminating those still busy after
        `grace` seconds."""
        if self._shutdown:
            return
        self._shutdown = True
        try:
            if getattr(self, "_pin_ahead", None) is not None:
                # on a failure, not even a copy under way may hold up the error
                self._pin_ahead.close(wait=deferred)
            self._leave_state_with_loader()
        finally:   # a Ctrl-C in the above still stops the workers
            pool = self._pool
            if pool is not None:
                if deferred:
                    pool.retire(timeout=grace)
                else:
                    pool.shutdown(timeout=grace)

    def _leave_state_with_loader(self):
        # the loader answers state_dict() after this iterator is gone (an epoch
        # that ended, or a loop that broke out)
        session = getattr(self, "_session", None)
        if session is not None and hasattr(self, "_tracker"):
            try:
                # the epoch's figures, kept for loader.stats(); without reading each
                # worker's /proc smaps, which would slow every iterator's teardown
                session.ended(self, self.state_dict(), self.stats(memory=False))
            except Exception:
                pass

    def __del__(self):
        try:
            self._shutdown_workers(deferred=True)
        except Exception:   # interpreter teardown: modules may already be gone
            pass


class _LengthCheckedIter(FastMultiProcessingIter):
    """The iterator of an IterableDataset whose len() was asked (before this epoch,
    through len(loader)): torch's own __next__ counts the samples against that
    length and warns with stacklevel=2, which must be the user's loop, as with
    torch, not a __next__ of ours that calls it. _reset() picks the class."""

    __next__ = _BaseDataLoaderIter.__next__
