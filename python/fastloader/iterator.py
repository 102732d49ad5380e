"""The multi-worker iterator: sampler -> tasks -> workers -> ring -> batches.

It follows torch's _MultiProcessingDataLoaderIter task for task (round-robin
dispatch, prefetch_factor tasks per worker, in-order delivery with a reorder
buffer, IterableDataset exhaustion per worker, persistent workers, timeout), so
batches come out identical; only the transport differs."""
from __future__ import annotations

import itertools
import pickle
import time

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _DatasetKind
from torch.utils.data._utils import pin_memory as _pin
from torch.utils.data.dataloader import _BaseDataLoaderIter

from . import _core
from . import stats as _stats
from .pool import STRATEGIES, WorkerPool, WorkerSpec

# Slots per worker beyond its prefetched batches: the one the consumer holds, the
# one it is about to drop, and one of slack for a pin-memory or prefetch stage.
_EXTRA_SLOTS = 3


def _task_bytes_estimate(loader) -> int:
    bs = getattr(loader.batch_sampler, "batch_size", None) or loader.batch_size or 1
    return 64 + 8 * int(bs)


class FastMultiProcessingIter(_BaseDataLoaderIter):
    _clock = staticmethod(time.perf_counter)
    _epoch = 0

    def __init__(self, loader):
        super().__init__(loader)
        if self._num_workers <= 0:
            raise AssertionError("num_workers must be greater than 0")
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = getattr(loader, "in_order", True)
        self._shutdown = False
        self._pool = None
        context = loader.multiprocessing_context
        if context is None:
            context = torch.multiprocessing.get_context()
        max_tasks = self._prefetch_factor * self._num_workers
        specs = [
            WorkerSpec(self._dataset_kind, self._dataset, self._auto_collation,
                       self._collate_fn, self._drop_last, self._base_seed,
                       loader.worker_init_fn, wid, self._num_workers,
                       self._prefetch_factor + _EXTRA_SLOTS)
            for wid in range(self._num_workers)
        ]
        self._pool = WorkerPool(
            context, specs, STRATEGIES[loader.sharing_strategy],
            task_capacity=max(1 << 20, 4 * max_tasks * _task_bytes_estimate(loader)),
            result_capacity=max_tasks + 2)
        self._channels = self._pool.channel_tuple
        self._reset(loader, first_iter=True)

    def __next__(self):
        # torch's __next__ opens a profiler range per batch (a few microseconds,
        # a large share of our per-batch cost) and checks an IterableDataset's
        # length. Take that path whenever it can matter; otherwise do the same
        # bookkeeping without the range.
        if (self._dataset_kind == _DatasetKind.Iterable
                and self._IterableDataset_len_called is not None) \
                or torch.autograd._profiler_enabled():
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

    def segments(self):
        """(address, nbytes) of the ring arenas mapped in this process."""
        return [a for a in (ch.arena() for ch in self._channels) if a is not None]

    def stats(self, memory=True):
        """This epoch so far: batches delivered (by transport), time waited for
        data, and per worker: batches, busy/idle time, ring occupancy, USS/PSS."""
        return _stats.collect(self, memory=memory)

    # -- epoch control -------------------------------------------------------------
    def _reset(self, loader, first_iter=False):
        super()._reset(loader, first_iter)
        self._epoch += 1
        self._epoch_started = self._clock()
        self._wait_s = 0.0
        self._delivered = [0, 0, 0]   # batches handed out, by where they travelled
        self._delivered_by_worker = [0] * self._num_workers
        self._stats_printed = False
        self._send_idx = 0
        self._rcvd_idx = 0
        self._task_info = {}
        self._tasks_outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        if not first_iter:
            for ch in self._channels:
                ch.put_task(_core.TASK_RESUME, -1)
            waiting = self._num_workers
            while waiting > 0:
                _wid, seq, kind, _data, _where = self._get_data()
                if kind == _core.RES_RESUMED:
                    waiting -= 1
                # anything else is left over from an abandoned epoch: dropped
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    def _get_data(self):
        timeout = self._timeout if self._timeout > 0 else None
        prefer = self._task_info.get(self._rcvd_idx, (0,))[0]
        started = self._clock()
        try:
            got = _core.recv(self._channels, prefer, timeout)
            self._wait_s += self._clock() - started
        except KeyboardInterrupt:
            # Ctrl-C: stop the workers now (briefly let idle ones exit by
            # themselves, terminate busy ones) so the program can exit at once.
            self._shutdown_workers(grace=0.5)
            raise
        if got is None:
            raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
        wid, seq, kind, data, where = got
        if kind == _core.RES_DEAD:
            message = self._pool.death_message(wid)
            self._shutdown_workers()
            raise _core.WorkerError(message)
        return got

    def _next_data(self):
        while True:
            while self._rcvd_idx < self._send_idx:
                info = self._task_info.get(self._rcvd_idx, None)
                if info:
                    worker_id = info[0]
                    if len(info) == 2 or self._workers_status[worker_id]:
                        break
                    del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
            else:
                if _stats.enabled() and not self._stats_printed:
                    self._stats_printed = True
                    _stats.print_summary(self)
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration

            if len(self._task_info[self._rcvd_idx]) == 2:
                worker_id, (data, where) = self._task_info.pop(self._rcvd_idx)
                self._rcvd_idx += 1
                return self._process_data(data, worker_id, where)

            wid, seq, kind, data, where = self._get_data()
            if kind == _core.RES_RESUMED:
                continue
            self._tasks_outstanding -= 1
            if kind == _core.RES_ITER_END:
                if self._persistent_workers:
                    self._workers_status[wid] = False
                else:
                    self._mark_worker_as_unavailable(wid)
                self._try_put_index()
                continue
            if kind == _core.RES_ERROR and not isinstance(data, ExceptionWrapper):
                data = ExceptionWrapper(where=f"in DataLoader worker process {wid}")
            if seq != self._rcvd_idx:
                if not self._in_order:
                    self._task_info.pop(seq)
                    return self._process_data(data, wid, where)
                self._task_info[seq] += ((data, where),)
            else:
                self._task_info.pop(seq)
                self._rcvd_idx += 1
                return self._process_data(data, wid, where)

    def _try_put_index(self):
        max_tasks = self._prefetch_factor * self._num_workers
        if self._tasks_outstanding >= max_tasks:
            raise AssertionError("Number of outstanding tasks exceeded maximum allowed tasks")
        try:
            index = self._next_index()
        except StopIteration:
            return
        for _ in range(self._num_workers):
            worker_queue_idx = next(self._worker_queue_idx_cycle)
            if self._workers_status[worker_queue_idx]:
                if self._in_order:
                    break
                if self._workers_num_tasks[worker_queue_idx] < max_tasks // sum(
                        self._workers_status):
                    break
        else:
            return
        ch = self._channels[worker_queue_idx]
        if not ch.put_index(self._send_idx, index):
            ch.put_task(_core.TASK_PICKLE, self._send_idx,
                        pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
        self._task_info[self._send_idx] = (worker_queue_idx,)
        self._workers_num_tasks[worker_queue_idx] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    def _process_data(self, data, worker_idx, where):
        self._workers_num_tasks[worker_idx] -= 1
        self._delivered[where] += 1
        self._delivered_by_worker[worker_idx] += 1
        self._try_put_index()
        if isinstance(data, ExceptionWrapper):
            data.reraise()
        if self._pin_memory:
            data = _pin.pin_memory(data, self._pin_memory_device)
        return data

    def _mark_worker_as_unavailable(self, worker_id, shutdown=False):
        self._pool.stop_worker(worker_id)
        self._workers_status[worker_id] = False

    # -- shutdown ---------------------------------------------------------------------
    def _shutdown_workers(self, grace=5.0):
        if self._shutdown:
            return
        self._shutdown = True
        pool = self._pool
        if pool is not None:
            pool.shutdown(timeout=grace)

    def __del__(self):
        try:
            self._shutdown_workers()
        except Exception:   # interpreter teardown: modules may already be gone
            pass
