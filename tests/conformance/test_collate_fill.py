"""The C fill for default collation, CollatedSamples from __getitems__, and the
vectorised TensorDataset fetch: each gives exactly torch's default_collate result
(types, dtypes, shapes, strides, bytes) batch by batch, or torch's own error, and
custom collate_fns still get what torch gives them."""
import collections
import gc
import numbers
import warnings

import numpy as np
import functools

import pytest
import torch
import torch.utils.data
from torch.utils.data import TensorDataset, default_collate
from torch.utils.data._utils.collate import default_collate_fn_map

import fastloader
from fastloader import CollatedSamples, _core
from fastloader._codec_hooks import COLUMN, COPY, GATHER, DeferredStack
from fastloader.batch_fetch import _tensor_dataset_batch
from fastloader.collate import slot_collate
from tests.support import collate_datasets as cd
from tests.support.helpers import assert_same_batches, clone_batch, collect, run_python
from tests.support.torch_features import HAS_WIDE_UNSIGNED, needs_wide_unsigned

TorchLoader = torch.utils.data.DataLoader
FastLoader = fastloader.DataLoader


def assert_identical(a, b, path="batch"):
    """assert_same_batches, except that tensors are compared by strides and raw
    bytes (so NaN payloads and -0.0 count, and NaN equals itself)."""
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.device) == (b.dtype, b.shape, b.stride(), b.device), \
            f"{path}: {a.dtype} {tuple(a.shape)} {a.stride()} != {b.dtype} {tuple(b.shape)} {b.stride()}"
        assert a.contiguous().view(torch.uint8).numpy().tobytes() == \
            b.contiguous().view(torch.uint8).numpy().tobytes(), f"{path}: bytes differ\n{a}\n{b}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_identical(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert_same_batches(a, b, path)


def both(dataset, seed=None, **kwargs):
    """Same dataset through both loaders; `seed`: shuffle with a fresh generator each."""
    kwargs.setdefault("batch_size", 8)
    if seed is not None:
        kwargs.update(shuffle=True, generator=torch.Generator().manual_seed(seed))
    torch_batches = [clone_batch(b) for b in collect(TorchLoader(dataset, **kwargs))]
    if seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    fast_batches = collect(FastLoader(dataset, **kwargs))
    assert len(torch_batches) == len(fast_batches)
    for i, (e, g) in enumerate(zip(torch_batches, fast_batches)):
        assert_identical(e, g, f"batch {i}")
    return fast_batches


def assert_torchs_error(dataset, **kwargs):
    """fastloader fails as torch does: same exception type, same last line."""
    expected, got = errors_of(dataset, **kwargs)
    assert type(got) is type(expected)
    assert str(expected).strip().splitlines()[-1] in str(got), (expected, got)


def errors_of(dataset, **kwargs):
    """(torch's error, fastloader's error) for a loader that must fail."""
    out = []
    for cls in (TorchLoader, FastLoader):
        with pytest.raises(Exception) as info:
            collect(cls(dataset, **kwargs))
        out.append(info.value)
    return out


WORKERS = dict(num_workers=2, multiprocessing_context="fork")


# ---- the C fill ----------------------------------------------------------------------

def test_numbers_and_arrays_are_filled_by_c():
    samples = [cd.NumbersDataset()[i] for i in range(6)]
    out = slot_collate(samples)
    kinds = [type(x).__name__ if not isinstance(x, DeferredStack) else x.how for x in out]
    # ints, floats, bools, both array columns and the 0-d arrays go through C
    assert kinds[:5] == [COLUMN] * 5 and out[6].how == COLUMN, kinds
    assert out[5]["u8"].how == COLUMN and out[5]["c"].how == COLUMN
    assert_identical(default_collate(samples), _core.decode(_core.encode(out)))


@pytest.mark.parametrize("nw", [0, 2])
def test_numbers_dataset_same_as_torch(nw):
    both(cd.NumbersDataset(), num_workers=nw, shuffle=False,
         **({"multiprocessing_context": "fork"} if nw else {}))


