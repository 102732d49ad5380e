"""Aliasing within a batch: fastloader delivers what torch's DataLoader with workers
delivers (its pickling transport), batch by batch, and copies no byte to do it.

For every case of tests/support/aliasing_datasets.py, torch's loader and fastloader's run
with num_workers=2 under the same start method and sharing strategy, and each
batch is reduced to a structural description: the identity graph (which positions
hold the same object), which tensors share a storage (StorageImpl and data_ptr),
storage sizes, byte offsets into the storage, storage_offset, shape, stride,
contiguity, dtype, requires_grad, leafness, types, NumPy strides and flags, which
arrays share memory, and the values. The descriptions must be equal.
"""
import pickle
import random

import numpy as np
import pytest
import torch
import torch.multiprocessing
import torch.utils.data
from multiprocessing.reduction import ForkingPickler

import fastloader
from fastloader import _core
from tests.support import aliasing_datasets as ad
from tests.support.helpers import deadline, span_in_segments, tensor_span

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    # torch's strided nested tensors warn that their API is a prototype (both loaders)
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
]

STRATEGIES = ("file_descriptor", "file_system")
CONFIGS = [(ctx, s) for ctx in ("fork", "spawn") for s in STRATEGIES]


# ---- a batch as a structural description ---------------------------------------------

def describe(batch, empty_as_resizable=False):
    """`empty_as_resizable`: for torch's loader under its file_system strategy, which
    maps even a storage of no bytes from a file, so that it cannot be resized;
    under its default strategy such a storage is a plain, resizable one, and that
    is what fastloader delivers under either."""
    ids, storages, arrays, out = {}, {}, [], []

    def resizable(s):
        return s.resizable() or (empty_as_resizable and s.nbytes() == 0)

    def tensor(t):
        if t.is_nested:
            return ("nested", type(t).__name__, str(t.layout), str(t.dtype), t.requires_grad,
                    t.is_contiguous(), [x.tolist() for x in t.unbind()])
        s = t.untyped_storage()
        group = storages.setdefault(s._cdata, len(storages))
        return ("tensor", type(t).__name__, str(t.dtype), tuple(t.shape), t.stride(),
                t.storage_offset(), t.is_contiguous(), t.requires_grad, t.is_leaf,
                "storage", group, s.nbytes(), resizable(s),
                t.data_ptr() - s.data_ptr() if t.numel() else None,
                t.detach().tolist())

    def array(a):
        arrays.append(a)
        return ("ndarray", str(a.dtype), a.shape, a.strides, a.flags.c_contiguous,
                a.flags.f_contiguous, a.flags.writeable, a.tolist())

    def walk(o, path):
        # str and bytes too: pickle memoizes them (one object for the same one twice)
        if isinstance(o, (torch.Tensor, np.ndarray, list, dict, tuple, ad.Holder, str, bytes)):
            if id(o) in ids:
                out.append((path, "same object as", ids[id(o)]))
                return
            ids[id(o)] = path
        if isinstance(o, torch.Tensor):
            out.append((path, tensor(o)))
        elif isinstance(o, np.ndarray):
            out.append((path, array(o)))
        elif isinstance(o, dict):
            out.append((path, "dict", list(o)))
            for k, v in o.items():
                walk(v, f"{path}[{k!r}]")
        elif isinstance(o, (list, tuple)):
            out.append((path, type(o).__name__, len(o)))
            for i, v in enumerate(o):
                walk(v, f"{path}[{i}]")
        elif isinstance(o, ad.Holder):
            out.append((path, "Holder", o.tag))
            walk(o.t, f"{path}.t")
        elif isinstance(o, (torch.UntypedStorage, torch.TypedStorage)):
            u = o if isinstance(o, torch.UntypedStorage) else o._untyped_storage
            group = storages.setdefault(u._cdata, len(storages))
            out.append((path, type(o).__name__, str(getattr(o, "dtype", None)), "storage",
                        group, u.nbytes(), resizable(u), u.device.type, bytes(u.tolist())))
        else:
            out.append((path, type(o).__name__, o))

    walk(batch, "batch")
    # NumPy memory sharing between the batch's arrays (torch's transport: none)
    shared = [(i, j) for i in range(len(arrays)) for j in range(i + 1, len(arrays))
              if arrays[i] is not arrays[j] and np.shares_memory(arrays[i], arrays[j])]
    out.append(("numpy arrays sharing memory", shared))
    return out


