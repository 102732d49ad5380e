"""Datasets, samplers and worker functions for tests/conformance/test_conformance.py.

Module level, so that workers started with "spawn" or "forkserver" can unpickle
them as ``tests.support.conformance_datasets.<name>``. Cheap to import (torch, numpy).

Every value a dataset returns is derived from its index, its worker's identity
(WorkerInfo) or its worker's seeded RNGs, so that equal outcomes under torch's
and fastloader's DataLoader mean equal behaviour, not luck. Reprs are fixed
(no addresses) because torch puts ``repr(dataset)`` into messages and WorkerInfo.
"""
import collections
import collections.abc
import multiprocessing
import os
import random
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

# Set by a test in the main process just before it builds a loader: a forked worker
# sees the new value, a spawned or forkserver-started one re-imports this module.
START_MARKER = None


def _thread_name():
    try:
        with open(f"/proc/self/task/{_gettid()}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _gettid():
    return getattr(os, "gettid", os.getpid)()


def describe_worker(owner):
    """What a sample can say about the process that made it (all collatable)."""
    info = get_worker_info()
    if info is None:
        return {"in_worker": False, "id": -1, "num_workers": 0, "seed": "", "repr": "",
                "dataset_is_replica": False, "initial_seed": str(torch.initial_seed()),
                "threads": torch.get_num_threads(), "daemon": False, "frozen": ""}
    try:
        info.id = 99
        frozen = "assignment allowed"
    except Exception as exc:  # noqa: BLE001 - the message is the observation
        frozen = f"{type(exc).__name__}: {exc}"
    return {
        "in_worker": True,
        "id": info.id,
        "num_workers": info.num_workers,
        "seed": str(info.seed),                   # may not fit in int64 once collated
        "repr": repr(info),
        "dataset_is_replica": info.dataset is owner,
        "initial_seed": str(torch.initial_seed()),
        "threads": torch.get_num_threads(),
        "daemon": multiprocessing.current_process().daemon,
        "frozen": frozen,
    }


# ---- map-style -----------------------------------------------------------------------

class InfoDataset(Dataset):
    """Per sample: its index, the worker's WorkerInfo and RNG draws from torch, numpy
    and random, and what worker_init_fn recorded in this replica."""

    def __init__(self, n=12):
        self.n = n
        self.init_record = ""

    def __repr__(self):
        return f"InfoDataset(n={self.n})"

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return {
            "index": index,
            "worker": describe_worker(self),
            "torch": torch.rand(2),
            "numpy": np.random.rand(2),
            "python": random.random(),
            "init": self.init_record,
        }


def record_init(worker_id):
    """A worker_init_fn that records the state it finds: worker id, WorkerInfo and the
    first draw of every RNG (equal draws under both loaders: seeded before init)."""
    info = get_worker_info()
    info.dataset.init_record = (
        f"worker_id={worker_id} info.id={info.id} num_workers={info.num_workers} "
        f"seed={info.seed} initial_seed={torch.initial_seed()} "
        f"random={random.random()!r} numpy={np.random.rand()!r} "
        f"torch={torch.rand(1).item()!r}"
    )


class FailingInit:
    """A worker_init_fn that raises in worker `fail_on` (every worker when None)."""

    def __init__(self, fail_on=None, exc_type=ValueError):
        self.fail_on = fail_on
        self.exc_type = exc_type

    def __call__(self, worker_id):
        if self.fail_on is None or worker_id == self.fail_on:
            raise_from_init(self.exc_type, worker_id)


def raise_from_init(exc_type, worker_id):
    raise exc_type(f"worker_init_fn failed in worker {worker_id}")


class IndexDataset(Dataset):
    """index -> tensor([index, 10 * index]); optionally sleeps at some indices."""

    def __init__(self, n=12, delays=None):
        self.n = n
        self.delays = dict(delays or {})

    def __repr__(self):
        return f"IndexDataset(n={self.n})"

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        delay = self.delays.get(int(index))
        if delay:
            time.sleep(delay)
        return torch.tensor([index, 10 * index])


class NoLenDataset(Dataset):
    """A map-style dataset without __len__."""

    def __getitem__(self, index):
        return torch.tensor([index])


class RaiseAtDataset(Dataset):
    """Raises `exc_type` at the indices in `bad`; StopIteration is allowed too."""

    def __init__(self, n=12, bad=(5,), exc_type=ValueError):
        self.n = n
        self.bad = tuple(bad)
        self.exc_type = exc_type

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if index in self.bad:
            if self.exc_type is TwoArgError:
                raise TwoArgError(index, f"bad sample {index}")
            raise self.exc_type(f"bad sample {index}")
        return torch.tensor([index])


class TwoArgError(Exception):
    """Cannot be rebuilt from a message alone: torch re-raises it as RuntimeError."""

    def __init__(self, code, text):
        super().__init__(code, text)


class StatefulDataset(Dataset):
    """Counts __getitem__ calls in its replica: with persistent workers the count
    carries over to the next epoch; without, every epoch starts from fresh replicas."""

    def __init__(self, n=8):
        self.n = n
        self.calls = 0

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        self.calls += 1
        info = get_worker_info()
        return {"index": index, "calls": self.calls, "pid": os.getpid(),
                "worker": -1 if info is None else info.id}


class IndexTypeDataset(Dataset):
    """Returns the index it was given, its type and repr: an index must reach the
    dataset exactly as the sampler yielded it (numpy ints, tensors, strings, tuples)."""

    def __len__(self):
        return 6

    def __getitem__(self, index):
        return {"type": type(index).__name__, "repr": repr(index)}


class ProcessEnvDataset(Dataset):
    """What a worker process looks like from the inside (beyond WorkerInfo)."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return {"index": index, "thread_name": _thread_name(),
                "intra_op_threads": torch.get_num_threads(),
                "daemon": multiprocessing.current_process().daemon,
                "is_main_thread": _gettid() == os.getpid()}


class StartMethodDataset(Dataset):
    """Tells how its worker was started: a forked worker sees the main process's
    START_MARKER; a spawned or forkserver one does not, and its Process class set
    the start method it was started with (a spawned worker's parent is not told:
    fastloader forks it from a clean server, see spawn_server.py); and which
    Process class started it."""

    def __init__(self, token, n=2):
        self.token = token
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if START_MARKER == self.token:
            method = "fork"
        else:
            # multiprocessing's bootstrap fixes it from the class: 'spawn' for a
            # SpawnProcess, 'forkserver' for a ForkServerProcess
            method = multiprocessing.get_start_method(allow_none=True)
        # the worker's Process class shows in its name ("Process-3" from the
        # default context, "SpawnProcess-3" from a spawn context...; the number
        # counts every process started before, so it is left out)
        kind = multiprocessing.current_process().name.rsplit("-", 1)[0]
        return {"index": index, "method": method, "process_kind": kind}


class GetitemsDataset(Dataset):
    """Has __getitems__: each sample says which path fetched it and with which batch."""

    def __init__(self, n=10, batch_type="list"):
        self.n = n
        self.batch_type = batch_type

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return {"index": index, "via": "__getitem__", "batch": str([index])}

    def __getitems__(self, indices):
        indices = list(indices)
        if self.batch_type == "columns":
            # "already collated" (Hugging Face style): paired with columns_collate
            return {"index": torch.tensor(indices), "via": "__getitems__",
                    "batch": str(indices)}
        return [{"index": i, "via": "__getitems__", "batch": str(indices)} for i in indices]


def columns_collate(batch):
    return dict(batch, collated=True)


class GetitemsNoneDataset(GetitemsDataset):
    """__getitems__ set to None: torch must fall back to __getitem__."""

    __getitems__ = None


# ---- what default_convert (batch_size=None) and default_collate do with each kind ----

Point = collections.namedtuple("Point", ["x", "y"])


class AttrDict(dict):
    """A dict subclass with an attribute (default_convert/collate copy it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = "attr"


class FrozenSeq(collections.abc.Sequence):
    """An immutable Sequence that can be built from a list."""

    def __init__(self, items):
        self._items = list(items)

    def __getitem__(self, i):
        return self._items[i]

    def __len__(self):
        return len(self._items)

    def __eq__(self, other):
        return type(other) is type(self) and list(self) == list(other)

    def __repr__(self):
        return f"FrozenSeq({self._items!r})"


def _kind_sample(kind, index):
    a = np.arange(3, dtype=np.float32) + index
    if kind == "ndarray":
        return a
    if kind == "np_float64":
        return np.float64(index) / 4
    if kind == "np_bool":
        return np.bool_(index % 2)
    if kind == "np_str_scalar":
        return np.str_(f"s{index}")
    if kind == "np_str_array":
        return np.array([f"a{index}", "b"])
    if kind == "np_object_array":
        return np.array([index, "x"], dtype=object)
    if kind == "tuple":
        return (a, index, f"t{index}")
    if kind == "namedtuple":
        return Point(a, np.int64(index))
    if kind == "list":
        return [a, index * 1.5, None, True, b"b", "s"]
    if kind == "dict":
        return {"b": a, "a": index}
    if kind == "ordereddict":
        return collections.OrderedDict([("z", a), ("y", index)])
    if kind == "defaultdict":
        d = collections.defaultdict(list)
        d["v"] = a
        d["n"] = index
        return d
    if kind == "dict_subclass":
        return AttrDict(v=a, n=index)
    if kind == "range":
        return range(index, index + 3)
    if kind == "frozen_sequence":
        return FrozenSeq([a, index])
    if kind == "tensor":
        return torch.full((2,), index, dtype=torch.int16)
    if kind == "python_scalars":
        return [index, index / 2, f"s{index}", b"b", None, complex(index, 1)]
    if kind == "nested":
        return {"p": Point(np.int32(index), (np.float16(index), [np.arange(2)]))}
    raise ValueError(kind)


CONVERT_KINDS = ("ndarray", "np_float64", "np_bool", "np_str_scalar", "np_str_array",
                 "np_object_array", "tuple", "namedtuple", "list", "dict", "ordereddict",
                 "defaultdict", "dict_subclass", "range", "frozen_sequence", "tensor",
                 "python_scalars", "nested")


class KindDataset(Dataset):
    def __init__(self, kind, n=6):
        self.kind = kind
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return _kind_sample(self.kind, index)


# ---- iterable-style ------------------------------------------------------------------

class RangeIterable(IterableDataset):
    """Yields tensor([value, worker id]).

    mode "replica": every worker yields range(n) (no sharding: duplicates, as torch warns);
    mode "shard": range(n) split into contiguous shards with get_worker_info();
    mode "sizes": worker w yields sizes[w] values (uneven shards; 0 ends it at once).
    `raise_at`: the value at which the iterator raises ValueError instead."""

    def __init__(self, n=10, mode="shard", sizes=None, raise_at=None, as_numpy=False):
        self.n = n
        self.mode = mode
        self.sizes = tuple(sizes or ())
        self.raise_at = raise_at
        self.as_numpy = as_numpy

    def __repr__(self):
        return f"{type(self).__name__}(n={self.n}, mode={self.mode!r})"

    def _values(self):
        info = get_worker_info()
        wid = -1 if info is None else info.id
        if self.mode == "replica" or info is None and self.mode == "shard":
            return wid, range(self.n)
        if self.mode == "shard":
            per = -(-self.n // info.num_workers)
            return wid, range(wid * per, min((wid + 1) * per, self.n))
        if self.mode == "sizes":
            w = max(wid, 0)
            start = sum(self.sizes[:w])
            return wid, range(start, start + self.sizes[w])
        raise ValueError(self.mode)

    def __iter__(self):
        wid, values = self._values()
        for v in values:
            if v == self.raise_at:
                raise ValueError(f"iterable failed at {v}")
            if self.as_numpy:
                yield np.array([v, wid], dtype=np.int32)
            else:
                yield torch.tensor([v, wid])


class SizedRangeIterable(RangeIterable):
    """A RangeIterable whose __len__ reports `length` (possibly less than it yields)."""

    def __init__(self, length, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def __len__(self):
        return self.length


class InfoIterable(IterableDataset):
    """Yields, per worker, `per_worker` samples describing the worker (sharding by
    get_worker_info) plus the worker's RNG draws."""

    def __init__(self, per_worker=3):
        self.per_worker = per_worker

    def __repr__(self):
        return f"InfoIterable(per_worker={self.per_worker})"

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        for k in range(self.per_worker):
            yield {"value": wid * 100 + k, "worker": describe_worker(self),
                   "torch": torch.rand(1), "numpy": np.random.rand(1),
                   "python": random.random()}


def tagged_collate(batch):
    return {"tag": "tagged", "data": torch.stack(batch)}


# ---- samples with a pin_memory() method (custom batch type) -------------------------

class PinnableBatch:
    def __init__(self, data):
        self.data = data
        self.pinned_by_hook = False

    def pin_memory(self):
        self.data = self.data.pin_memory()
        self.pinned_by_hook = True
        return self


def pinnable_collate(batch):
    return PinnableBatch(torch.stack(batch))


class SparseDataset(Dataset):
    """Sparse tensors of every layout torch's transport rebuilds: COO (not
    coalesced, and coalesced), CSR, CSC, BSR."""

    def __len__(self):
        return 2

    def __getitem__(self, index):
        coo = torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1]]),
                                      torch.tensor([1.0, 2.0 + index]), (2, 2))
        dense = torch.eye(2) * (index + 1)
        return [coo, coo.coalesce(), dense.to_sparse_csr(), dense.to_sparse_csc(),
                torch.eye(4).to_sparse_bsr((2, 2))]