@needs_wide_unsigned   # a uint32 array column, which older torch cannot collate
def test_fallback_columns_same_as_torch():
    batches = both(cd.FallbackDataset(), **WORKERS)
    assert batches[0][0].dtype == torch.int64 and batches[0][1].dtype == torch.float32


@needs_wide_unsigned
def test_fallback_columns_are_not_filled_by_c():
    samples = [cd.FallbackDataset()[i] for i in range(8)]
    hows = [getattr(column, "how", None) for column in slot_collate(samples)]
    # the array rows and the two int64 columns at the edges of the range are the C
    # fill's; the rest torch's
    assert hows[3] == COLUMN and hows[5:] == [COLUMN, COLUMN], hows
    assert COLUMN not in hows[:3] + hows[4:5], hows


@pytest.mark.parametrize("kind", ["overflow", "shapes", "object", "byteorder"])
def test_unfillable_column_raises_torchs_error(kind):
    assert_torchs_error(cd.BadColumnDataset(kind), batch_size=8, **WORKERS)


class _OneBatchOfBytes(torch.utils.data.Dataset):
    """A dataset whose item is a whole batch held in a bytes-like object."""
    def __init__(self, kind):
        self.kind = kind

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return self.kind(b"\x01\x02\x03")


def test_a_bytes_batch_raises_torchs_error():
    # default_collate of a bytes object: torch.tensor() refuses bytes; the C fill
    # stacked its ints
    assert_torchs_error(_OneBatchOfBytes(bytes), batch_size=None,
                        collate_fn=default_collate, **WORKERS)


def test_a_bytearray_batch_same_as_torch():
    both(_OneBatchOfBytes(bytearray), batch_size=None, collate_fn=default_collate,
         **WORKERS)


def test_column_kind_and_fill_column_refuse_mismatches():
    assert _core.column_kind([1, 2, 3]) == 1
    assert _core.column_kind([1.0, 2.0]) == 2
    assert _core.column_kind([True, False]) == 3
    assert _core.column_kind([np.zeros(2), np.zeros(2)]) == 4
    for column in ([1, True], [1, 2.0], [2**63], [np.zeros(2), np.zeros(3)],
                   [np.zeros(2), np.zeros(2, np.float32)], [np.zeros(2, ">f8")], [],
                   [np.array([1], dtype=object)], [np.int64(1)]):
        assert _core.column_kind(column) == 0, column
    dest = np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError):
        _core.fill_column([1, 2, 3], dest)       # would write past the end
    with pytest.raises(ValueError):
        _core.fill_column([1, True], dest)       # not a column the fill may take
    with pytest.raises(ValueError):
        _core.fill_column([1, 2], dest[::2])     # not contiguous


_NOT_WRITABLE = "The given NumPy array is not writable"


def _warnings_of_an_epoch(loader_module, context, dataset="ReadOnlyArraysDataset"):
    """(stdout, the not-writable warning lines) of a fresh process that runs one
    epoch of `dataset` with 2 workers: torch warns once per process, so it must be
    a process of its own. stdout: the batches' sums, or the error's type and last
    line (fastloader's first line also names the batch)."""
    code = (f"from {loader_module} import DataLoader\n"
            f"from tests.support.collate_datasets import {dataset} as Dataset\n"
            "loader = DataLoader(Dataset(), batch_size=8, num_workers=2,\n"
            f"                    multiprocessing_context={context!r})\n"
            "try:\n"
            "    print([[float(column.sum()) for column in batch] for batch in loader])\n"
            "except Exception as error:\n"
            "    print(type(error).__name__, str(error).strip().splitlines()[-1])\n")
    run = run_python(code, timeout=300)
    return run.stdout, [line for line in run.stderr.splitlines() if _NOT_WRITABLE in line]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_an_array_that_is_not_writable_warns_in_every_worker_as_with_torch(context):
    """The C fill never calls torch.as_tensor, so torch's warning (once per worker
    process, pointing into torch's collate) was lost."""
    torch_run = _warnings_of_an_epoch("torch.utils.data", context)
    assert len(torch_run[1]) == 2, torch_run
    assert _warnings_of_an_epoch("fastloader", context) == torch_run