def assert_same_description(expected, got, what):
    assert len(expected) == len(got), (what, expected, got)
    for e, g in zip(expected, got):
        assert e == g, f"{what}: torch delivers\n  {e}\nfastloader delivers\n  {g}"


# ---- the two loaders, once per configuration -------------------------------------------

def _run(make, ctx, strategy, on_batch):
    loader = make(ad.IndexDataset(len(ad.CASES)), batch_size=1, num_workers=2,
                  collate_fn=ad.case_collate, multiprocessing_context=ctx)
    with deadline(120, f"{make.__name__} {ctx}/{strategy}"):
        it = iter(loader)
        for i, batch in enumerate(it):
            on_batch(i, batch, it)
            del batch
    del it, loader


def with_torch_strategy(strategy, fn):
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(strategy)
    try:
        return fn()
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


_RESULTS = {}


def results(ctx, strategy):
    """(torch's descriptions, fastloader's descriptions, batches fastloader delivered
    from outside its ring) for every case, computed once per configuration."""
    if (ctx, strategy) not in _RESULTS:
        ref, got, outside = {}, {}, {}

        def torch_batch(i, batch, it):
            ref[i] = describe(batch, empty_as_resizable=strategy == "file_system")

        def fast_batch(i, batch, it):
            got[i] = describe(batch)
            outside[i] = bytes_outside_ring(batch, it.segments())

        def make_torch(*a, **k):
            return torch.utils.data.DataLoader(*a, **k)

        def make_fast(*a, **k):
            return fastloader.DataLoader(*a, sharing_strategy=strategy, **k)

        make_torch.__name__, make_fast.__name__ = "torch", "fastloader"
        try:
            with_torch_strategy(strategy, lambda: _run(make_torch, ctx, strategy, torch_batch))
            _run(make_fast, ctx, strategy, fast_batch)
            _RESULTS[ctx, strategy] = (ref, got, outside)
        except Exception as e:   # every test of this configuration reports it, once run
            _RESULTS[ctx, strategy] = e
    if isinstance(_RESULTS[ctx, strategy], Exception):
        raise _RESULTS[ctx, strategy]
    return _RESULTS[ctx, strategy]


def bytes_outside_ring(batch, segments):
    """Tensors and arrays (also inside pickled objects and nested tensors) whose
    bytes are not inside one of the ring segments: they were copied on arrival."""
    bad, seen = [], set()

    def check(what, span):
        if span[1] > span[0] and not span_in_segments(span, segments):
            bad.append((what, hex(span[0]), span[1] - span[0]))

    def walk(o, path):
        if isinstance(o, (list, dict, tuple)):
            if id(o) in seen:   # a batch may hold itself (the recursive case)
                return
            seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.is_nested:
                parts = [o.values(), o.offsets()] if o.layout == torch.jagged else o.unbind()
                for k, p in enumerate(parts):
                    walk(p, f"{path}<{k}>")
                return
            s = o.untyped_storage()
            check(path + " storage", (s.data_ptr(), s.data_ptr() + s.nbytes()))
            check(path, tensor_span(o))
        elif isinstance(o, np.ndarray):
            start = o.__array_interface__["data"][0]
            lo, hi = np.byte_bounds(o) if hasattr(np, "byte_bounds") else np.lib.array_utils.byte_bounds(o)
            check(path, (lo, hi) if o.size else (start, start))
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{path}[{k!r}]")
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, f"{path}[{i}]")
        elif isinstance(o, ad.Holder):
            walk(o.t, path + ".t")

    walk(batch, "batch")
    return bad


