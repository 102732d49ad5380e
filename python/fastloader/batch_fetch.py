"""Vectorised batch fetch for datasets whose batch fastloader can gather in one go.

With torch's default_collate, a batch of ``torch.utils.data.TensorDataset`` is, for
each of its tensors, ``torch.stack([t[i] for i in indices])``: the same values as
``torch.index_select(t, 0, indices)``. A worker serving such a dataset gathers each
tensor straight into the ring slot instead of indexing it once per sample. Only
cases where the result is provably torch's take this path (exact TensorDataset,
indices that are in-range ints, plain CPU tensors); everything else, including every
error, goes through torch's fetcher.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from torch.utils.data import TensorDataset

from . import _core
from ._codec_hooks import CODE, GATHER, DeferredStack, exportable
from .collate import current_slot_map, slot_collate

_COL_INT64 = 1   # _core.column_kind(): exact ints that fit int64
# dtypes index_select implements on CPU (not, e.g., the unsigned 16/32/64-bit ones)
_GATHER_DTYPES = frozenset((
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.complex128))


def _gatherable(t):
    return (exportable(t) and t.dtype in _GATHER_DTYPES and t.dim() >= 1 and not t.requires_grad and not t.is_conj()
            and not t.is_neg())


def _torchs_own(fn) -> bool:
    """Whether `fn` is torch's own code: compiled from TensorDataset's module, and
    not a wrapper made with functools.wraps (which copies torch's __module__)."""
    module = sys.modules.get(TensorDataset.__module__)
    code = getattr(fn, "__code__", None)
    return (code is not None and module is not None
            and code.co_filename == getattr(module, "__file__", None)
            and not hasattr(fn, "__wrapped__"))


# torch's own, unless something replaced it before fastloader was imported
_TORCH_GETITEM = TensorDataset.__dict__["__getitem__"]
_GETITEM_IS_TORCHS = _torchs_own(_TORCH_GETITEM)


def _samples_are_torchs(dataset):
    """Whether torch's fetcher would call TensorDataset's own __getitem__: not where
    a user patched the class (an augmentation), nor where the dataset has a
    __getitems__, which torch's fetcher calls instead."""
    return (_GETITEM_IS_TORCHS and TensorDataset.__dict__.get("__getitem__") is _TORCH_GETITEM
            and not getattr(dataset, "__getitems__", None))


def _tensor_dataset_batch(dataset, indices):
    """The collated batch of an exact TensorDataset, or None for torch's path."""
    if type(indices) is not list or not indices or _core.column_kind(indices) != _COL_INT64:
        return None
    if not _samples_are_torchs(dataset):
        return None
    if not current_slot_map().torch_default:   # a user's function may claim rows or leaves
        return None
    tensors = dataset.tensors
    if not tensors or not all(_gatherable(t) for t in tensors):
        return None
    index = np.array(indices, dtype=np.int64)
    length = len(tensors[0])
    # negative or out-of-range indices: torch indexes (or raises) its own way
    if index.min() < 0 or index.max() >= length or any(len(t) < length for t in tensors):
        return None
    index = torch.from_numpy(index)
    n = len(indices)
    # default_collate turns each sample's tuple into a list of stacked tensors
    return [DeferredStack((t, index), (n, *t.shape[1:]), CODE[t.dtype], GATHER)
            for t in tensors]


class BatchFetcher:
    """torch's fetcher, with a vectorised fetch in front for the datasets above."""

    def __init__(self, fetcher, fast):
        self.fetcher = fetcher
        self._fast = fast

    def fetch(self, index):
        batch = self._fast(index)
        return self.fetcher.fetch(index) if batch is None else batch

    def __getattr__(self, name):   # dataset_iter, ended ... as torch's fetcher has them
        return getattr(self.fetcher, name)


def with_batch_fetch(fetcher, dataset, auto_collation, collate_fn):
    """`fetcher`, or a BatchFetcher over it when the dataset allows a vectorised fetch."""
    if not auto_collation or collate_fn is not slot_collate:
        return fetcher
    if type(dataset) is TensorDataset:
        return BatchFetcher(fetcher, lambda index: _tensor_dataset_batch(dataset, index))
    return fetcher
