"""Samples whose container types run their own code on what default_collate puts in
them (tests/conformance/test_container_collate.py); importable by spawned workers."""
import collections

import torch
from torch.utils.data import Dataset

from fastloader import CollatedSamples


class LenMapping(collections.abc.Mapping):
    """An immutable Mapping that records the batch size when it is built."""

    def __init__(self, d):
        self._d = dict(d)
        self.batch_size = len(next(iter(self._d.values())))

    def __getitem__(self, key):
        return self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


class CastDict(collections.UserDict):
    """Casts the tensors stored in it to float32."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value.float() if isinstance(value, torch.Tensor) else value)


class Coerced(collections.namedtuple("Coerced", "x y")):
    """A namedtuple that makes its fields tensors."""

    __slots__ = ()

    def __new__(cls, x, y):
        return super().__new__(cls, torch.as_tensor(x), torch.as_tensor(y))


class Sized(collections.namedtuple("Sized", "x y")):
    """A namedtuple subclass that records the batch size."""

    def __init__(self, x, y):
        self.n = len(x)


class SizedList(list):
    """A list that records the length of what is stored in it."""

    def __setitem__(self, i, value):
        super().__setitem__(i, value)
        self.lengths = getattr(self, "lengths", {})
        self.lengths[i] = len(value)


Plain = collections.namedtuple("Plain", "x y")


class Containers(Dataset):
    """Sample i in the container `kind`, holding a tensor and an int (or, for
    "nested", a plain dict holding a CastDict)."""

    def __init__(self, kind, n=12):
        self.kind, self.n = kind, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.tensor([i, i + 1])
        return {
            "LenMapping": lambda: LenMapping({"x": x, "y": x}),
            "CastDict": lambda: CastDict(x=x, y=i),
            "Coerced": lambda: Coerced(x, i),
            "Sized": lambda: Sized(x, i),
            "SizedList": lambda: SizedList([x, i]),
            "nested": lambda: (x, {"inner": CastDict(y=i)}),
            "Plain": lambda: Plain(x, i),
        }[self.kind]()


class CollatedCoerced(Dataset):
    """A batch that comes collated (CollatedSamples) as a Coerced namedtuple."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return Coerced(torch.tensor([i]), i)

    def __getitems__(self, indices):
        return CollatedSamples(Coerced(torch.tensor([[i] for i in indices]),
                                       torch.tensor(indices)))


class TupleOfCastDicts(Dataset):
    """__getitems__ returns its samples as a tuple (torch's fetcher passes on what it
    returns): the check that keeps placeholders from the containers must see it."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return CastDict(y=i)

    def __getitems__(self, indices):
        return tuple(CastDict(y=i) for i in indices)
