"""Worker-side collate: torch's default_collate, except that nothing is stacked into
a fresh tensor (as torch does in workers): each column is deferred, and the encoder
fills it straight into the ring slot. One copy, not two, and for numbers and NumPy
arrays no torch call at all (a C fill, csrc/collate_fill.c)."""
from __future__ import annotations

import collections
import collections.abc

import numpy as np
import torch
from torch.utils.data._utils import collate as _tc

from . import _core
from ._codec_hooks import (CODE, COLUMN, COPY, STACK, DeferredStack, exportable,
                           raise_torchs_stack_error)
from .collated import CollatedSamples, _is_namedtuple

# _core.column_kind() results (csrc/collate_fill.h)
_COL_OTHER, _COL_INT64, _COL_FLOAT64, _COL_BOOL, _COL_ARRAY, _COL_ARRAY_READONLY = range(6)
_NUMBER_CODE = {_COL_INT64: CODE[torch.int64], _COL_FLOAT64: CODE[torch.float64],
                _COL_BOOL: CODE[torch.bool]}
# NumPy dtype -> dtype code of the tensor default_collate makes of it. Only dtypes
# whose every route through default_collate is known (a 1-D column of uint32/uint64
# goes through NumPy scalars, which torch.as_tensor refuses) are listed; the rest
# take torch's path and get torch's result or error.
_ARRAY_CODE = {np.dtype(n): CODE[t] for n, t in (
    (np.bool_, torch.bool), (np.int8, torch.int8), (np.uint8, torch.uint8),
    (np.int16, torch.int16), (np.int32, torch.int32), (np.int64, torch.int64),
    (np.float16, torch.float16), (np.float32, torch.float32), (np.float64, torch.float64),
    (np.complex64, torch.complex64), (np.complex128, torch.complex128))}


# The stacks deferred so far in the batch slot_collate is collating, in the order
# torch would have run them. torch.stack raises where it stands in the walk, a
# deferred one only once the slot is filled: when the walk fails after a deferred
# stack that will fail too, torch would have raised the stack's error first, and
# so does slot_collate. A worker collates one batch at a time, on one thread.
_deferred = []


_PLAIN_TENSOR = {torch.Tensor}


def _stack_into_slot(batch, *, collate_fn_map=None):
    elem = batch[0]
    # Every sample a plain tensor (exportable() also excludes nested tensors): a
    # subclass anywhere makes torch.stack return the subclass, through its
    # __torch_function__, and torch's path below gives that.
    if exportable(elem) and set(map(type, batch)) == _PLAIN_TENSOR:
        # Like torch's worker-side collate, the output is sized and typed from
        # the first sample and filled by torch.stack(..., out=...), so the other
        # samples are checked by torch.stack itself, with torch's own errors
        # (raised while the encoder fills the slot, and re-raised in the main
        # process like any worker error).
        stack = DeferredStack(batch, (len(batch), *elem.shape), CODE[elem.dtype])
        _deferred.append(stack)
        return stack
    # Anything unusual (subclasses, nested or sparse tensors) takes torch's path.
    return _tc.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


# Whether this process has let torch warn about an array that is not writable.
_readonly_warned = False


def _warn_as_torch_about_readonly(arrays):
    """torch.as_tensor, called by torch's collate on every array, warns once per
    process about one that is not writable. The C fill never calls it, so torch's
    own function is run on the first such array (its warning, its text and where it
    points); the column is still filled by C."""
    global _readonly_warned
    first = next((a for a in arrays if not a.flags.writeable), None)
    if first is None:   # another thread made it writable since
        return
    # torch would have stopped at a failing stack before it reached this column
    _raise_first_stack_error()
    # before the call: torch's once is spent even if a filter makes it an error
    _readonly_warned = True
    # a map that drops the tensor: torch's tensor function would stack it into a
    # new shared-memory segment, in a worker
    _tc.collate_numpy_array_fn([first], collate_fn_map={torch.Tensor: _drop})


def _drop(batch, *, collate_fn_map=None):
    return None


