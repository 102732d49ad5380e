"""The Python half of the batch codec, registered into the C core at import.

The C encoder walks a batch and handles containers, numbers, strings and NumPy
arrays itself. It calls in here only per tensor (to see its bytes as an array, and
back), per deferred stack (the worker's collate stacks straight into the slot), and
for objects it does not know, which are pickled with their tensors and arrays kept
out of band, so that even a custom batch class moves its tensor data without a copy
through pickle.
"""
from __future__ import annotations

import collections
import copyreg
import inspect
import io
import multiprocessing.connection  # noqa: F401  (registers Connection's reducer)
import pickle
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
from torch.utils.data._utils import collate as _tc

from . import _core

# torch dtype -> NumPy dtype of the same width that holds its bytes; dtypes NumPy
# lacks travel as raw integers and are viewed back on arrival.
_NATIVE = {
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.complex64: np.complex64, torch.complex128: np.complex128,
    torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
    torch.int64: np.int64, torch.uint8: np.uint8, torch.bool: np.bool_,
}
_RAW_BY_WIDTH = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_OPTIONAL_NATIVE = {"uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64}
_OPTIONAL_RAW = ("bfloat16", "complex32", "float8_e4m3fn", "float8_e5m2",
                 "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                 # no pickle rebuilds these (torch's own fails): bytes are all they are
                 "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2")

DTYPES: list = []          # code -> torch dtype
_STORAGE: list = []        # code -> NumPy dtype of the bytes
_NEEDS_VIEW: list = []     # code -> whether the tensor must be .view()ed back
CODE: dict = {}            # torch dtype -> code


def _register(tdtype, npdtype, view):
    CODE[tdtype] = len(DTYPES)
    DTYPES.append(tdtype)
    _STORAGE.append(np.dtype(npdtype))
    _NEEDS_VIEW.append(view)


for _t, _n in _NATIVE.items():
    _register(_t, _n, False)
for _name, _n in _OPTIONAL_NATIVE.items():
    if hasattr(torch, _name):
        # from_numpy learned unsigned 16/32/64 only in torch 2.3: view from raw there.
        _register(getattr(torch, _name), _n, True)
for _name in _OPTIONAL_RAW:
    _t = getattr(torch, _name, None)
    if _t is not None:
        _register(_t, _RAW_BY_WIDTH[_t.itemsize], True)


def _viewable_as_bytes(dtype) -> bool:
    """Whether integers of `dtype`'s width can be viewed as `dtype` and back, shape
    kept. Viewed, not made: making a tensor of an experimental dtype (complex32,
    torch 2.14's bcomplex32) warns, and importing fastloader must not."""
    try:
        raw = torch.empty(2, dtype=_RAW_TORCH_BY_WIDTH[dtype.itemsize])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            back = raw.view(dtype).view(raw.dtype)
        return back.dtype == raw.dtype and back.shape == raw.shape
    except (RuntimeError, TypeError, KeyError, NotImplementedError):
        return False


# Any other dtype this torch has (float4_e2m1fn_x2, the one-byte shells uint1-7 and
# int1-7, and those later versions add) travels as its bytes too, where its tensors
# can be viewed as raw integers. Not the quantized ones (torch.q*): a quantized
# tensor is pickled with its scales (see exportable), and making one warns.
# Codes stop at the C encoder's limit: a dtype beyond it is pickled, as unknown
# ones were before.
_RAW_TORCH_BY_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_CODES = 64   # csrc/codec.c refuses a dtype code >= 64 (state.h: code_typenum[64])
for _t in sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str):
    if len(DTYPES) < _MAX_CODES and _t not in CODE and _t.itemsize in _RAW_BY_WIDTH \
            and not str(_t).startswith("torch.q") and _viewable_as_bytes(_t):
        _register(_t, _RAW_BY_WIDTH[_t.itemsize], True)
_TYPENUM = [d.num for d in _STORAGE]   # code -> NumPy typenum of the bytes


def exportable(t) -> bool:
    """Whether the ring can carry this tensor's bytes directly."""
    return (type(t) is torch.Tensor and t.layout is torch.strided and not t.is_nested
            and t.device.type == "cpu" and t.dtype in CODE and not t.is_quantized)


# torch's transport refuses these too (torch.multiprocessing.reductions), with this text
_NON_LEAF = ("Cowardly refusing to serialize non-leaf tensor which requires_grad, since "
             "autograd does not support crossing process boundaries.  If you just want to "
             "transfer the data, call detach() on the tensor before serializing (e.g., "
             "putting it on the queue).")