@pytest.mark.parametrize("dataset, warnings_per_run", [
    ("ReadOnlyCollatedDataset", 2),       # rows of a collated batch: once per worker
    ("ReadOnlyAfterBadStackDataset", 0),  # torch stops at the stack error first
])
def test_the_not_writable_warning_comes_where_torchs_does(dataset, warnings_per_run):
    torch_run = _warnings_of_an_epoch("torch.utils.data", "fork", dataset)
    assert len(torch_run[1]) == warnings_per_run, torch_run
    assert _warnings_of_an_epoch("fastloader", "fork", dataset) == torch_run


def test_the_warning_is_not_spent_on_an_array_made_writable_meanwhile(monkeypatch):
    """column_kind saw a read-only array that another thread made writable before
    the collate looked for it: nothing is warned, and the next one still warns."""
    from fastloader import collate
    monkeypatch.setattr(collate, "_readonly_warned", False)
    collate._warn_as_torch_about_readonly([np.zeros(2)])
    assert collate._readonly_warned is False


def test_a_column_with_an_array_that_is_not_writable_is_still_filled_by_c():
    samples = [cd.ReadOnlyArraysDataset()[i] for i in range(8)]
    assert _core.column_kind([rows for rows, _ in samples]) == 5
    assert _core.column_kind([rows for rows, _ in samples[:3]]) == 4
    with warnings.catch_warnings():   # checked per process, above
        warnings.filterwarnings("ignore", message=_NOT_WRITABLE)
        out = slot_collate(samples)
        assert out[0].how == COLUMN
        assert_identical(default_collate(samples), _core.decode(_core.encode(out)))
        both(cd.ReadOnlyArraysDataset(), **WORKERS)


# ---- plain tuple samples, transposed in C --------------------------------------------

def test_transpose_tuples_takes_plain_tuples_of_one_length_only():
    a, b = torch.zeros(2), torch.ones(2)
    columns = _core.transpose_tuples([(a, 1, "x"), (b, 2, "y")])
    assert columns == [(a, b), (1, 2), ("x", "y")]
    assert columns[0][0] is a and columns[0][1] is b
    assert _core.transpose_tuples([(), ()]) == []
    for batch in ([], [(1, 2), (3,)], [(1, 2), [3, 4]], [[1, 2], [3, 4]],
                  [cd.Pair(1, 2), (3, 4)], [(1, 2), cd.Pair(3, 4)], ((1, 2), (3, 4)),
                  [(1, 2), None], None, "ab"):
        assert _core.transpose_tuples(batch) is None, batch


def _spy(monkeypatch, name):
    """Record what fastloader.collate's _core.<name> returns."""
    from fastloader import collate
    returned = []
    real = getattr(_core, name)

    def spy(batch):
        returned.append(real(batch))
        return returned[-1]
    monkeypatch.setattr(collate._core, name, spy)
    return returned


def test_plain_tuple_batch_is_transposed_in_c_and_collates_as_torch(monkeypatch):
    samples = [cd.TupleSamplesDataset("plain")[i] for i in range(6)]
    transposed = _spy(monkeypatch, "transpose_tuples")
    out = slot_collate(samples)
    assert len(transposed) == 1 and transposed[0] is not None   # the C path ran
    assert type(out) is list and len(out) == len(samples[0])
    assert isinstance(out[0], DeferredStack) and out[1].how == COLUMN
    assert_identical(default_collate(samples), _core.decode(_core.encode(out)))


SAME_AS_TORCH = [("tuple", k) for k in ("plain", "namedtuple_first", "namedtuple_later",
                                        "list_later", "subclass_later")] + \
                [("dict", k) for k in ("plain", "key_order", "extra_keys", "int_keys",
                                       "ordered_later")]
