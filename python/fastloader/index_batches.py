"""Batches of indices without a Python int per index, where that changes nothing.

The default map-style loader without shuffling batches a SequentialSampler with
a BatchSampler: batch k is the list ``[k*B, ..., k*B+B-1]``. Building that list
costs the main process a new int object per index, a list, and then freeing
them all, only for the channel to read the ints back out (callgrind, batch
64: 15.5k instructions per batch drawn, 3.0k as a range). For exactly that pair this yields ``range``
objects instead, with the same values, at the same moments (the dataset's
length is read on the first batch, as torch's generator does), and the
channel writes them to the task ring as it writes a list: the worker receives
the same list as with torch's sampler. Anything else (a subclass, a patched
``__iter__``, another sampler) keeps torch's own iterator.

A range must never reach user code: `as_list` turns one back into the list
torch's sampler would have produced, for the paths that hand indices over
otherwise (the pickle fallback, a resumed run's replay)."""
from __future__ import annotations

import itertools
from typing import Iterator, Optional

from torch.utils.data import sampler as _sampler_module
from torch.utils.data.sampler import BatchSampler, SequentialSampler


def _is_torchs_own(cls) -> bool:
    """Whether ``cls.__iter__`` is the one torch's sampler.py defines: a patch,
    even one made before fastloader was imported or wrapped with
    functools.wraps, has its code elsewhere."""
    code = getattr(cls.__dict__.get("__iter__"), "__code__", None)
    return (code is not None and code.co_name == "__iter__"
            and code.co_filename == _sampler_module.__file__)


def _reads_batch_size_as_ranges_do() -> bool:
    """Whether torch's BatchSampler.__iter__ is the one `_ranges` follows (it slices
    the sampler's iterator: islice, or zip with drop_last). Those before it (torch
    2.5 and older) fill a list index by index and read ``batch_size`` otherwise: a
    batch_size set to 0 after construction gives empty batches there, not an
    empty epoch; such a torch keeps its own iterator. Asked once _is_torchs_own has
    said the method is torch's function, at each epoch (a patch may come and go)."""
    names = BatchSampler.__dict__["__iter__"].__code__.co_names
    return "islice" in names and "zip" in names


def sequential_batches(index_sampler) -> Optional[Iterator[range]]:
    """An iterator of ``range`` batches equal to ``iter(index_sampler)``'s lists,
    or None when `index_sampler` is not torch's BatchSampler over torch's
    SequentialSampler (exact types, unpatched, of a torch whose BatchSampler reads
    its batch_size as `_ranges` does)."""
    if (type(index_sampler) is not BatchSampler or not _is_torchs_own(BatchSampler)
            or not _reads_batch_size_as_ranges_do()):
        return None
    sampler = index_sampler.sampler
    if type(sampler) is not SequentialSampler or not _is_torchs_own(SequentialSampler):
        return None
    return _ranges(index_sampler, sampler)


def _ranges(index_sampler, sampler) -> Iterator[range]:
    # a generator, like BatchSampler.__iter__: nothing is read before the first batch
    drop_last = index_sampler.drop_last
    n = len(sampler.data_source)
    if drop_last:
        # torch 2.13 reads batch_size once here (a zip over one iterator; of none,
        # an empty epoch, when it is 0 or less)
        size = index_sampler.batch_size
        if type(size) is not int:
            # set to something else after construction (None, a float, a bool):
            # torch's own arithmetic on it, with its result or its error
            yield from (list(batch) for batch in zip(*[iter(range(n))] * size))
            return
        if size < 1:
            return
        for start in range(0, n - n % size, size):
            yield range(start, start + size)
        return
    # without drop_last torch reads batch_size again for every batch, and once
    # more when the sampler has run out (its islice of nothing then ends the epoch)
    start = 0
    while True:
        size = index_sampler.batch_size
        if type(size) is int and size >= 1:
            if start >= n:
                return
            yield range(start, min(start + size, n))
            start += size
            continue
        # torch's islice of what is left, with its result or its error (of 0 items:
        # the end of the epoch; None: the rest in one batch; a float: ValueError)
        batch = [*itertools.islice(iter(range(start, n)), size)]
        if not batch:
            return
        yield batch
        start += len(batch)


def as_list(index):
    """`index` as torch's sampler would have given it (a range becomes a list)."""
    return list(index) if type(index) is range else index
