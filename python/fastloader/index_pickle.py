"""Pickling a batch's indices for a worker, when they are not plain ints.

Plain pickle writes a tensor with its whole storage, through torch's own
serialisation (75 us for a 0-d tensor). A sampler that yields the elements of one
index tensor (``SubsetRandomSampler(torch.nonzero(mask)[:, 0])``,
``iter(torch.randperm(n))``, ``torch.randperm(n).split(64)`` as a batch sampler)
yields views of one large storage, and 64 such indices pickled 64 copies of it:
51 MB for a batch of 100k-element indices, more than the task ring takes. torch's
index queue moves that storage into shared memory once and sends a handle.

Here a tensor is pickled as the bytes of the span of its storage that its
elements use (a NumPy array of them, which pickles in a few us), and rebuilt in
the worker as a view of them with the same dtype, shape, strides and bytes. What
differs from torch's transport is the storage: each index has its own, holding only
the bytes it reaches (its ``storage_offset()`` and storage size differ, as for a
small view of a huge storage in a batch: README, "What differs"), not shared with
the other indices nor ``is_shared()``. Every other object is pickled as pickle
pickles it."""
from __future__ import annotations

import copyreg
import io
import pickle

import torch

from ._codec_hooks import exportable


def rebuild_view(span, dtype, size, stride):
    """In the worker: the index tensor, a view of the bytes of its storage's span."""
    return torch.from_numpy(span).view(dtype).as_strided(size, stride)


# named tensors (torch before 2.13): pickled as pickle pickles them, names and all
_HAS_NAMES = getattr(torch.Tensor, "has_names", None)


def _span_of(t):
    """The bytes of t's storage that t's elements reach, as a 1-D uint8 tensor, or
    None when t is not an ordinary CPU tensor."""
    # exportable(): the tensors whose bytes the ring carries (plain, strided, not
    # nested, on the CPU); these others keep pickle's own reduction
    if (not exportable(t) or t.requires_grad or t.is_conj() or t.is_neg() or t.__dict__
            or (_HAS_NAMES is not None and t.has_names())):
        return None
    if t.numel() == 0:
        first, count = 0, 0
    else:
        first = t.storage_offset()
        count = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    size = t.element_size()
    # made as bytes: a tensor of t's own dtype may warn (complex32 is "experimental")
    # (on the CPU, as t is, whatever torch.set_default_device() says)
    return torch.empty(0, dtype=torch.uint8, device="cpu").set_(
        t.untyped_storage(), first * size, (count * size,), (1,))


def _reduce_tensor(t):
    span = _span_of(t)
    if span is None:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    # as NumPy bytes, which pickle as bytes (any dtype, NumPy's or not)
    return rebuild_view, (span.numpy(), t.dtype, tuple(t.shape), t.stride())


def dumps_indices(index) -> bytes:
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    # A dispatch table, not reducer_override: the pickler looks it up by exact type
    # (a subclass keeps its own reduction, its class and state) in C, where
    # reducer_override is a Python call per object (1 us per NumPy int index).
    # Copied at each call, so that copyreg registrations made since still count.
    table = copyreg.dispatch_table.copy()
    table[torch.Tensor] = _reduce_tensor
    pickler.dispatch_table = table
    pickler.dump(index)
    return out.getvalue()
