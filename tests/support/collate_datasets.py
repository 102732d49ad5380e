"""Datasets for tests/conformance/test_collate_fill.py (module level, so workers of
any start method can unpickle them). Values derive from the index only."""
import collections

import numpy as np
import torch
from torch.utils.data import Dataset

from fastloader import CollatedSamples

Pair = collections.namedtuple("Pair", "features label")


def _nan_with_payload():
    # a NaN whose payload bits must survive: torch.equal cannot see them, bytes can
    return np.frombuffer(np.uint64(0x7FF8_0000_0000_1234).tobytes(), dtype=np.float64)[0]


class NumbersDataset(Dataset):
    """Every column kind the C fill takes: ints, floats (with -0.0 and a NaN
    payload), bools, same-shape NumPy arrays (contiguous and strided), tensors."""

    def __init__(self, length=50):
        self.length = length
        base = np.arange(length * 8, dtype=np.int16).reshape(length, 2, 4)
        self.strided = base[:, :, ::2]           # not contiguous
        self.rows = np.linspace(-1, 1, length * 3, dtype=np.float32).reshape(length, 3)

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        special = (-0.0, float(_nan_with_payload()), float("inf"), 1e-310)
        return (
            i * 7 - 100,
            special[i % 4] if i % 5 == 0 else i / 3,
            i % 3 == 0,
            self.rows[i],
            self.strided[i],
            {"u8": np.full((2,), i, dtype=np.uint8), "c": np.complex64(1j * i) * np.ones(1, np.complex64),
             "t": torch.full((2,), float(i))},
            np.array(i, dtype=np.float64),       # 0-d array
        )


class FallbackDataset(Dataset):
    """Columns the C fill must leave to torch: mixed int/bool, int/float, int
    subclass, NumPy scalars, uint32 arrays, ints near 2**63."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return (
            True if i % 2 else i,                   # int64 after torch's promotion
            float(i) if i % 3 else i,               # float32 (torch's default dtype)
            np.int32(i),                            # NumPy scalar
            np.arange(3, dtype=np.float32)[None].repeat(i % 2 + 1, 0)[0],   # a row, not a copy
            np.arange(2, dtype=np.uint32) + i,      # dtype outside the C fill's list
            2**63 - 1 - i,                          # fits int64
            -2**63 + i,
        )


class BadColumnDataset(Dataset):
    """A column torch refuses; `kind` picks which. fastloader must raise torch's error."""

    def __init__(self, kind):
        self.kind = kind

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if self.kind == "overflow":
            return 2**63 if i == 5 else i
        if self.kind == "shapes":
            return np.zeros(3 if i == 6 else 2, dtype=np.float32)
        if self.kind == "byteorder":
            return (np.arange(3) + i).astype(">f4")
        if self.kind == "object":
            return np.array([i, "x"], dtype=object)
        raise ValueError(self.kind)


def _columns(length):
    g = torch.Generator().manual_seed(7)
    features = torch.randn(length, 4, generator=g)
    return {
        "features": features,
        "wide": torch.randn(4, length, generator=g).t(),          # not contiguous
        "labels": torch.arange(length) % 10,
        "flags": torch.arange(length) % 3 == 0,
        "np1": np.arange(length, dtype=np.float64) / 7,            # 1-D: NumPy scalars per sample
        "np2": np.arange(length * 4, dtype=np.int32).reshape(length, 4)[:, ::2],   # strided
    }


class BatchedDataset(Dataset):
    """Samples of one structure (`shape`), with or without `__getitems__` returning
    CollatedSamples: torch must produce the same batches either way."""

    def __init__(self, shape, length=45, batched=True):
        self.shape, self.length, self.batched = shape, length, batched
        self.cols = _columns(length)

    def __len__(self):
        return self.length

    def _structure(self, index):
        c = {k: v[index] for k, v in self.cols.items()}
        if self.shape == "tuple":
            return (c["features"], c["labels"])
        if self.shape == "list":
            return [c["features"], c["flags"], c["np1"]]
        if self.shape == "namedtuple":
            return Pair(c["wide"], c["labels"])
        if self.shape == "nested":
            return {"x": (c["features"], {"np2": c["np2"]}), "y": [c["labels"], c["np1"]]}
        raise ValueError(self.shape)

    def __getitem__(self, i):
        return self._structure(i)

    def __getitems__(self, indices):
        if not self.batched:
            return [self[i] for i in indices]
        index = np.asarray(indices, dtype=np.int64)
        return CollatedSamples(self._structure(index))


class RequiresGradBatched(Dataset):
    """A CollatedSamples leaf that requires grad: fastloader must take torch's path."""

    def __init__(self):
        self.w = torch.ones(12, 2, requires_grad=True)

    def __len__(self):
        return 12

    def __getitems__(self, indices):
        return CollatedSamples((self.w[torch.as_tensor(indices)],))