# ---- every case, every configuration -----------------------------------------------------

@pytest.mark.parametrize("ctx,strategy", CONFIGS)
@pytest.mark.parametrize("case", ad.CASE_NAMES)
def test_batch_aliasing_matches_torch(case, ctx, strategy):
    ref, got, _ = results(ctx, strategy)
    i = ad.CASE_NAMES.index(case)
    assert i in ref and i in got, (sorted(ref), sorted(got))
    assert_same_description(ref[i], got[i], f"{case} ({ctx}/{strategy})")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", ad.CASE_NAMES)
def test_decoding_copies_no_bytes(case, strategy):
    _, _, outside = results("fork", strategy)
    i = ad.CASE_NAMES.index(case)
    # but a strided-layout nested tensor, which torch's transport copies out of its
    # buffer (contiguous, whatever its strides were), and so does fastloader
    copied = [entry for entry in outside[i]
              if not entry[0].startswith(("batch['strided']", "batch['transposed']"))]
    assert copied == [], f"{case}: copied on arrival: {copied}"


# ---- what a training step sees ------------------------------------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_in_place_mask_of_labels_reaches_input_ids(strategy):
    """A causal-LM collate returns labels = input_ids; the step masks labels in place."""
    def masked(make):
        out = []
        loader = make(ad.IndexDataset(len(ad.CASES)), batch_size=1, num_workers=2,
                      collate_fn=ad.case_collate, multiprocessing_context="fork")
        with deadline(60):
            for i, batch in enumerate(loader):
                if ad.CASES[i] is ad.labels_is_input_ids:
                    batch["labels"][batch["attention_mask"] == 1] = -100
                    out.append((batch["labels"] is batch["input_ids"],
                                batch["input_ids"].tolist()))
        return out

    expected = with_torch_strategy(strategy, lambda: masked(torch.utils.data.DataLoader))
    got = masked(lambda *a, **k: fastloader.DataLoader(*a, sharing_strategy=strategy, **k))
    assert expected == [(True, [[-100] * 5] * 2)], expected   # what torch delivers
    assert got == expected


def test_view_of_a_huge_storage_copies_only_what_the_batch_uses():
    """torch moves a whole storage into shared memory; the ring carries the bytes the
    batch's tensors use (sharing between them kept), not a dataset-sized storage."""
    big = torch.arange(1 << 22, dtype=torch.int64)   # 32 MiB
    out = _core.decode(_core.encode({"a": big[1000:1010], "b": big[1005:1020]}))
    a, b = out["a"], out["b"]
    assert a.untyped_storage()._cdata == b.untyped_storage()._cdata
    assert b.data_ptr() - a.data_ptr() == 5 * 8
    assert a.untyped_storage().nbytes() < 1 << 20
    assert a.tolist() == list(range(1000, 1010)) and b.tolist() == list(range(1005, 1020))
    b[0] = -1
    assert a[5].item() == -1


# ---- errors keep their identity ---------------------------------------------------------

def test_non_leaf_requires_grad_tensor_is_refused_like_torch():
    """torch's reductions refuse it (the worker's queue feeder prints the error and torch
    waits for its timeout); fastloader raises the same error in the main process."""
    with pytest.raises(RuntimeError) as ref:
        ForkingPickler.dumps(ad.non_leaf_collate([0]))
    loader = fastloader.DataLoader(ad.IndexDataset(2), batch_size=1, num_workers=2,
                                   collate_fn=ad.non_leaf_collate,
                                   multiprocessing_context="fork")
    with deadline(60), pytest.raises(RuntimeError) as got:
        next(iter(loader))
    assert str(ref.value) in str(got.value)