TORCH_REFUSES = [("tuple", "ragged"), ("tuple", "uncollatable"), ("dict", "missing_key"),
                 ("dict", "uncollatable")] + \
                [(shape, "long_row_then_uncollatable") for shape in ("tuple", "dict")] + \
                [("tuple", "list_long_row_then_uncollatable"),
                 ("dict", "nested_long_row_then_uncollatable")] + \
                [("tuple", k) for k in ("short_row", "int_among_rows", "array_among_rows",
                                        "negative_stride_arrays", "odd_stride_arrays")]
_SAMPLES = {"tuple": cd.TupleSamplesDataset, "dict": cd.DictSamplesDataset}


@pytest.mark.parametrize("shape,kind", SAME_AS_TORCH)
def test_tuple_and_dict_samples_same_as_torch(shape, kind):
    both(_SAMPLES[shape](kind), **WORKERS)


@pytest.mark.parametrize("shape,kind", TORCH_REFUSES)
def test_tuple_and_dict_samples_torch_refuses_raise_torchs_error(shape, kind):
    assert_torchs_error(_SAMPLES[shape](kind), batch_size=8, **WORKERS)


def test_samples_nested_deeper_than_the_codec_goes_same_as_torch():
    both(cd.DeepDataset(depth=300), **WORKERS)


def test_transpose_dicts_takes_plain_dicts_with_str_keys_only():
    a, b = torch.zeros(2), torch.ones(2)
    keys, columns = _core.transpose_dicts([{"x": a, "y": 1}, {"y": 2, "x": b, "z": 0}])
    assert keys == ["x", "y"] and columns == [[a, b], [1, 2]]
    assert columns[0][0] is a and columns[0][1] is b
    assert _core.transpose_dicts([{}, {"z": 1}]) == ([], [])
    for batch in ([], [{"x": 1}, {"y": 2}], [{1: 1}, {1: 2}], [{"x": 1}, {"x": 2, 3: 4}],
                  [{"x": 1}, collections.OrderedDict(x=2)], [collections.OrderedDict(x=1)],
                  [{"x": 1}, None], ({"x": 1},), None, [(1, 2)]):
        assert _core.transpose_dicts(batch) is None, batch


def test_plain_dict_batch_is_gathered_in_c_and_collates_as_torch(monkeypatch):
    samples = [cd.DictSamplesDataset("plain")[i] for i in range(6)]
    gathered = _spy(monkeypatch, "transpose_dicts")
    out = slot_collate(samples)
    assert len(gathered) == 1 and gathered[0] is not None   # the C path ran
    assert type(out) is dict and list(out) == list(samples[0])
    assert isinstance(out["x"], DeferredStack) and out["label"].how == COLUMN
    assert_identical(default_collate(samples), _core.decode(_core.encode(out)))




# ---- functions registered in torch's default_collate_fn_map -----------------------

@pytest.fixture
def torch_collate_map():
    """torch's default_collate_fn_map, as a user may change it after importing
    fastloader (restored afterwards)."""
    saved = dict(default_collate_fn_map)
    yield default_collate_fn_map
    default_collate_fn_map.clear()
    default_collate_fn_map.update(saved)


def test_a_type_registered_after_import_collates_as_torch(torch_collate_map):
    torch_collate_map[cd.Box] = cd.collate_boxes
    batches = both(cd.BoxDataset(), **WORKERS)
    assert batches[1][0].tolist() == [80, 90, 100, 110, 120, 130, 140, 150]


@pytest.mark.parametrize("dataset", ["tuples", "dicts", "collated", "tensor_dataset"])
def test_a_replaced_tensor_function_is_used_as_torch_uses_it(torch_collate_map, dataset):
    torch_collate_map[torch.Tensor] = cd.stack_times_ten
    made = {"tuples": lambda: cd.TupleSamplesDataset("plain"),
            "dicts": lambda: cd.DictSamplesDataset("plain"),
            "collated": lambda: cd.BatchedDataset("tuple"),
            "tensor_dataset": _tensor_dataset}[dataset]
    both(made(), **WORKERS)


