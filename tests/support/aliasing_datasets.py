"""Batches whose tensors and arrays alias each other, for tests/transport/test_aliasing.py.

Module level, so that spawned workers find them as ``tests.support.aliasing_datasets.<name>``.
The loaders run with batch_size=1 and ``case_collate``: sample i builds the batch of
case CASES[i], deterministically from i, so torch's loader and fastloader's get the
same objects to carry and every difference comes from the transport.
"""
import collections
import warnings

import numpy as np
import torch
from torch.utils.data import Dataset


Pair = collections.namedtuple("Pair", "first rest")


class Holder:
    """A class the codec does not know: pickled (with its tensors out of band)."""

    def __init__(self, t, tag):
        self.t = t
        self.tag = tag


def same_tensor_twice(i):
    t = torch.arange(6, dtype=torch.float32) + i
    u = torch.arange(3)
    return {"a": t, "b": t, "tup": (t, u, t), "lst": [u, t, u], "d": {"x": t}}


def labels_is_input_ids(i):
    ids = torch.arange(10, dtype=torch.int64).reshape(2, 5) + i
    return {"input_ids": ids, "attention_mask": torch.ones(2, 5, dtype=torch.int64),
            "labels": ids}


def view_and_base(i):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + i
    return {"base": base, "row": base[1], "block": base[1:3, 2:5], "flat": base.view(-1),
            "empty": base[2:2], "col": base[:, 3]}


def views_without_base(i):
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10) + i
    return [base[2:4, 1:7], base[3:, ::3]]


def slices_with_offsets(i):
    big = torch.arange(1000, dtype=torch.int64) + i
    other = torch.arange(500, dtype=torch.int16)
    return (big[5:7], big[100:200:3], other[7:9])


def non_contiguous(i):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) + i
    y = torch.arange(24, dtype=torch.int32).reshape(2, 3, 4)
    return {"t": x.t(), "step": torch.arange(10.0)[::2], "perm": y.permute(2, 0, 1),
            "narrow": y[:, 1:, ::2]}


def expanded(i):
    return {"row": torch.ones(3).expand(4, 3), "scalar": torch.tensor(float(i)).expand(5),
            "mid": torch.arange(6.0).reshape(2, 1, 3).expand(2, 4, 3)}


def dtype_views(i):
    f = torch.arange(16, dtype=torch.float32).reshape(4, 4) + i
    return {"f": f, "i32": f.view(torch.int32), "u8": f.view(torch.uint8)[1:3],
            "bf16": f.view(torch.bfloat16), "i64_t": f.view(torch.int64).t()}


def fortran_arrays(i):
    a = np.arange(12.0).reshape(3, 4) + i
    return {"f": np.asfortranarray(a), "f3": np.asfortranarray(np.arange(24).reshape(2, 3, 4)),
            "c": a, "tr": a.T, "f_slice": np.asfortranarray(a)[:, 1:3],
            "one_d": np.arange(5.0)}


def numpy_views(i):
    a = np.arange(20.0).reshape(4, 5) + i
    return {"a": a, "rows": a[1:], "cols": a[:, ::2], "again": a, "bcast":
            np.broadcast_to(np.arange(3.0), (4, 3)), "pair": (a[2], a[2])}


def requires_grad(i):
    w = torch.arange(3.0).requires_grad_(True)
    return {"w": w, "w_detached": w.detach(), "w_view": w.detach()[1:],
            "p": torch.nn.Parameter(torch.ones(2) * i)}


def containers_twice(i):
    lst = [torch.tensor([i]), "s"]
    dct = {"k": torch.tensor([2 * i])}
    return {"l1": lst, "l2": lst, "d": (dct, dct), "n": [np.int64(i), np.int64(i)]}


def pickled_object_sharing(i):
    t = torch.arange(4.0) + i
    h = Holder(t, "tag")
    return {"h": h, "t": t, "h_again": h, "view": t[1:3]}


def nested_tensors(i):
    parts = [torch.arange(3.0) + i, torch.arange(5.0)]
    grids = [torch.arange(6.0).reshape(2, 3) + i, torch.arange(3.0).reshape(1, 3)]
    # torch's transport copies a strided one from its buffer: a transposed one
    # arrives contiguous
    return {"jagged": torch.nested.nested_tensor(parts, layout=torch.jagged),
            "strided": torch.nested.nested_tensor(parts),
            "transposed": torch.nested.nested_tensor(grids).transpose(1, 2)}


def storages(i):
    # storages themselves in a batch: untyped, typed, and one a tensor also uses
    t = torch.arange(4.0) + i
    other = torch.arange(3) + i
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # TypedStorage is deprecated
        typed = other.storage()
    return {"t": t, "storage_of_t": t.untyped_storage(), "typed": typed,
            "own": torch.tensor([i, 7], dtype=torch.int16).untyped_storage()}


def containers_holding_themselves(t, view):
    """A list, a dict and a tuple (through a list) that each hold themselves, with
    `t` and `view` inside the cycles (pickle keeps such a recursion exact). Shared
    with the codec's own test (tests/transport/test_codec.py)."""
    loop = [t, "x"]
    loop.append(loop)
    table = {"view": view}
    table["self"] = table
    holder = []
    pair = (holder, t)
    holder.append(pair)
    return {"loop": loop, "table": table, "pair": pair, "t": t}


