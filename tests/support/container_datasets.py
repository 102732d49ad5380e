"""Samples whose container types run their own code on what default_collate puts in
them (tests/conformance/test_container_collate.py); importable by spawned workers."""
import collections
from multiprocessing.reduction import ForkingPickler

import torch
from torch.utils.data import Dataset, get_worker_info

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


# Namedtuple instances in a batch: torch's queue pickles them, so the main process
# gets cls.__new__(cls, *fields) plus the instance's state, and no __init__ runs.
class Where(collections.namedtuple("Where", "x y")):
    """A namedtuple subclass whose __init__ records the process it ran in."""

    def __init__(self, x, y):
        self.built_in = "worker" if get_worker_info() is not None else "main"


class Noted(collections.namedtuple("Noted", "x y")):
    """A namedtuple subclass given an attribute after it is built (pickle's state
    carries it; a tuple subclass cannot have slots of its own)."""


class Reduced(collections.namedtuple("Reduced", "x y")):
    """A namedtuple that pickles through its own __reduce__."""

    __slots__ = ()

    def __reduce__(self):
        return (Reduced, (self.x, "reduced"))


class Reversed(collections.namedtuple("Reversed", "x y")):
    """A namedtuple that iterates backwards (pickle's __getnewargs__ iterates)."""

    __slots__ = ()

    def __iter__(self):
        return reversed(tuple(tuple.__iter__(self)))


class Registered(collections.namedtuple("Registered", "x y")):
    """A namedtuple with a reducer registered with ForkingPickler (torch's queue
    pickles through it)."""

    __slots__ = ()


def _reduce_registered(made):
    return Registered, (made.x, "registered")


ForkingPickler.register(Registered, _reduce_registered)


def built_namedtuple(kind):
    """collate_fn: the batch's first sample's tensor and index in the class `kind`,
    with what the kind sets after construction (the collate runs in the worker)."""
    def collate(batch):
        x, i = torch.stack([b[0] for b in batch]), batch[0][1]
        if kind == "Noted":
            made = Noted(x, i)
            made.note = f"noted {i}"
            return made
        return {"Where": Where, "Reduced": Reduced, "Registered": Registered,
                "Reversed": Reversed, "Plain": Plain}[kind](x, i)
    return collate


class Pairs(Dataset):
    """(tensor, index) samples."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.tensor([i, i + 1]), i