def test_a_replaced_int_function_is_used_as_torch_uses_it(torch_collate_map):
    torch_collate_map[int] = cd.ints_as_float32
    batches = both(cd.NumbersDataset(), **WORKERS)
    assert batches[0][0].dtype == torch.float32


def test_a_function_that_claims_tuples_is_used_as_torch_uses_it(torch_collate_map):
    torch_collate_map[tuple] = cd.claim_tuples
    batches = both(cd.TupleSamplesDataset("plain"), **WORKERS)
    assert batches[0] == {"tuples": 8, "fields": 11}


def test_a_function_claiming_rows_is_used_for_collated_and_gathered_batches(torch_collate_map):
    # the rows of a CollatedSamples batch and of a TensorDataset are tuples
    torch_collate_map[tuple] = cd.claim_tuples
    both(cd.BatchedDataset("tuple"), **WORKERS)
    both(_tensor_dataset(), **WORKERS)


def test_a_replaced_scalar_function_is_used_for_collated_array_rows(torch_collate_map):
    key = next(k for k in torch_collate_map if isinstance(k, tuple) and np.number in k)
    torch_collate_map[key] = cd.scalars_times_hundred
    batches = both(cd.ArrayRowsDataset(), **WORKERS)
    assert batches[1][0].tolist() == [200.0 + 25 * i for i in range(8)]


def test_a_registered_function_gets_torchs_map_and_real_tensors(torch_collate_map):
    torch_collate_map[cd.Box] = cd.boxes_through_collate
    batches = both(cd.BoxDataset(), **WORKERS)
    assert batches[0][0].tolist() == [[0], [10], [20], [30], [40], [50], [60], [70]]


def test_the_maps_order_is_followed_as_torch_follows_it(torch_collate_map):
    torch_collate_map[numbers.Number] = cd.number_fn
    batch = [(True, 1), (False, 2)]
    assert_identical(default_collate(batch), _core.decode(_core.encode(slot_collate(batch))))
    int_fn = torch_collate_map.pop(int)
    torch_collate_map[int] = int_fn     # same entries, int's now after Number's
    assert default_collate(batch)[0].tolist() == [7, 7]
    assert_identical(default_collate(batch), _core.decode(_core.encode(slot_collate(batch))))


def test_a_key_isinstance_refuses_breaks_only_what_it_breaks_in_torch(torch_collate_map):
    torch_collate_map[list[int]] = cd.generic_fn
    # a tensor is in the map: collate() never reaches the key
    both(cd.TensorSamplesDataset(), **WORKERS)
    # a tuple is not: collate()'s isinstance loop reaches it and raises
    assert_torchs_error(cd.TupleSamplesDataset("plain"), batch_size=8, **WORKERS)


def test_a_dict_column_that_raises_typeerror_is_collated_as_often_as_in_torch(torch_collate_map):
    # torch's collate() retries a dict batch once, another way, after a TypeError
    torch_collate_map[cd.Box] = cd.refuse_boxes
    samples = [{"x": torch.zeros(2), "box": cd.Box(i)} for i in range(4)]
    calls = []
    for collate in (default_collate, slot_collate):
        cd.refuse_boxes.calls = 0
        with pytest.raises(TypeError, match="boxes refused"):
            collate(samples)
        calls.append(cd.refuse_boxes.calls)
    assert calls == [2, 2]


def test_transpose_dicts_reads_the_first_sample_after_its_copy():
    """A finalizer run by the garbage collector during transpose_dicts' first
    allocation replaces the caller's first sample: the call sees its own copy or
    declines, and never fails."""
    batch = [{"a": 1}, {"a": 2}]

    class Replaces:
        def __del__(self):
            batch[0] = 5

    thresholds = gc.get_threshold()
    gc.disable()
    try:
        garbage = Replaces()
        garbage.cycle = garbage
        del garbage
        pending = [[] for _ in range(100)]   # allocations counted towards the next collection
        gc.set_threshold(1)
        gc.enable()
        got = _core.transpose_dicts(batch)
    finally:
        gc.set_threshold(*thresholds)
        gc.enable()
    del pending
    assert batch[0] == 5, "the finalizer did not run during the call"
    assert got is None or got == (["a"], [[1, 2]]), got


