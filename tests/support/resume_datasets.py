"""Datasets for the resume tests (module level, so spawned workers import them)."""
import random

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class RandomAugmented(Dataset):
    """Each sample draws from random, torch and numpy in the worker: a resume that
    does not restore worker RNGs exactly gives different values."""

    def __init__(self, n=60):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"i": i, "r": random.random(), "t": torch.rand(2), "np": np.random.rand()}


class _StatefulWhenAsked:
    """`state_dict`/`load_state_dict` exist only when `self.stateful` (a plain
    iterable otherwise): they are the class's `_state_dict`/`_load_state_dict`."""

    def __getattr__(self, name):
        if name in ("state_dict", "load_state_dict") and self.__dict__.get("stateful"):
            return getattr(self, "_" + name)
        raise AttributeError(name)


class CountingStream(_StatefulWhenAsked, IterableDataset):
    """Sharded by worker; with `stateful`, it can save and restore its position
    (torchdata's Stateful protocol), otherwise a resume must replay."""

    def __init__(self, n=45, stateful=True):
        self.n = n
        self.stateful = stateful
        self._pos = 0

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        mine = list(range(wid, self.n, nw))
        start, self._pos = self._pos, 0
        for k in range(start, len(mine)):
            self._pos = k + 1
            yield {"x": mine[k], "noise": torch.rand(1)}

    def _state_dict(self):
        return {"pos": self._pos}

    def _load_state_dict(self, state):
        self._pos = state["pos"]


class ArgumentStateStream(IterableDataset):
    """A `state_dict` that needs arguments, as MosaicML streaming's
    `StreamingDataset.state_dict(num_samples, from_beginning)` and litdata's
    `state_dict(num_samples_yielded, num_workers, batch_size)` do (litdata also
    refuses to run it in a worker). torch's DataLoader never calls it."""

    def __init__(self, n=24):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for x in range(wid, self.n, nw):
            yield {"x": x, "noise": torch.rand(1)}

    def state_dict(self, num_samples, from_beginning):
        if get_worker_info() is not None:
            raise RuntimeError("state_dict() should only be called in the main process")
        return {"sample_in_epoch": num_samples}

    def load_state_dict(self, state):
        raise AssertionError("a dataset whose state_dict needs arguments is not restored")


class FailingStateStream(CountingStream):
    """torchdata's Stateful protocol, but `state_dict()` fails when `fail` says so
    (e.g. it reads what `__iter__` has not set up yet)."""

    def __init__(self, n=45, fail=lambda pos: True):
        super().__init__(n, stateful=True)
        self.fail = fail

    def _state_dict(self):
        if self.fail(self._pos):
            raise RuntimeError(f"no state at position {self._pos}")
        return super()._state_dict()


def fail_always(pos):
    return True


def fail_past_start(pos):
    return pos > 0


class SlowAt(Dataset):
    """Map-style; the samples in `slow` take `delay` seconds, so that with
    in_order=False the batches after theirs are delivered ahead of them."""

    def __init__(self, n=40, slow=(8,), delay=0.6):
        self.n, self.slow, self.delay = n, frozenset(slow), delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.slow:
            import time
            time.sleep(self.delay)
        return {"i": i, "r": random.random()}


class UnsendableStateStream(CountingStream):
    """torchdata's Stateful protocol, but the state holds a lock: it cannot travel
    to the main process with the batch."""

    def __init__(self, n=45):
        super().__init__(n, stateful=True)

    def _state_dict(self):
        import threading
        return {"pos": self._pos, "lock": threading.Lock()}


class SlowStream(CountingStream):
    """CountingStream whose items in `slow` take `delay` seconds (with
    in_order=False, the batches after theirs are delivered ahead of them)."""

    def __init__(self, n=48, stateful=True, slow=(6,), delay=0.5):
        super().__init__(n, stateful)
        self.slow, self.delay = frozenset(slow), delay

    def __iter__(self):
        import time
        for item in super().__iter__():
            if item["x"] in self.slow:
                time.sleep(self.delay)
            yield item


class FailingRestoreStream(CountingStream):
    """torchdata's Stateful protocol, but `load_state_dict()` raises."""

    def __init__(self, n=45):
        super().__init__(n, stateful=True)

    def _load_state_dict(self, state):
        raise RuntimeError(f"cannot restore {state}")


class LazyResetStream(IterableDataset):
    """Stateful, and goes back to its start only when its iterator's body runs (at
    the first batch), unless a loaded position says otherwise: until then, at a
    persistent worker's later epoch, state_dict() tells where the last one ended."""

    def __init__(self, n=24):
        self.n = n
        self._pos, self._loaded = 0, None

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        mine = list(range(wid, self.n, nw))
        start, self._loaded = self._loaded or 0, None
        for k in range(start, len(mine)):
            self._pos = k + 1
            yield {"x": mine[k], "noise": torch.rand(1)}

    def state_dict(self):
        return {"pos": self._pos}

    def load_state_dict(self, state):
        self._loaded = state["pos"]


class GatedStream(CountingStream):
    """CountingStream whose item `gate_item` waits for the file `gate` to exist, and
    whose worker 0 creates the file `ended` once its share is done (its end of
    stream follows at once): a test decides what the main process has received
    when the gated batch arrives."""

    def __init__(self, n, gate_item, gate, ended, stateful=False):
        super().__init__(n, stateful)
        self.gate_item, self.gate, self.ended = gate_item, str(gate), str(ended)

    def __iter__(self):
        import os
        import time
        for item in super().__iter__():
            if item["x"] == self.gate_item:
                while not os.path.exists(self.gate):
                    time.sleep(0.01)
            yield item
        info = get_worker_info()
        if info is not None and info.id == 0:
            open(self.ended, "w").close()