def export_tensor(t):
    """tensor -> (untyped storage, its data_ptr, its nbytes, dtype code, requires_grad,
    NumPy typenum of its bytes, storage_offset, shape, stride), or None.

    The C encoder copies each storage once and records every tensor as a view of
    it, so tensors that share a storage in the worker share one in the main
    process, with the same offsets and strides (as torch's transport delivers)."""
    if not exportable(t):
        return None
    rg = t.requires_grad
    if rg and not t.is_leaf:
        raise RuntimeError(_NON_LEAF)
    if t.is_conj() or t.is_neg():
        # torch's transport drops these bits and so changes the values; keep the values
        t = t.detach().resolve_conj().resolve_neg()
    code = CODE[t.dtype]
    s = t.untyped_storage()
    return (s, s.data_ptr(), s.nbytes(), code, rg, _TYPENUM[code], t.storage_offset(),
            t.shape, t.stride())


_RAW_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int16): torch.int16,
              np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
              np.dtype(np.uint16): torch.int16, np.dtype(np.uint32): torch.int32,
              np.dtype(np.uint64): torch.int64}


def to_tensor(arr, code, requires_grad, offset=None, size=None, stride=None):
    """ndarray view of a slot -> tensor sharing its memory (the array stays its base).

    With offset/size/stride: `arr` is a tensor whose storage to share, or a uint8
    ndarray over the bytes of a new storage; the result is a view of that storage."""
    if offset is not None:
        if isinstance(arr, torch.Tensor):
            storage = arr.untyped_storage()
        elif arr.size:
            storage = torch.from_numpy(arr).untyped_storage()
        else:
            storage = torch.UntypedStorage(0, device="cpu")   # no bytes: see below
        # on the CPU whatever torch.set_default_device() says: the batch's bytes are
        # here (a tensor made on another default device refuses a CPU storage)
        t = torch.empty(0, dtype=DTYPES[code], device="cpu").set_(storage, offset, size,
                                                                 stride)
        if requires_grad:
            t.requires_grad_(True)
        return t
    if not arr.size:
        # No bytes: a new storage of its own, as torch's transport rebuilds an empty
        # one (plain, so resize_ and out= can grow it), not a view of the slot
        # (NumPy's memory, which cannot). torch's contiguous strides, not NumPy's
        # (which differ by version here): such a tensor is a batch torch.stack made.
        t = torch.empty(arr.shape, dtype=DTYPES[code], device="cpu")
    elif _NEEDS_VIEW[code]:
        if arr.dtype.kind == "u":   # from_numpy may not know unsigned wide ints
            arr = arr.view(np.dtype(f"i{arr.dtype.itemsize}"))
        t = torch.from_numpy(arr).view(DTYPES[code])
    else:
        t = torch.from_numpy(arr)
    if requires_grad:
        t.requires_grad_(True)
    return t


# How a deferred stack fills its slot memory (DeferredStack.how)
STACK = 0    # tensors: a list of same-shape tensors -> torch.stack(out=slot)
COLUMN = 1   # tensors: numbers or same-shape ndarrays -> _core.fill_column (C)
COPY = 2     # tensors: one tensor, already collated -> slot.copy_(it)
GATHER = 3   # tensors: (source tensor, int64 index tensor) -> index_select(out=slot)


class DeferredStack:
    """What the worker-side collate returns instead of torch.stack(batch): the
    encoder sizes the slot from shape and dtype, then fills it straight in place
    (see `how`), so no temporary batch tensor is made."""

    __slots__ = ("tensors", "shape", "code", "how")

    def __init__(self, tensors, shape, code, how=STACK):
        self.tensors = tensors
        self.shape = shape
        self.code = code
        self.how = how


def plan_stack(s):
    return s.shape, _STORAGE[s.code], s.code


def raise_torchs_stack_error(tensors):
    """Raise what torch's own tensor collate raises for `tensors`, if it fails. In
    a worker it sums the tensors' numel() (an AttributeError for anything else),
    then resizes a storage of that size (a shorter tensor fails there) before it
    stacks: other errors, or the same ones in another order, than torch.stack's."""
    _tc.collate_tensor_fn(tensors)


def failed_in_collate(error) -> bool:
    """Whether `error` came from filling a deferred stack: the batch's collate
    failed (as torch's would, in its worker), not the sending of the batch."""
    return getattr(error, "_fastloader_collate", False)


def _mark_collate_error(error):
    try:
        error._fastloader_collate = True
    except AttributeError:   # an exception class with __slots__
        pass


def fill_stack(s, dest):
    how = s.how
    try:
        if how == COLUMN:
            _core.fill_column(s.tensors, dest)
            return
        out = torch.from_numpy(dest.view(np.dtype(f"i{dest.dtype.itemsize}"))
                               if dest.dtype.kind == "u" and _NEEDS_VIEW[s.code] else dest)
        if _NEEDS_VIEW[s.code]:
            out = out.view(DTYPES[s.code])
        if how == STACK:
            torch.stack(s.tensors, 0, out=out)
        elif how == COPY:
            out.copy_(s.tensors)
        else:
            source, index = s.tensors
            torch.index_select(source, 0, index, out=out)
    except Exception as error:
        if how == STACK:
            try:
                raise_torchs_stack_error(s.tensors)
            except Exception as torchs:
                _mark_collate_error(torchs)
                raise torchs from None
        _mark_collate_error(error)
        raise