# the batches a column can arrive as from the walk (a list of the samples, a
# tuple or list of a transposed column) or from __getitems__
_FILLED_CONTAINERS = (list, tuple, CollatedSamples)


def _column_into_slot(torch_fn):
    """Numbers and same-shape arrays: filled by C when the result is certain, else
    torch's own function for that type (its result, its errors)."""
    def collate_column(batch, *, collate_fn_map=None):
        if type(batch) not in _FILLED_CONTAINERS:
            # torch.tensor() is picky about what holds the numbers (it refuses a
            # bytes object, which default_collate would otherwise stack as ints):
            # anything but a list or tuple gets torch's function, result or error
            return torch_fn(batch, collate_fn_map=collate_fn_map)
        kind = _core.column_kind(batch)
        if kind == _COL_ARRAY_READONLY:
            if not _readonly_warned:
                _warn_as_torch_about_readonly(batch)
            kind = _COL_ARRAY
        if kind == _COL_ARRAY:
            elem = batch[0]
            code = _ARRAY_CODE.get(elem.dtype)
            if code is not None:
                return DeferredStack(batch, (len(batch), *elem.shape), code, COLUMN)
        elif kind != _COL_OTHER:
            return DeferredStack(batch, (len(batch),), _NUMBER_CODE[kind], COLUMN)
        return torch_fn(batch, collate_fn_map=collate_fn_map)
    collate_column.__name__ = f"{torch_fn.__name__}_into_slot"
    return collate_column


# What the slot collate puts in place of torch's own function for a type, where the
# map still holds that function: a user's registration in torch's
# default_collate_fn_map (a new type, or a type's function replaced) is honoured
# as torch's default_collate honours it, at the time of each call.
_REPLACEMENTS = {
    torch.Tensor: (_tc.collate_tensor_fn, lambda fn: _stack_into_slot),
    np.ndarray: (getattr(_tc, "collate_numpy_array_fn", None), _column_into_slot),
    float: (getattr(_tc, "collate_float_fn", None), _column_into_slot),
    int: (getattr(_tc, "collate_int_fn", None), _column_into_slot),
}


def _items(torch_map):
    return tuple(torch_map.items())   # in order: collate()'s isinstance loop follows it


# torch's map as torch made it, if nothing but torch's own functions was in it when
# fastloader was imported: what CollatedSamples and the TensorDataset gather assume
_TORCH_DEFAULT = (_items(_tc.default_collate_fn_map)
                  if all(getattr(fn, "__module__", None) == _tc.__name__
                         for fn in _tc.default_collate_fn_map.values()) else None)


def _with_torchs_map(fn):
    """A function of torch's map, called as torch's default_collate calls it: with
    torch's map (a function that collates what it holds gets real tensors, as
    with torch, not the slot collate's deferred ones)."""
    def collate_with_torchs_map(batch, *, collate_fn_map=None):
        return fn(batch, collate_fn_map=_tc.default_collate_fn_map)
    return collate_with_torchs_map


def _claims(key, instance):
    try:
        return isinstance(instance, key)
    except TypeError:   # a key isinstance() refuses (a parameterized generic)
        return True


