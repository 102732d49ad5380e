"""CollatedSamples: a batch a dataset's ``__getitems__`` returns already collated.

torch's fetcher passes whatever ``__getitems__`` returns to the collate_fn. Returned
as a CollatedSamples, the batch is both things at once: the collated structure
(what default_collate would make of the samples) and a Sequence of the samples
themselves (item i is the structure indexed at i). torch's own default_collate, or
any custom collate_fn, sees the samples and produces what it always would;
fastloader's worker-side default collate takes the structure and writes its columns
straight into the ring slot, with no Python per sample.
"""
from __future__ import annotations

import collections.abc

import numpy as np
import torch


def _is_namedtuple(obj):
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


_LEAF_TYPES = (torch.Tensor, np.ndarray)


def _leading_length(structure):
    """The batch size all leaves agree on; TypeError/ValueError if they do not.
    Called once per batch: a walk with no per-node strings, and only when it finds
    a problem the walk below that names where it is."""
    stack, n = [structure], None
    while stack:
        node = stack.pop()
        if isinstance(node, _LEAF_TYPES):
            if node.ndim == 0:
                break
            m = len(node)
            if n is None:
                n = m
            elif m != n:
                break
        elif type(node) is dict:
            stack.extend(node.values())
        elif type(node) in (tuple, list) or _is_namedtuple(node):
            stack.extend(node)
        else:
            break
    else:
        if n is not None:
            return n
    return _explain(structure)


def _explain(structure, path="batch"):
    """Raise the error that says what is wrong with `structure`, and where."""
    lengths = []

    def walk(node, where):
        if isinstance(node, (torch.Tensor, np.ndarray)):
            if node.ndim == 0:
                raise ValueError(f"CollatedSamples: {where} is 0-dimensional; every tensor "
                                 "or array needs the batch as its first dimension")
            lengths.append((len(node), where))
        elif type(node) is dict:
            for key, value in node.items():
                walk(value, f"{where}[{key!r}]")
        elif type(node) in (tuple, list) or _is_namedtuple(node):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")
        else:
            raise TypeError(f"CollatedSamples: {where} is a {type(node).__qualname__}; "
                            "expected a tensor, a NumPy array, or a dict / tuple / list / "
                            "namedtuple of them")

    walk(structure, path)
    if not lengths:
        raise ValueError("CollatedSamples: the batch holds no tensor or array")
    n, first = lengths[0]
    for m, where in lengths[1:]:
        if m != n:
            raise ValueError(f"CollatedSamples: {where} has {m} rows but {first} has {n}")
    return n


def _sample(node, i):
    if isinstance(node, (torch.Tensor, np.ndarray)):
        return node[i]
    if type(node) is dict:
        return {key: _sample(value, i) for key, value in node.items()}
    if _is_namedtuple(node):
        return type(node)(*(_sample(value, i) for value in node))
    return type(node)(_sample(value, i) for value in node)   # tuple or list


class CollatedSamples(collections.abc.Sequence):
    """A batch of samples held in collated form.

    ``CollatedSamples(batch)``: `batch` is what torch's default_collate would return
    for the samples: a tensor or NumPy array whose first dimension is the batch, or
    a dict / tuple / list / namedtuple of them (nested as deep as needed). As a
    Sequence it yields the samples: ``len()`` is the batch size and item ``i`` is
    the structure indexed at ``i`` (tuples stay tuples, as a dataset's samples
    would be), so any collate_fn sees ordinary samples. Return it from a dataset's
    ``__getitems__(indices)``; fastloader's default collate then copies the columns
    into shared memory directly.
    """

    __slots__ = ("_batch", "_len")

    def __init__(self, batch):
        if isinstance(batch, (torch.Tensor, np.ndarray)):
            # torch's default_collate hands a batch of tensors to torch.stack, which
            # takes only a real list or tuple: put the tensor in a tuple instead
            raise TypeError("CollatedSamples: wrap a lone tensor or array in a tuple, "
                            "e.g. CollatedSamples((features,))")
        self._len = _leading_length(batch)
        self._batch = batch

    @property
    def batch(self):
        """The collated structure, as given."""
        return self._batch

    def __len__(self):
        return self._len

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._len))]
        i = index.__index__()
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"CollatedSamples index {index} out of range for {self._len} samples")
        return _sample(self._batch, i)

    def __repr__(self):
        return f"CollatedSamples({self._len} samples)"