class BatchContainsItself(RecursionError):
    """Raised while pickling one element of a batch that reaches back to a container
    the codec is still encoding around it: the codec then pickles the batch whole
    (codec.c, fl_plan_build), so that the recursion arrives exact."""


class _OutOfBandPickler(pickle.Pickler):
    """Pickles anything, but leaves plain tensors and arrays to the ring."""

    def __init__(self, file, oob, enclosing=None):
        # torch's queue pickles with ForkingPickler's protocol, pickle's default
        # (an object's __reduce_ex__ sees it; an array pickled in band arrives as
        # a writable copy, as with torch)
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self._oob = oob
        self._seen = {}
        # ids of the containers the codec is encoding around this object (alive
        # while it pickles, so an id cannot be another object's)
        self._enclosing = enclosing

    def persistent_id(self, obj):
        if self._enclosing is not None and id(obj) in self._enclosing:
            raise BatchContainsItself("fastloader: the batch contains itself")
        # DeferredStack: a collated batch inside a container the codec does not
        # know (an OrderedDict, a custom Mapping) is still stacked into the slot.
        # (an array as csrc/codec.c's plain_array() takes it: else it would come
        # back here, to be pickled again)
        if type(obj) is DeferredStack or exportable(obj) or (
                type(obj) is np.ndarray and obj.dtype.kind in "biufc"
                and obj.dtype.isnative and obj.dtype.names is None
                and obj.dtype.metadata is None):
            key = id(obj)
            if key not in self._seen:   # the same tensor twice stays one tensor
                self._seen[key] = len(self._oob)
                self._oob.append(obj)
            return ("fl", self._seen[key])
        return None


class _OutOfBandUnpickler(pickle.Unpickler):
    def __init__(self, file, oob):
        super().__init__(file)
        self._oob = oob

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "fl"
                and 0 <= pid[1] < len(self._oob)):
            raise pickle.UnpicklingError(f"fastloader: bad out-of-band reference {pid!r}")
        return self._oob[pid[1]]


# What ForkingPickler.register() registered, as torch's queue applies it: a user's
# reducers, and multiprocessing's (through which objects that hold a file
# descriptor travel as with torch: the receiver gets a duplicate of the fd from the
# worker; plain pickle copied a socket's refusal, and a Connection's fd *number*,
# which in the main process names some other file, closed by its __del__). Not
# torch's own for its tensors and storages: those travel through the ring.
_TORCHS_REDUCERS = "torch.multiprocessing.reductions"
_forking = {"seen": None, "reducers": {}}


def _forking_reducers():
    """The registrations now, minus torch's; recomputed only when they changed."""
    seen = tuple(ForkingPickler._extra_reducers.items())
    if seen != _forking["seen"]:
        _forking["reducers"] = {t: fn for t, fn in seen
                                if getattr(fn, "__module__", None) != _TORCHS_REDUCERS}
        _forking["seen"] = seen
    return _forking["reducers"]


# A storage in a batch: torch's queue shares it; plain pickle goes through
# torch.save, whose legacy load fails on an UntypedStorage in torch itself. Its
# bytes travel through the ring as a uint8 tensor, and the storage arrives as the
# storage of that tensor (over the slot, as a batch's tensors are).
def _storage_bytes(storage):
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def _rebuild_untyped_storage(data):
    # (`data` of no bytes already has a resizable storage of its own: see to_tensor)
    return data.untyped_storage()


def _rebuild_typed_storage(data, dtype):
    return torch.TypedStorage(wrap_storage=data.untyped_storage(), dtype=dtype, _internal=True)


def _reduce_untyped_storage(storage):
    if storage.device.type != "cpu":
        return storage.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return _rebuild_untyped_storage, (_storage_bytes(storage),)


def _reduce_typed_storage(storage):
    # only its non-deprecated parts: a TypedStorage's public ones warn, and torch
    # pickles one inside every tensor subclass it pickles
    untyped = storage._untyped_storage
    if untyped.device.type != "cpu" or type(storage) is not torch.TypedStorage:
        return storage.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return _rebuild_typed_storage, (_storage_bytes(untyped), storage.dtype)


def _as_is(t):
    return t


_SPARSE_COMPRESSED = {torch.sparse_csr: ("crow_indices", "col_indices"),
                      torch.sparse_bsr: ("crow_indices", "col_indices"),
                      torch.sparse_csc: ("ccol_indices", "row_indices"),
                      torch.sparse_bsc: ("ccol_indices", "row_indices")}


