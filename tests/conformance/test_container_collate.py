"""Sample containers whose own code sees what default_collate puts in them (a
Mapping that takes a len() in __init__, a UserDict that casts in __setitem__, a
namedtuple whose __new__ coerces): the slot collate's placeholders must never reach
them, so the batches are torch's (type, attributes, dtypes) or torch's error."""
import collections

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader

from fastloader import DataLoader
from tests.support import container_datasets as cd
from tests.support.helpers import assert_same_batches, collect


def _outcome(cls, dataset, context, batch_size=4):
    loader = cls(dataset, batch_size=batch_size, num_workers=2,
                 multiprocessing_context=context)
    try:
        return "ok", collect(loader, seconds=120)
    except Exception as exc:   # compared with torch's below
        return "error", (type(exc).__name__, str(exc).splitlines()[-1])


def _attrs(batch):
    return (type(batch), {k: v for k, v in getattr(batch, "__dict__", {}).items()
                          if k not in ("data", "_d")})   # the values: compared below


KINDS = ["LenMapping", "CastDict", "Coerced", "Sized", "SizedList", "nested", "Plain"]


@pytest.mark.parametrize("kind, context", [(kind, "fork") for kind in KINDS]
                         + [("CastDict", "spawn"), ("Coerced", "spawn")])
def test_containers_that_look_at_their_values_get_torchs_batches(kind, context):
    theirs = _outcome(TorchDataLoader, cd.Containers(kind), context)
    ours = _outcome(DataLoader, cd.Containers(kind), context)
    assert theirs[0] == "ok", theirs
    assert ours[0] == "ok", ours
    assert len(ours[1]) == len(theirs[1]) == 3
    for mine, torchs in zip(ours[1], theirs[1]):
        assert _attrs(mine) == _attrs(torchs)
        assert_same_batches(torchs, mine)


def test_a_collated_batch_in_a_coercing_namedtuple_gets_torchs_batches():
    theirs = _outcome(TorchDataLoader, cd.CollatedCoerced(), "fork")
    ours = _outcome(DataLoader, cd.CollatedCoerced(), "fork")
    assert theirs[0] == ours[0] == "ok", (theirs, ours)
    for mine, torchs in zip(ours[1], theirs[1]):
        assert type(mine) is type(torchs)
        assert_same_batches(torchs, mine)


def test_samples_handed_over_as_a_tuple_get_torchs_batches():
    theirs = _outcome(TorchDataLoader, cd.TupleOfCastDicts(), "fork")
    ours = _outcome(DataLoader, cd.TupleOfCastDicts(), "fork")
    assert theirs[0] == ours[0] == "ok", (theirs, ours)
    assert theirs[1][0]["y"].dtype == torch.float32
    for mine, torchs in zip(ours[1], theirs[1]):
        assert_same_batches(torchs, mine)


def _namedtuple_outcome(cls, kind, context):
    loader = cls(cd.Pairs(), batch_size=4, num_workers=2, multiprocessing_context=context,
                 collate_fn=cd.built_namedtuple(kind))
    return [(type(b), tuple(b), getattr(b, "__dict__", None), getattr(b, "note", None))
            for b in collect(loader, seconds=120)]


@pytest.mark.parametrize("kind", ["Where", "Noted", "Reduced", "Registered", "Reversed", "Plain"])
def test_namedtuple_instances_arrive_as_torchs_pickle_delivers_them(kind):
    """torch's queue pickles a namedtuple instance: cls.__new__ on the fields (or
    the class's own __reduce__), then the instance's __dict__; its
    __init__ does not run again in the main process."""
    theirs = _namedtuple_outcome(TorchDataLoader, kind, "fork")
    ours = _namedtuple_outcome(DataLoader, kind, "fork")
    assert len(ours) == len(theirs) == 3
    for (mtype, mfields, mdict, mnote), (ttype, tfields, tdict, tnote) in zip(ours, theirs):
        assert mtype is ttype
        assert (mdict, mnote) == (tdict, tnote)
        assert len(mfields) == len(tfields)
        for mine, torchs in zip(mfields, tfields):
            assert_same_batches(torchs, mine)


# Redefined by the test below, as a notebook cell run again redefines a class.
Redefined = collections.namedtuple("Redefined", "x y")


class ReturnsRedefined(torch.utils.data.Dataset):
    """A sample of whatever `Redefined` is now (forked workers see it as the main
    process had it when they started)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        cls = globals()["Redefined"]
        return cls(*[torch.tensor(i + k) for k in range(len(cls._fields))])


def test_a_namedtuple_class_redefined_between_loaders_arrives_as_the_new_one():
    """The main process looks its namedtuple classes up once and keeps them: a class
    redefined since (with a field more) came back as the old class, or failed
    (`__new__() takes 3 positional arguments but 4 were given`). Pickle, so torch,
    looks the name up at each load."""
    global Redefined
    original = Redefined
    try:
        for fields in ("x y", "x y z", "x y"):
            Redefined = collections.namedtuple("Redefined", fields)
            for cls in (TorchDataLoader, DataLoader):
                batches = collect(cls(ReturnsRedefined(), batch_size=2, num_workers=2,
                                      multiprocessing_context="fork"), seconds=120)
                assert [type(b) for b in batches] == [Redefined] * 2, cls
                assert [b._fields for b in batches] == [tuple(fields.split())] * 2
    finally:
        Redefined = original


def test_a_replaced_default_collate_runs_as_with_torch(monkeypatch):
    """A program (or a library) that replaced torch's default_collate attribute
    before building its loaders passes its replacement as their collate_fn: it was
    taken for torch's own and swapped for the slot collate."""
    from torch.utils.data._utils import collate as torch_collate
    original = torch_collate.default_collate

    def replaced(batch):
        return {"replaced": True, "batch": original(batch)}
    monkeypatch.setattr(torch_collate, "default_collate", replaced)
    samples = [(i, float(i)) for i in range(8)]
    theirs = collect(TorchDataLoader(samples, batch_size=4, num_workers=2), seconds=120)
    ours = collect(DataLoader(samples, batch_size=4, num_workers=2), seconds=120)
    assert [b["replaced"] for b in ours] == [True, True]
    assert_same_batches(ours, theirs)
