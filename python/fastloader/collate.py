"""Worker-side collate: torch's default_collate, except that tensors are not
stacked into a fresh shared-memory tensor (as torch does in workers) but deferred,
so the encoder stacks them straight into the ring slot: one copy, not two."""
from __future__ import annotations

import torch
from torch.utils.data._utils import collate as _tc

from ._codec_hooks import CODE, DeferredStack, exportable


def _stack_into_slot(batch, *, collate_fn_map=None):
    elem = batch[0]
    if exportable(elem):   # exportable() excludes nested tensors
        # Like torch's worker-side collate, the output is sized and typed from
        # the first sample and filled by torch.stack(..., out=...), so the other
        # samples are checked by torch.stack itself, with torch's own errors
        # (raised while the encoder fills the slot, and re-raised in the main
        # process like any worker error).
        return DeferredStack(batch, (len(batch), *elem.shape), CODE[elem.dtype])
    # Anything unusual (subclasses, nested or sparse tensors) takes torch's path.
    return _tc.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


_SLOT_COLLATE_MAP = dict(_tc.default_collate_fn_map)
_SLOT_COLLATE_MAP[torch.Tensor] = _stack_into_slot


def slot_collate(batch):
    """Same result as torch.utils.data.default_collate, stacked into the slot."""
    return _tc.collate(batch, collate_fn_map=_SLOT_COLLATE_MAP)


def worker_collate(collate_fn):
    """The collate a worker runs for the loader's collate_fn."""
    return slot_collate if collate_fn is _tc.default_collate else collate_fn