def describe_collate(batch):
    """A custom collate_fn: shows what it was given."""
    return {"type": type(batch).__name__, "len": len(batch),
            "first": torch.as_tensor(batch[0][0]).clone(), "last_label": int(batch[-1][1])}


class Tagged(torch.Tensor):
    """A tensor subclass (torch.stack keeps it, through __torch_function__)."""


class _KindDataset(Dataset):
    """24 samples of one `kind` (the subclass says which kinds it makes)."""

    def __init__(self, kind, length=24):
        self.kind, self.length = kind, length

    def __len__(self):
        return self.length


class TupleSamplesDataset(_KindDataset):
    """Tuple samples of one `kind`, for the transposition of plain tuples in C:
    "plain" (every leaf type default_collate knows, nested containers included),
    "ragged" (one sample a field short: torch's error), "namedtuple_first" and
    "namedtuple_later" (a Pair among plain tuples), "list_later" (a list among
    tuples), "uncollatable" (a field torch refuses), "long_row_then_uncollatable"
    (one sample's tensor a value longer, then a field torch refuses: torch's stack
    error comes first), "list_long_row_then_uncollatable" (the same as lists),
    "short_row" (one tensor a value short: torch's worker fails to resize its
    storage), "int_among_rows" and "array_among_rows" (a number or an array among
    the tensors: torch's worker has no numel() for it), "subclass_later" (a tensor
    subclass among plain tensors: torch's batch is of the subclass),
    "negative_stride_arrays" and "odd_stride_arrays" (arrays torch.as_tensor
    refuses: a negative stride, a stride not a multiple of the item size)."""

    def __getitem__(self, i):
        row = torch.arange(3, dtype=torch.float32) + i
        if self.kind == "subclass_later":
            return (row.as_subclass(Tagged) if i % 8 == 3 else row, i)
        if self.kind == "negative_stride_arrays":
            return ((np.arange(4, dtype=np.float32) + i)[::-1], i)
        if self.kind == "odd_stride_arrays":
            raw = np.zeros(13, np.uint8)
            return (np.lib.stride_tricks.as_strided(raw[1:].view(np.int32), (2,), (5,)), i)
        if self.kind == "plain":
            return (row, i, i / 4, i % 2 == 0, np.full(2, i, np.int16), f"s{i}", b"b",
                    (row * 2, i), {"k": i, "t": row[:2]}, Pair(row, i), [i, i + 1])
        if self.kind == "ragged":
            return (row, i) if i != 5 else (row,)
        if self.kind == "namedtuple_first":
            return Pair(row, i) if i % 8 == 0 else (row, i)
        if self.kind == "namedtuple_later":
            return Pair(row, i) if i % 8 == 3 else (row, i)
        if self.kind == "list_later":
            return [row, i] if i % 8 == 3 else (row, i)
        if self.kind == "uncollatable":
            return (row, object())
        if self.kind == "long_row_then_uncollatable":
            return (row if i != 5 else torch.arange(4.0) + i, object())
        if self.kind == "list_long_row_then_uncollatable":
            return [row if i != 5 else torch.arange(4.0) + i, object()]
        if self.kind == "short_row":
            return (row if i != 5 else row[:2], i)
        if self.kind == "int_among_rows":
            return (row if i != 5 else i, i)
        if self.kind == "array_among_rows":
            return (row if i != 5 else row.numpy(), i)
        raise ValueError(self.kind)


class DictSamplesDataset(_KindDataset):
    """Dict samples of one `kind`, for the gathering of plain dicts' columns in C:
    "plain" (str keys, every leaf type default_collate knows, nested containers),
    "key_order" (later samples hold the keys in another order), "extra_keys"
    (later samples hold keys the first lacks: torch ignores them), "int_keys",
    "ordered_later" (an OrderedDict among dicts), "missing_key" (torch's
    KeyError), "uncollatable" (a value torch refuses), "long_row_then_uncollatable"
    (one sample's tensor a value longer, then a value torch refuses: torch's stack
    error comes first), "nested_long_row_then_uncollatable" (the same one dict
    deeper)."""

    def __getitem__(self, i):
        row = torch.arange(3, dtype=torch.float32) + i
        if self.kind == "plain":
            return {"x": row, "label": i, "w": i / 4, "flag": i % 2 == 0,
                    "a": np.full(2, i, np.int16), "name": f"s{i}", "pair": (row * 2, i),
                    "inner": {"t": row[:2], "n": i}, "p": Pair(row, i), "ids": [i, i + 1]}
        if self.kind == "key_order":
            return {"x": row, "label": i} if i % 2 == 0 else {"label": i, "x": row}
        if self.kind == "extra_keys":
            return {"x": row, "label": i, **({"extra": i} if i % 8 else {})}
        if self.kind == "int_keys":
            return {0: row, 1: i}
        if self.kind == "ordered_later":
            d = {"x": row, "label": i}
            return collections.OrderedDict(d) if i % 8 == 3 else d
        if self.kind == "missing_key":
            return {"x": row, "label": i} if i != 5 else {"x": row}
        if self.kind == "uncollatable":
            return {"x": row, "bad": object()}
        if self.kind == "long_row_then_uncollatable":
            return {"x": row if i != 5 else torch.arange(4.0) + i, "bad": object()}
        if self.kind == "nested_long_row_then_uncollatable":
            return {"label": i, "inner": {"x": row if i != 5 else torch.arange(4.0) + i, "bad": object()}}
        raise ValueError(self.kind)