class _SlotMap:
    """The collate map of the slot collate, rebuilt whenever torch's changed."""

    __slots__ = ("seen", "fns", "plain", "torch_default", "_claimed")

    def __init__(self, torch_map):
        self.seen = _items(torch_map)
        torchs_tensors = torch_map.get(torch.Tensor) is _tc.collate_tensor_fn
        fns = {}
        for type_, fn in torch_map.items():
            torch_fn, replace = _REPLACEMENTS.get(type_, (None, None))
            # torch collates an array column as the column of its tensors, through
            # the map's tensor function: the C fill is that only if it is torch's
            if (torch_fn is not None and fn is torch_fn
                    and (type_ is not np.ndarray or torchs_tensors)):
                fns[type_] = replace(fn)
            else:
                fns[type_] = _with_torchs_map(fn)
        self.fns = fns
        # the map is torch's own: a batch that came collated, or a gathered
        # TensorDataset batch, is then what default_collate would make of the
        # samples (any other function could claim their rows or leaves)
        self.torch_default = self.seen == _TORCH_DEFAULT
        # transpose_tuples() and transpose_dicts() stand in for collate()'s tuple
        # and mapping branches only where no function of the map claims a tuple
        # or a dict first (collate() looks the map up before its branches)
        self.plain = not any(_claims(key, ()) or _claims(key, {}) for key in fns)
        self._claimed = {}

    def claims(self, elem):
        """Whether a function of the map collates elements of elem's type (by the
        type: collate() tries the exact type, then isinstance() in order)."""
        cls = type(elem)
        claimed = self._claimed.get(cls)
        if claimed is None:
            claimed = self._claimed[cls] = cls in self.fns or any(
                _claims(key, elem) for key in self.fns)
        return claimed


_slot_map = _SlotMap(_tc.default_collate_fn_map)


def current_slot_map() -> _SlotMap:
    """The slot collate's map for torch's default_collate_fn_map as it is now."""
    global _slot_map
    if _slot_map.seen != _items(_tc.default_collate_fn_map):
        _slot_map = _SlotMap(_tc.default_collate_fn_map)
    return _slot_map


# -- a batch that came collated (CollatedSamples) ---------------------------------
def _collated_leaf(node):
    """A tensor or array of the collated structure -> its deferred copy, or None
    when default_collate over its rows might not give back exactly these values."""
    if type(node) is np.ndarray:
        code = _ARRAY_CODE.get(node.dtype)
        if code is None or not node.dtype.isnative:
            return None
        # torch collates the rows: arrays (which torch.as_tensor warns about) if
        # the node has 2 dimensions or more, NumPy scalars otherwise
        if node.ndim >= 2 and len(node) and not _readonly_warned and not node.flags.writeable:
            _warn_as_torch_about_readonly([node[0]])
        # one "sample" the size of the whole column: fill_column copies it, strided or not
        return DeferredStack([node], node.shape, code, COLUMN)
    if (exportable(node) and not node.requires_grad and not node.is_conj()
            and not node.is_neg()):
        return DeferredStack(node, tuple(node.shape), CODE[node.dtype], COPY)
    return None


# -- containers whose own code would see the deferred stacks -----------------------
# torch's collate() builds a sample's containers around the collated values: a
# mapping by copy() and update() or by calling its type, a namedtuple by calling
# its type, another mutable sequence by item assignment. The slot collate's values
# are placeholders (DeferredStack) until the encoder fills them, so a container
# whose constructor or __setitem__ looks at its values (casts, validates, takes a
# len()) would see those. Only these run no code of the sample's own:
_PLAIN_MAPPINGS = (dict, collections.OrderedDict, collections.defaultdict)


def _is_plain_namedtuple_type(cls):
    """A namedtuple class (collections.namedtuple, typing.NamedTuple, or a subclass)
    whose construction is the generated __new__ alone."""
    new = cls.__new__
    return (getattr(new, "__globals__", {}).get("_tuple_new") is tuple.__new__
            and cls.__init__ is object.__init__)


def _builds_plain_containers(elem, slot_map, depth=0):
    """Whether collate() with the map `slot_map`, over samples shaped like `elem` (it
    follows the first sample, as collate() does), builds only containers that run
    no code of their own on the collated values. It follows collate()'s order: a
    function of the map first (what it returns is its own: ours, or a user's called
    with torch's map), then the mapping, namedtuple and sequence branches."""
    if depth > 64:   # a sample that contains itself: collate()'s own recursion error
        return False
    if slot_map.claims(elem):
        return True
    cls = type(elem)
    if cls is tuple or cls is list:   # a tuple is collated as a list
        values = elem
    elif cls in _PLAIN_MAPPINGS:
        values = elem.values()
    elif isinstance(elem, collections.abc.Mapping):
        return False
    elif isinstance(elem, tuple) and hasattr(elem, "_fields"):
        if not _is_plain_namedtuple_type(cls):
            return False
        values = elem
    elif not isinstance(elem, collections.abc.Sequence):
        return True   # collate() raises its TypeError for it, with any map
    elif isinstance(elem, tuple):
        values = elem
    else:
        return False
    for value in values:
        if not _builds_plain_containers(value, slot_map, depth + 1):
            return False
    return True