def test_decode_raises_the_elements_own_unpickling_error():
    blob = _core.encode({"bad": ad.FailsToUnpickle()})
    with pytest.raises(ValueError, match="^boom$"):
        _core.decode(blob)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unpickling_error_reaches_the_user_unchanged(strategy):
    def first_error(make):
        loader = make(ad.IndexDataset(2), batch_size=1, num_workers=2,
                      collate_fn=ad.unpickling_fails_collate, multiprocessing_context="fork")
        with deadline(60):
            try:
                next(iter(loader))
            except Exception as e:  # the error itself is the result compared below
                return type(e), str(e)
        return None

    expected = with_torch_strategy(strategy, lambda: first_error(torch.utils.data.DataLoader))
    got = first_error(lambda *a, **k: fastloader.DataLoader(*a, sharing_strategy=strategy, **k))
    assert expected == (ValueError, "boom"), expected
    assert got == expected


def test_same_object_twice_stays_one_object_in_the_codec():
    t = torch.ones(3)
    lst = [t]
    out = _core.decode(_core.encode((t, {"t": t, "l": lst}, lst, [lst])))
    assert out[0] is out[1]["t"] and out[1]["l"] is out[2] and out[3][0] is out[2]
    assert out[2][0] is out[0]
    # pickle (torch's transport) agrees on every identity above
    ref = pickle.loads(pickle.dumps((t, {"t": t, "l": lst}, lst, [lst])))
    assert ref[0] is ref[1]["t"] and ref[1]["l"] is ref[2] and ref[3][0] is ref[2]


def test_the_same_str_or_bytes_twice_is_one_object_as_pickles_and_equal_ones_are_two():
    s, b = "".join(["na", "me"]), bytes(range(5))
    other = "".join(["na", "me"])
    batch = {"s": [s, s, other], "b": (b, b), s: [s], "sur": ["\udc80x", "\udc80x"]}
    out, ref = _core.decode(_core.encode(batch)), pickle.loads(pickle.dumps(batch))
    for got in (out, ref):
        assert got["s"][0] is got["s"][1] is got[s][0] and got["s"][2] is not got["s"][0]
        assert got["b"][0] is got["b"][1]
    assert (out["sur"][0] is out["sur"][1]) == (ref["sur"][0] is ref["sur"][1])
    assert out == batch


def _random_batch(rng, pool, depth=0):
    """Lists, tuples, namedtuples and dicts of str, bytes (UTF-8 or not), ints,
    tensors and None, where any object made so far may occur again."""
    if depth > 3 or rng.random() < 0.3:
        r = rng.random()
        if r < 0.3 and pool:
            return rng.choice(pool)
        if r < 0.5:
            made = "".join(rng.choice("ab\u00e9") for _ in range(rng.randint(0, 3)))
        elif r < 0.6:
            made = bytes(rng.randint(0, 255) for _ in range(rng.randint(0, 3)))
        elif r < 0.65:
            made = "\ud800" + str(rng.random())   # not UTF-8: pickled
        elif r < 0.8:
            made = torch.arange(3)
        else:
            return rng.choice([None, rng.randint(-5, 10 ** 20)])
        pool.append(made)
        return made
    n = rng.randint(0, 70) if rng.random() < 0.1 else rng.randint(0, 5)   # > 64: sized memo
    items = [_random_batch(rng, pool, depth + 1) for _ in range(n)]
    kind = rng.random()
    if kind < 0.35:
        made = items
    elif kind < 0.6:
        made = tuple(items)
    elif kind < 0.7:
        made = ad.Pair(items[0] if items else 1, tuple(items))
    else:
        keys = [k for k in pool if isinstance(k, (str, bytes))] or ["k"]
        made = {rng.choice(keys) if rng.random() < 0.7 else i: item
                for i, item in enumerate(items)}
    if rng.random() < 0.2:
        pool.append(made)
    return made