def test_the_c_paths_come_back_when_torchs_map_is_restored(torch_collate_map):
    samples = [cd.TupleSamplesDataset("plain")[i] for i in range(4)]
    torch_collate_map[torch.Tensor] = cd.stack_times_ten
    assert type(slot_collate(samples)[0]) is torch.Tensor   # the user's function ran
    del torch_collate_map[torch.Tensor]
    torch_collate_map[torch.Tensor] = torch.utils.data._utils.collate.collate_tensor_fn
    assert isinstance(slot_collate(samples)[0], DeferredStack)


# ---- CollatedSamples -----------------------------------------------------------------

SHAPES = ["tuple", "list", "namedtuple", "nested"]


@pytest.mark.parametrize("shape", SHAPES)
def test_torch_collates_collated_samples_like_the_samples(shape):
    # torch's own DataLoader: __getitems__ returning CollatedSamples == per-sample
    kwargs = dict(batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    plain = collect(TorchLoader(cd.BatchedDataset(shape, batched=False), **kwargs))
    kwargs["generator"] = torch.Generator().manual_seed(3)
    batched = collect(TorchLoader(cd.BatchedDataset(shape), **kwargs))
    assert len(plain) == len(batched)
    for e, g in zip(plain, batched):
        assert_identical(e, g)


@pytest.mark.parametrize("shape", SHAPES)
def test_collated_samples_same_as_torch(shape):
    both(cd.BatchedDataset(shape), seed=5, **WORKERS)


def test_collated_samples_are_copied_without_per_sample_python():
    cs = cd.BatchedDataset("nested").__getitems__([3, 1, 4, 1, 5])
    out = slot_collate(cs)
    assert out["x"][0].how == COPY and out["x"][1]["np2"].how == COLUMN
    assert out["y"][0].how == COPY and out["y"][1].how == COLUMN
    assert_identical(default_collate(cs), _core.decode(_core.encode(out)))


def test_collated_samples_requires_grad_takes_torchs_path():
    cs = cd.RequiresGradBatched().__getitems__([0, 1])
    assert getattr(slot_collate(cs)[0], "how", None) != COPY
    expected, got = errors_of(cd.RequiresGradBatched(), batch_size=4, **WORKERS)
    assert type(got) is type(expected)


def test_custom_collate_gets_collated_samples():
    batches = both(cd.BatchedDataset("tuple"), collate_fn=cd.describe_collate, **WORKERS)
    assert batches[0]["type"] == "CollatedSamples" and batches[0]["len"] == 8


def test_collated_samples_sequence():
    features = torch.arange(10.0).view(5, 2)
    cs = CollatedSamples({"f": features, "n": np.arange(5), "t": (features, [features])})
    assert len(cs) == 5 and cs.batch["f"] is features
    item = cs[-1]
    assert type(item["t"]) is tuple and type(item["t"][1]) is list
    assert torch.equal(item["f"], features[4]) and item["n"] == 4
    assert [s["n"] for s in cs] == list(range(5)) and len(cs[1:3]) == 2
    with pytest.raises(IndexError):
        cs[5]
    with pytest.raises(ValueError, match=r"batch\[1\] has 3 rows"):
        CollatedSamples((features, features[:3]))
    with pytest.raises(TypeError, match="str"):
        CollatedSamples((features, "label"))
    with pytest.raises(ValueError, match="0-dimensional"):
        CollatedSamples((torch.tensor(1.0),))
    with pytest.raises(TypeError, match="in a tuple"):
        CollatedSamples(features)   # torch.stack would refuse the Sequence itself
    with pytest.raises(ValueError, match="no tensor"):
        CollatedSamples({})


# ---- TensorDataset -------------------------------------------------------------------

_UINT16 = getattr(torch, "uint16", None)   # torch 2.3


def _tensor_dataset():
    """Six tensors, one of them uint16 (which index_select has no kernel for: such a
    dataset is not gathered) where torch has the dtype."""
    g = torch.Generator().manual_seed(11)
    n = 37
    tensors = [torch.randn(n, 3, generator=g), torch.arange(n), torch.arange(n) % 2 == 0,
               torch.randn(2, n, generator=g).t(), torch.randn(n, generator=g).double()]
    if HAS_WIDE_UNSIGNED:
        tensors.insert(4, torch.arange(n).to(_UINT16))
    return TensorDataset(*tensors)


@pytest.mark.parametrize("drop_last", [False, True])
def test_tensor_dataset_same_as_torch(drop_last):
    both(_tensor_dataset(), seed=2, drop_last=drop_last, **WORKERS)


def test_tensor_dataset_is_gathered():
    if HAS_WIDE_UNSIGNED:
        assert _tensor_dataset_batch(_tensor_dataset(), [4, 0]) is None   # uint16: no index_select
    ds = TensorDataset(*[t for t in _tensor_dataset().tensors if t.dtype != _UINT16])
    out = _tensor_dataset_batch(ds, [4, 0, 36])
    assert [s.how for s in out] == [GATHER] * 5
    assert_identical(default_collate([ds[i] for i in (4, 0, 36)]), _core.decode(_core.encode(out)))
    for indices in ([-1, 2], [37], [1, True], (1, 2)):
        assert _tensor_dataset_batch(ds, indices) is None, indices


@pytest.mark.parametrize("drop_last", [False, True])
def test_gathered_tensor_dataset_same_as_torch(drop_last):
    ds = TensorDataset(*[t for t in _tensor_dataset().tensors if t.dtype != _UINT16])
    both(ds, seed=4, drop_last=drop_last, **WORKERS)


def _times_ten(self, index):
    return tuple(t[index] * 10 for t in self.tensors)


@pytest.mark.parametrize("how", ["patched class", "__getitems__"])
def test_a_tensor_dataset_whose_samples_are_not_torchs_is_not_gathered(how, monkeypatch):
    """A TensorDataset whose class's __getitem__ a user replaced (an augmentation),
    or that has a __getitems__ (torch's fetcher calls that instead): its batches are
    what torch's fetcher makes, not a gather of the tensors (it used to be gathered
    all the same: the augmentation was silently skipped)."""
    ds = TensorDataset(torch.arange(12), torch.arange(12).double())
    if how == "patched class":
        monkeypatch.setattr(TensorDataset, "__getitem__", _times_ten)
    else:
        ds.__getitems__ = lambda indices: [_times_ten(ds, i) for i in indices]
    assert _tensor_dataset_batch(ds, [1, 2]) is None
    batches = both(ds, seed=6, **WORKERS)
    assert sorted(int(x) for b in batches for x in b[0]) == list(range(0, 120, 10))


def test_only_torchs_own_tensor_dataset_getitem_counts_as_torchs():
    """A replacement made with functools.wraps carries torch's __module__ and name:
    patched before fastloader's import, it used to pass for torch's own."""
    from fastloader.batch_fetch import _torchs_own
    torchs = TensorDataset.__dict__["__getitem__"]
    assert _torchs_own(torchs)
    assert not _torchs_own(functools.wraps(torchs)(_times_ten))
    assert not _torchs_own(_times_ten)


def test_tensor_dataset_out_of_range_raises_torchs_error():
    ds = _tensor_dataset()
    expected, got = errors_of(ds, batch_sampler=[[0, 40]], **WORKERS)
    assert type(got) is type(expected)
    assert str(expected).strip().splitlines()[-1] in str(got)


def test_tensor_dataset_negative_index_same_as_torch():
    both(_tensor_dataset(), batch_sampler=[[-1, 0, -37]], batch_size=1, **WORKERS)


def test_batch_sampler_with_batch_size_none_same_as_torch():
    # the torch-native pattern of the README: the dataset's __getitem__ takes a list
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(45)), 8,
                                            drop_last=False)
    both(cd.BatchedDataset("nested", batched=False), batch_size=None, sampler=sampler, **WORKERS)