def _reduce_tensor(t):
    """A tensor the ring does not carry (the others never get here: persistent_id
    takes them first). A sparse or a strided-layout nested one is rebuilt as torch's
    transport rebuilds it, by torch's own function (torch.sparse_coo_tensor(),
    torch.sparse_compressed_tensor() or a nested view copied from its buffer, in the
    main process: its warnings, its coalesced flag, its contiguity), its component
    tensors through the ring; anything else pickles as it always has."""
    from torch.multiprocessing import reductions

    # a strided-layout nested tensor (a jagged one is a subclass: not here)
    nested = t.is_nested and hasattr(reductions, "rebuild_nested_tensor")
    if nested or t.layout is torch.sparse_coo or t.layout in _SPARSE_COMPRESSED:
        if t.requires_grad and not t.is_leaf:
            raise RuntimeError(_NON_LEAF)
        if nested:
            return reductions.rebuild_nested_tensor, (
                _as_is, (t.values(),), _as_is, (t._nested_tensor_size(),),
                _as_is, (t._nested_tensor_strides(),),
                _as_is, (t._nested_tensor_storage_offsets(),))
        if t.layout is torch.sparse_coo:
            return reductions.rebuild_sparse_coo_tensor, (
                _as_is, (t._indices(),), _as_is, (t._values(),), t.shape, t.is_coalesced())
        compressed, plain = (getattr(t, name)() for name in _SPARSE_COMPRESSED[t.layout])
        return reductions.rebuild_sparse_compressed_tensor, (
            _as_is, (compressed,), _as_is, (plain,), _as_is, (t.values(),), t.shape, t.layout)
    return t.__reduce_ex__(pickle.DEFAULT_PROTOCOL)


_REDUCERS = {torch.UntypedStorage: _reduce_untyped_storage,
             torch.TypedStorage: _reduce_typed_storage}
# torch's queue reduces these two exact types with reduce_tensor (subclasses keep
# their own __reduce_ex__, there as here); a user's ForkingPickler.register() for
# them still wins, as it would over torch's
_TENSOR_REDUCERS = {torch.Tensor: _reduce_tensor, torch.nn.Parameter: _reduce_tensor}


def dumps(obj, enclosing=None):
    buf = io.BytesIO()
    oob: list = []
    pickler = _OutOfBandPickler(buf, oob, enclosing)
    # copied per batch, so that a copyreg.pickle() or ForkingPickler.register()
    # made since is honoured
    pickler.dispatch_table = {**copyreg.dispatch_table, **_TENSOR_REDUCERS,
                              **_forking_reducers(), **_REDUCERS}
    pickler.dump(obj)
    return buf.getvalue(), oob


def loads(data, oob):
    return _OutOfBandUnpickler(io.BytesIO(data), oob).load()


# What pickle consults to rebuild an instance. A class made by
# collections.namedtuple() defines __getnewargs__ (its fields) and inherits the
# rest, so pickle rebuilds its instances with cls.__new__(cls, *fields) plus their
# __dict__, which the codec does without pickling each instance.
# (__iter__ too: __getnewargs__ is tuple(self), which iterates through it)
_PICKLE_MEMBERS = ("__reduce_ex__", "__reduce__", "__getnewargs_ex__", "__getnewargs__",
                   "__getstate__", "__setstate__", "__iter__")
_PLAIN_NAMEDTUPLE = collections.namedtuple("_PLAIN_NAMEDTUPLE", "field")


def _same_member(mine, plain):
    # each namedtuple class has its own __getnewargs__ function, all of one code
    return mine is plain or (hasattr(mine, "__code__")
                             and getattr(mine, "__code__") is getattr(plain, "__code__", None))


def namedtuple_class(cls):
    """The pickled class, if pickle would rebuild this namedtuple class's instances
    from their fields alone (the C encoder asks once per class, in the worker);
    None if the class pickles its own way (its own reduce, getnewargs, state or
    iteration methods, or a reducer registered for it), and its instances travel
    pickled. The answer is kept for the worker's life: a reducer registered for the
    class after its first instance was sent is not seen."""
    if cls in copyreg.dispatch_table or cls in _forking_reducers():
        return None
    for name in _PICKLE_MEMBERS:
        if not _same_member(inspect.getattr_static(cls, name, None),
                            inspect.getattr_static(_PLAIN_NAMEDTUPLE, name, None)):
            return None
    return dumps(cls)[0]


_core.set_hooks(torch.Tensor, DeferredStack, export_tensor, plan_stack, fill_stack,
                to_tensor, dumps, loads, namedtuple_class)
_core.set_fast_tensor(torch.from_numpy, bytes(_TYPENUM),
                      bytes(code for code in range(len(DTYPES)) if not _NEEDS_VIEW[code]),
                      bytes(code for code, t in enumerate(DTYPES)
                            if t.is_floating_point or t.is_complex))