def _identity_graph(obj, ids, out):
    """obj as a list of nodes, where an object met again is ("again", its number)."""
    if id(obj) in ids:
        out.append(("again", ids[id(obj)]))
        return out
    if isinstance(obj, (str, bytes, list, tuple, dict, torch.Tensor)):
        ids[id(obj)] = len(ids)
    if isinstance(obj, dict):
        out.append(("dict", len(obj)))
        for k, v in obj.items():
            _identity_graph(k, ids, out)
            _identity_graph(v, ids, out)
    elif isinstance(obj, (list, tuple)):
        out.append((type(obj).__name__, len(obj)))
        for v in obj:
            _identity_graph(v, ids, out)
    else:
        out.append(("value", obj.tolist() if isinstance(obj, torch.Tensor) else repr(obj)))
    return out


def test_identities_of_random_batches_are_pickles():
    """Which positions of a batch hold one object (strings, bytes, containers,
    tensors, in any mix and order): the codec's answer is pickle's, on 1,500
    seeded random batches."""
    rng = random.Random(1234)
    for i in range(1500):
        batch = _random_batch(rng, [])
        expected = _identity_graph(pickle.loads(pickle.dumps(batch)), {}, [])
        got = _identity_graph(_core.decode(_core.encode(batch)), {}, [])
        assert got == expected, f"batch {i}: {batch!r}"


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_a_class_name_shared_by_samples_arrives_as_one_object_as_torchs(ctx):
    """Default collate over samples whose label is one of the dataset's own str
    objects: in torch's main process each name is one object however many samples
    hold it (pickle's memo), and so in fastloader's."""
    def groups(make):
        loader = make(ad.LabelledSamples(), batch_size=6, num_workers=2, multiprocessing_context=ctx)
        seen = []
        with deadline(120):
            for _, names, _ in loader:
                first = {}
                seen.append((names, [first.setdefault(id(n), len(first)) for n in names]))
        return seen

    expected = groups(torch.utils.data.DataLoader)
    assert expected[0][1] == [0, 1, 2, 0, 1, 2], expected   # what torch's transport gives
    assert groups(fastloader.DataLoader) == expected


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_an_arrays_dtype_metadata_arrives_as_torchs(ctx):
    """NumPy arrays kept as arrays by a custom collate, whose dtype carries metadata
    (h5py's enum and variable-length string dtypes): torch's transport pickles them,
    which keeps it; fastloader's lost it (values right, dtype.metadata None)."""
    def batches(make):
        loader = make(ad.IndexDataset(4), batch_size=2, num_workers=2,
                      multiprocessing_context=ctx, collate_fn=ad.enum_arrays_collate)
        with deadline(120):
            return [[(a.dtype.str, a.dtype.metadata, a.tolist(), a.flags.writeable)
                     for a in batch] for batch in loader]

    expected = batches(torch.utils.data.DataLoader)
    assert expected[0][0][1] == ad.ENUM_METADATA, expected   # what torch's transport gives
    assert batches(fastloader.DataLoader) == expected


@pytest.mark.parametrize("batch_size", [2, None], ids=["collated", "unbatched"])
def test_empty_batch_tensors_can_be_resized_as_torchs(batch_size):
    """torch's transport gives a tensor of no bytes a plain storage (resize_ and out=
    work on it): default-collated and unbatched, fastloader's are the same."""
    def first(make):
        loader = make(ad.EmptySamples(), batch_size=batch_size, num_workers=1,
                      multiprocessing_context="fork")
        with deadline(60):
            batch = next(iter(loader))
        seen = {}
        for k, t in batch.items():
            seen[k] = (tuple(t.shape), t.stride(), t.untyped_storage().resizable())
            if not t.numel():
                torch.add(torch.ones(2, dtype=t.dtype), 1, out=t)   # resizes its out= tensor
                seen[k] += (t.tolist(),)
        return seen

    expected = with_torch_strategy("file_descriptor", lambda: first(torch.utils.data.DataLoader))
    got = first(lambda *a, **k: fastloader.DataLoader(*a, sharing_strategy="file_descriptor", **k))
    assert expected["t"][2] and not expected["full"][2], expected
    assert got == expected