class LiveStateStream(LazyResetStream):
    """LazyResetStream whose state_dict() returns its live state (a dict it goes
    on updating), not a copy."""

    def __init__(self, n=24):
        super().__init__(n)
        self._live = {"pos": 0}

    def __iter__(self):
        for item in super().__iter__():
            self._live["pos"] = self._pos
            yield item

    def state_dict(self):
        return self._live


class _RaisingIterator:
    """Yields `items`, but raises ValueError for those in `bad` (each taken once):
    an iterator that goes on after an error, as a class-based one can."""

    def __init__(self, items, bad):
        self.items, self.bad, self.k = items, bad, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.k >= len(self.items):
            raise StopIteration
        x = self.items[self.k]
        self.k += 1
        if x in self.bad:
            raise ValueError(f"bad item {x}")
        return x


class RaisingStream(IterableDataset):
    """Plain iterable whose items in `bad` raise (the user may catch it and go on)."""

    def __init__(self, n, bad):
        self.n, self.bad = n, frozenset(bad)

    def __iter__(self):
        return _RaisingIterator(list(range(self.n)), self.bad)


class RaisingItems(Dataset):
    """Map-style; the items in `bad` raise."""

    def __init__(self, n, bad):
        self.n, self.bad = n, frozenset(bad)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise ValueError(f"bad item {i}")
        return i


class EagerDrawStream(_StatefulWhenAsked, IterableDataset):
    """Stateful or plain; its __iter__ (not a generator) draws from torch's RNG when
    it is called, as one that shuffles its shard each epoch does."""

    def __init__(self, n=12, stateful=True):
        self.n = n
        self.stateful = stateful
        self._pos, self._loaded = 0, None

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        torch.rand(1)   # e.g. this epoch's shard order
        self._pos, self._loaded = self._loaded or 0, None
        return self._items(list(range(wid, self.n, nw)))

    def _items(self, mine):
        while self._pos < len(mine):
            self._pos += 1
            yield {"x": mine[self._pos - 1], "noise": torch.rand(1)}

    def _state_dict(self):
        return {"pos": self._pos}

    def _load_state_dict(self, state):
        self._loaded = state["pos"]


class KeepsLoadedStream(IterableDataset):
    """Stateful; load_state_dict() keeps the very dict it is given and moves it on."""

    def __init__(self, n=12):
        self.n = n
        self._state, self._fresh = {"pos": 0}, True

    def __iter__(self):
        if self._fresh:
            self._state = {"pos": 0}
        self._fresh = True
        while self._state["pos"] < self.n:
            self._state["pos"] += 1
            yield self._state["pos"] - 1

    def state_dict(self):
        return {"pos": self._state["pos"]}

    def load_state_dict(self, state):
        self._state, self._fresh = state, False


class UnknownLengthStream(CountingStream):
    """A stream that cannot tell its length: __len__ raises NotImplementedError
    (as many streaming datasets' do)."""

    def __len__(self):
        raise NotImplementedError("a stream: length unknown")


class UnsizedSampler(torch.utils.data.Sampler):
    """Indices 0..n-1 in a shuffled order, from a sampler with no usable __len__
    (an endless sampler's raises; `error` is what this one's raises)."""

    def __init__(self, n, error):
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()
        self.error = error

    def __iter__(self):
        return iter(self.order)

    def __len__(self):
        raise self.error("no length")


class _RaisingReplicas(torch.utils.data.SequentialSampler):
    @property
    def num_replicas(self):
        raise RuntimeError("no process group")


class DynamicBatchSampler(torch.utils.data.Sampler):
    """Batches of varying size over 0..19 (no fixed batch size: reading it raises),
    whose sampler's num_replicas raises too."""

    def __init__(self):
        self.sampler = _RaisingReplicas(range(20))

    @property
    def batch_size(self):
        raise NotImplementedError("batches of varying size")

    def __iter__(self):
        return iter([[0, 1, 2], [3, 4], [5, 6, 7, 8], [9], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19]])

    def __len__(self):
        return 6


class LongerThanItsLength(torch.utils.data.SequentialSampler):
    """A sampler that yields `extra` indices more than its `__len__` says: an epoch
    whose batches up to its length were yielded has not ended."""

    def __init__(self, data_source, extra=2):
        super().__init__(data_source)
        self.extra = extra

    def __len__(self):
        return super().__len__() - self.extra


class EndlessSampler(torch.utils.data.Sampler):
    """0, 1, ..., n-1, 0, 1, ... for ever; no __len__ (as an endless sampler has)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        i = 0
        while True:
            yield i % self.n
            i += 1


class GlobalRandomIndices(torch.utils.data.Sampler):
    """n indices, each drawn from the global torch RNG as it is asked for."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            yield int(torch.randint(self.n, ()))


class FailsWhenResumed(torch.utils.data.SequentialSampler):
    """0..n-1; once `armed`, its next iteration raises at its second index."""

    armed = False

    def __iter__(self):
        for k, index in enumerate(super().__iter__()):
            if self.armed and k == 1:
                type(self).armed = False
                raise OSError("the sampler failed")
            yield index