class Box:
    """A type torch's default_collate does not know, until a test registers
    `collate_boxes` for it in torch's default_collate_fn_map."""

    def __init__(self, value):
        self.value = value


def collate_boxes(batch, *, collate_fn_map=None):
    return torch.tensor([b.value for b in batch]) * 10


def refuse_boxes(batch, *, collate_fn_map=None):
    """A registered function that refuses its column (as a TypeError) and counts
    its calls in `refuse_boxes.calls`."""
    refuse_boxes.calls += 1
    raise TypeError("boxes refused")


refuse_boxes.calls = 0


def stack_times_ten(batch, *, collate_fn_map=None):
    """A user's replacement for torch's tensor collate function."""
    return torch.stack(batch) * 10


def ints_as_float32(batch, *, collate_fn_map=None):
    """A user's replacement for torch's int collate function."""
    return torch.tensor(batch, dtype=torch.float32)


def claim_tuples(batch, *, collate_fn_map=None):
    """A user's collate function for tuple samples (collate() looks it up first)."""
    return {"tuples": len(batch), "fields": len(batch[0])}


class BoxDataset(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return (Box(i), i, torch.full((2,), float(i)))


def scalars_times_hundred(batch, *, collate_fn_map=None):
    """A user's replacement for torch's NumPy-scalar collate function."""
    return torch.as_tensor(batch) * 100


def boxes_through_collate(batch, *, collate_fn_map=None):
    """A user's function that collates what it holds with the map it is given and
    uses the result (torch gives it torch's map, so real tensors)."""
    from torch.utils.data._utils.collate import collate
    return collate([torch.tensor([b.value]) for b in batch], collate_fn_map=collate_fn_map) * 10


def number_fn(batch, *, collate_fn_map=None):
    """Registered for numbers.Number: which of it and int's function torch picks
    for a bool depends on the map's order."""
    return torch.full((len(batch),), 7)


def generic_fn(batch, *, collate_fn_map=None):
    return "generic"


class ArrayRowsDataset(Dataset):
    """1-D float64 rows through __getitems__ -> CollatedSamples: their rows' leaves
    are NumPy scalars, which torch collates with the map's scalar function."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return (np.float64(i) / 4, torch.tensor(float(i)))

    def __getitems__(self, indices):
        index = np.asarray(indices, dtype=np.int64)
        return CollatedSamples((index.astype(np.float64) / 4, torch.from_numpy(index * 1.0)))


class ReadOnlyArraysDataset(Dataset):
    """float32 rows and an int label; from sample 3 on the rows are not writable
    (as arrays over a read-only np.memmap or bytes are), which torch.as_tensor
    warns about once per process."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        row = np.arange(4, dtype=np.float32) + i
        row.setflags(write=i < 3)
        return row, i


class ReadOnlyCollatedDataset(ReadOnlyArraysDataset):
    """The same samples, also through __getitems__ as one CollatedSamples batch
    whose 2-D array of rows is not writable: torch collates its rows, arrays that
    torch.as_tensor warns about."""

    def __getitems__(self, indices):
        rows = np.arange(4, dtype=np.float32) + np.asarray(indices, dtype=np.float32)[:, None]
        rows.setflags(write=False)
        return CollatedSamples((rows, torch.tensor(indices)))


class ReadOnlyAfterBadStackDataset(Dataset):
    """(a tensor whose length varies, a row that is not writable): torch's collate
    stops at the tensors' stack error before it reaches the rows, so it never
    warns about them."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        row = np.arange(4, dtype=np.float32) + i
        row.setflags(write=False)
        return torch.zeros(1 + i % 2), row


class TensorSamplesDataset(Dataset):
    """One tensor per sample: collate() finds its type in the map at once."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.full((2,), float(i))


class DeepDataset(Dataset):
    """Samples nested `depth` lists deep around (tensor, int): default_collate
    recurses that deep, and the batch is nested as deep."""

    def __init__(self, depth=300, length=16):
        self.depth, self.length = depth, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        sample = [torch.tensor([i, -i]), i]
        for _ in range(self.depth):
            sample = [sample]
        return sample