def zero_size(i):
    # torch's transport rebuilds a storage of no bytes as a new, resizable one
    # (rebuild_storage_empty): the batch's empty tensors can be resized or used as out=
    z = torch.zeros(0, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # TypedStorage is deprecated
        typed = torch.empty(0, dtype=torch.int16).storage()
    return {"e": torch.empty(0, dtype=torch.int64), "z": z, "z_again": z, "z_view": z.view(3, 0),
            "grad": torch.zeros(0, requires_grad=True), "full": torch.ones(2) * i,
            "storage": torch.UntypedStorage(0), "typed": typed, "storage_of_z": z.untyped_storage(),
            "collated": torch.stack([torch.zeros(0, 2), torch.zeros(0, 2)])}


def odd_strides(i):
    # contiguous but for the strides of size-1 dims (or of no elements at all):
    # torch's transport keeps every stride as it was
    col = torch.arange(3.0).reshape(3, 1) + i
    return {"row": col.t(), "mid": torch.ones(2, 1, 3).transpose(0, 1).contiguous().transpose(0, 1),
            "unit": torch.ones(1, 1).as_strided((1, 1), (5, 7)),
            "gray_channels_last": torch.empty(2, 1, 4, 4, memory_format=torch.channels_last).fill_(i),
            "empty_t": torch.zeros(2, 0).t(), "np_empty": torch.from_numpy(np.zeros((2, 0)))}


def shared_strings(i):
    """str and bytes objects met more than once (pickle memoizes both: one object each
    in torch's main process), beside equal strings that are other objects (two there)."""
    label = "".join(["cl", "ass-", str(i)])    # made at run time: not interned
    again = "".join(["cl", "ass-", str(i)])    # equal to label, another object
    raw = bytes(range(i, i + 8))
    surrogate = "".join(["\ud800", str(i)])   # not UTF-8: travels pickled
    return {"labels": [label, label, again], "raw": (raw, raw, bytes(bytearray(raw))),
            label: label, "deep": {"x": [label, (raw,)]}, "sur": [surrogate, surrogate],
            "tensor_too": (torch.ones(2) * i, label)}


def recursive(i):
    # the cycles through a list, a dict and a tuple, one of them twice in the batch
    t = torch.arange(4.0) + i
    batch = containers_holding_themselves(t, t[1:])
    batch["again"] = batch["loop"]
    return batch


def storages_over_one_memory(i):
    # torch.from_numpy() twice on one array: two storage objects over the same
    # bytes (and a third over part of them). torch's transport moves each storage
    # on its own, so they arrive as three, and an in-place change to one is not
    # seen in the others (fastloader took them for one storage, by address)
    arr = np.arange(4.0) + i
    return {"image": torch.from_numpy(arr), "orig": torch.from_numpy(arr),
            "tail": torch.from_numpy(arr[1:]), "image_view": torch.from_numpy(arr)[::2]}


CASES = [
    same_tensor_twice, labels_is_input_ids, view_and_base, views_without_base,
    slices_with_offsets, non_contiguous, expanded, dtype_views, fortran_arrays,
    numpy_views, requires_grad, containers_twice, pickled_object_sharing, nested_tensors,
    storages, zero_size, odd_strides, shared_strings, recursive, storages_over_one_memory,
]
CASE_NAMES = [c.__name__ for c in CASES]


class IndexDataset(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


ENUM_METADATA = {"enum": {"cat": 0, "dog": 1}}   # what h5py.enum_dtype() puts there
ENUM = np.dtype("u1", metadata=ENUM_METADATA)


def enum_arrays_collate(indices):
    """A batch of NumPy arrays whose dtype carries metadata, one of them twice."""
    a = np.array([i % 2 for i in indices], dtype=ENUM)
    return [a, np.array(indices, dtype=np.dtype("i8", metadata={"unit": "id"})), a[::-1]]


def case_collate(indices):
    (i,) = indices
    return CASES[i](i)


def non_leaf_collate(indices):
    return {"x": torch.ones(3, requires_grad=True) * 2}


def _boom():
    raise ValueError("boom")


class FailsToUnpickle:
    """Pickles fine in the worker; rebuilding it in the main process raises."""

    def __reduce__(self):
        return (_boom, ())


def unpickling_fails_collate(indices):
    return {"x": torch.ones(2), "bad": FailsToUnpickle()}


class LabelledSamples(Dataset):
    """A tensor and a class name per sample: the name is one of three str objects
    the dataset holds, so the default-collated batch's list of names holds each of
    them several times."""

    def __init__(self):
        self.classes = ["".join([name, "-class"]) for name in ("cat", "dog", "bird")]

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((2,), float(i)), self.classes[i % 3], i


class EmptySamples(Dataset):
    """Samples with tensors and arrays of no elements, for the default collate: the
    batch's empty tensors are stacked into the slot like any other."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"t": torch.zeros(0, 3), "a": np.zeros((2, 0)), "e": torch.empty(0, dtype=torch.int64),
                "full": torch.ones(3) * i}
