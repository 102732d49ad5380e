"""Packed arrays' batch fetch (issue 14): ``a.__getitems__(indices)``, which torch's
fetcher calls for a batch, is ``[a[i] for i in indices]`` in one C call: the same
items, and for a bad index the same exception type and text as ``a[i]``.
"""
import random

import numpy as np
import pytest
import torch

from fastloader import DataLoader
from fastloader.packed import PackedArray, PackedStringArray
from tests.support.helpers import collect

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

STRINGS = ["", "a", "bé", "日本語", "x" * 300, "\udcff-not-utf8", "tab\there", "z", "last"]
RECORDS = [{"id": i, "box": [i, i + 1.5], "name": f"r{i}"} for i in range(7)] + [None, (1, "t")]


def per_item(a, indices):
    """What torch's fetcher builds without __getitems__: a[i] per index, or the error
    of the first bad one."""
    try:
        return [a[i] for i in indices], None
    except Exception as exc:   # compared below: type and text must match
        return None, (type(exc), str(exc))


def batched(a, indices):
    try:
        return a.__getitems__(indices), None
    except Exception as exc:
        return None, (type(exc), str(exc))


def arrays():
    s = PackedStringArray(STRINGS)
    r = PackedArray(RECORDS)
    # whole arrays and views (slices with steps, reversed) of both kinds
    return [s, s[2:], s[::-2], s[1:8:3], s[5:5], r, r[::-1], r[1::2]]


def batched_take(a, indices):
    try:
        return a.take(indices), None
    except Exception as exc:
        return None, (type(exc), str(exc))


def index_patterns(n):
    rng = random.Random(n)
    pats = [[], [0] * (n > 0), list(range(n)), list(range(n))[::-1],
            [-1] * (n > 0), list(range(-n, 0)), [n], [-n - 1], [0, n], [n - 1, -n - 1],
            [2 ** 63], [-(2 ** 63) - 1], [2 ** 100], [10 ** 30 * -1],
            [np.int64(n - 1)] if n else [np.int64(0)], [np.int32(-1)], [True], [False],
            [1.0], ["0"], [None], [slice(0, 2)], [slice(None, None, -1)]]
    pats += [[rng.randrange(-n - 2, n + 2) for _ in range(rng.randrange(1, 70))]
             for _ in range(40)] if n else []
    pats += [[rng.randrange(-n, n) for _ in range(64)] for _ in range(20)] if n else []
    return pats


def _as_comparable(result):
    # a slice key yields a view: compare its items
    items, err = result
    if items is not None:
        items = [x.tolist() if isinstance(x, (PackedStringArray, PackedArray)) else x
                 for x in items]
    return items, err


@pytest.mark.parametrize("which", range(8))
def test_getitems_equals_per_item_indexing(which):
    a = arrays()[which]
    n = len(a)
    for indices in index_patterns(n):
        for given in (indices, tuple(indices), iter(indices), np.array(indices, dtype=object)):
            want = _as_comparable(per_item(a, indices))
            got = _as_comparable(batched(a, given))
            assert got == want, (which, indices, type(given))
        # take() is the same function under its older name
        assert _as_comparable(batched_take(a, indices)) == want, (which, indices)
    # one good index per item, every item in order: all of it
    assert a.__getitems__(list(range(n))) == a.tolist()


def test_getitems_errors_match_getitem_text():
    a = PackedStringArray(["a", "b"])
    with pytest.raises(IndexError) as per:
        a[5]
    with pytest.raises(IndexError) as batch:
        a.__getitems__([0, 1, 5, 0])
    assert str(batch.value) == str(per.value) == "PackedStringArray index out of range"
    with pytest.raises(TypeError) as batch:
        a.__getitems__([0, 1.5])
    assert "indices must be integers or slices, not float" in str(batch.value)
    with pytest.raises(TypeError, match="'int' object is not iterable"):
        a.__getitems__(3)
    assert a.__getitems__([]) == [] and a.__getitems__(()) == []
    assert PackedStringArray([]).__getitems__([]) == []
    with pytest.raises(IndexError, match="PackedStringArray index out of range"):
        PackedStringArray([]).__getitems__([0])


def test_getitems_returns_fresh_records_and_a_new_list():
    r = PackedArray([{"k": [1]}])
    first, second = r.__getitems__([0, 0])
    assert first == second and first is not second   # each a fresh unpickled record
    first["k"].append(2)
    assert r[0] == {"k": [1]}
    idx = [0]
    out = r.__getitems__(idx)
    assert out is not idx and type(out) is list


class _Mutating:
    """An index whose __index__ empties the list being fetched."""

    def __init__(self, victim, value):
        self.victim, self.value = victim, value

    def __index__(self):
        self.victim.clear()
        return self.value


def test_getitems_survives_indices_changed_while_it_runs():
    a = PackedStringArray(["p", "q", "r"])
    indices = [0, 1, 2]
    indices.insert(1, _Mutating(indices, 2))
    assert a.__getitems__(indices) == ["p", "r", "q", "r"]   # the list as it was passed


class Upper(PackedStringArray):
    __slots__ = ()

    def __getitem__(self, key):
        return super().__getitem__(key).upper()


def test_subclass_overriding_getitem_gets_its_own_items():
    u = Upper(["ab", "cd"])
    assert u[1] == "CD"
    assert u.__getitems__([1, -2]) == ["CD", "AB"] == [u[1], u[-2]]


@pytest.mark.parametrize("kind,context", [("str", "fork"), ("str", "spawn"),
                                          ("records", "forkserver")])
def test_loader_batches_match_torch(kind, context):
    if kind == "str":
        items = [f"file_{i:05d}.jpg" for i in range(997)] + ["é/ü", ""]
        a = PackedStringArray(items)
    else:
        items = [{"i": i, "v": float(i) / 3} for i in range(500)]
        a = PackedArray(items)
    assert hasattr(a, "__getitems__")   # what torch's fetcher checks

    def batches(cls, **kw):
        g = torch.Generator()
        g.manual_seed(123)
        return collect(cls(a, batch_size=64, shuffle=True, generator=g, **kw), 120)

    want = batches(torch.utils.data.DataLoader, num_workers=0)
    got = batches(DataLoader, num_workers=2, multiprocessing_context=context)
    assert len(got) == len(want) == -(-len(items) // 64)
    for b_got, b_want in zip(got, want):
        if kind == "str":
            assert type(b_got) is list and b_got == b_want
        else:
            assert b_got.keys() == b_want.keys()
            for key in b_want:
                assert torch.equal(b_got[key], b_want[key])
    # and torch's loader over a plain list (no __getitems__) agrees too
    plain = collect(torch.utils.data.DataLoader(list(items), batch_size=64, shuffle=True,
                                                generator=torch.Generator().manual_seed(123)))
    assert len(plain) == len(want)
    for b_plain, b_want in zip(plain, want):
        if kind == "str":
            assert b_plain == b_want
        else:
            assert all(torch.equal(b_plain[k], b_want[k]) for k in b_want)