def _collated_structure(node):
    """The structure default_collate returns for the rows of `node` (tuples become
    lists, as torch makes them), with deferred copies as leaves; None if any leaf
    needs torch's path."""
    if type(node) is dict:
        out = {}
        for key, value in node.items():
            out[key] = _collated_structure(value)
            if out[key] is None:
                return None
        return out
    if type(node) in (tuple, list) or (_is_namedtuple(node)
                                       and _is_plain_namedtuple_type(type(node))):
        parts = [_collated_structure(value) for value in node]
        if any(part is None for part in parts):
            return None
        return type(node)(*parts) if _is_namedtuple(node) else parts
    return _collated_leaf(node)


def slot_collate(batch):
    """Same result as torch.utils.data.default_collate, filled into the slot."""
    try:
        return _slot_collate(batch)
    except Exception:
        _raise_first_stack_error()
        raise
    finally:
        _deferred.clear()   # they keep the samples alive


def _raise_first_stack_error():
    """Raise the error of the first deferred stack that fails, if one does: torch
    would have stopped there, before the error slot_collate's walk ran into."""
    for stack in _deferred:
        if stack.how != STACK:
            continue
        try:
            raise_torchs_stack_error(stack.tensors)
        except Exception as error:
            raise error from None


def _slot_collate(batch):
    slot_map = current_slot_map()
    if type(batch) is CollatedSamples and len(batch) and slot_map.torch_default:
        structure = _collated_structure(batch.batch)
        if structure is not None:
            return structure
        # a leaf torch must handle (requires_grad, a subclass...): the samples
    fns = slot_map.fns
    if ((type(batch) in (list, tuple, CollatedSamples)
         or isinstance(batch, collections.abc.Sequence)) and len(batch)
            and not _builds_plain_containers(batch[0], slot_map)):
        # the containers would see placeholders: torch's own collate, real tensors
        return _tc.collate(batch, collate_fn_map=_tc.default_collate_fn_map)
    if slot_map.plain:
        # Plain tuples of one length (most datasets' samples): torch's collate()
        # would check the lengths, transpose and return a list of collated
        # columns; the first two in C. Anything else, or an error, is torch's
        # own path.
        columns = _core.transpose_tuples(batch)
        if columns is not None:
            return [_tc.collate(column, collate_fn_map=fns) for column in columns]
        # Plain dicts with str keys: torch's collate() copies the first sample
        # and sets each of its keys to the collated [d[key] for d in batch]; the
        # columns are gathered in C.
        parts = _core.transpose_dicts(batch)
        if parts is not None:
            keys, columns = parts
            try:
                return dict(zip(keys, [_tc.collate(column, collate_fn_map=fns)
                                       for column in columns]))
            except TypeError:
                _raise_first_stack_error()
                # torch's retry after a TypeError, once: a plain dict of the
                # columns gathered afresh
                return {key: _tc.collate([d[key] for d in batch], collate_fn_map=fns)
                        for key in batch[0]}
    return _tc.collate(batch, collate_fn_map=fns)


def _is_torchs_default_collate(fn) -> bool:
    """Whether `fn` is torch's own default_collate. Not `fn is
    _tc.default_collate`: a program (or library) that replaced that module
    attribute before building its loader passes its replacement as the loader's
    collate_fn, which must then run (it was swapped for the slot collate)."""
    code = getattr(fn, "__code__", None)
    return (code is not None and code.co_name == "default_collate"
            and code.co_filename == _tc.__file__)


def worker_collate(collate_fn):
    """The collate a worker runs for the loader's collate_fn."""
    return slot_collate if _is_torchs_default_collate(collate_fn) else collate_fn
