"""fastloader.DataLoader yields exactly what torch.utils.data.DataLoader yields.

Every test builds the same loader twice from a factory (fresh generator, fresh
samplers, so neither loader sees RNG state the other consumed), iterates torch's
and fastloader's, and compares batch lists with `assert_same_batches`: same
types at every level, dtypes, shapes, values, dict key order.

The matrix runs under "fork" (cheap); "spawn" and "forkserver" (2-5 s per loader
lifetime on a 2-core box, since every worker imports torch) get a few loaders that
each exercise the whole codec at once.
"""
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing
import torch.utils.data
from torch.utils.data import (
    BatchSampler, DistributedSampler, RandomSampler, SequentialSampler,
    SubsetRandomSampler, WeightedRandomSampler,
)

import fastloader
from tests.support import datasets as ds
from tests.support import torch_features as tf
from tests.support.helpers import assert_same_batch_lists, assert_same_batches, clone_batch, collect

pytestmark = [
    # torch warns when num_workers exceeds the CPUs it may use (3 workers on a 2-core box).
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

TorchLoader = torch.utils.data.DataLoader
FastLoader = fastloader.DataLoader
STRATEGIES = ("file_descriptor", "file_system")



def run_both(make_kwargs, strategy, epochs=1, what=""):
    """Iterate torch's and fastloader's loader built from make_kwargs(); compare."""
    expected = run_torch(make_kwargs, epochs)
    got = run_fast(make_kwargs, strategy, epochs)
    assert_same_batch_lists(expected, got, what or strategy)


def run_torch(make_kwargs, epochs=1):
    loader = TorchLoader(**make_kwargs())
    out = [clone_batch(b) for _ in range(epochs) for b in collect(loader, what="torch")]
    del loader
    return out


def run_fast(make_kwargs, strategy, epochs=1):
    loader = FastLoader(**make_kwargs(), sharing_strategy=strategy)
    assert isinstance(loader, TorchLoader)
    out = [b for _ in range(epochs) for b in collect(loader, what=f"fastloader {strategy}")]
    del loader
    return out


def test_comparator_is_strict():
    """assert_same_batches must itself catch what the tests rely on it to catch."""
    ok = {"a": torch.ones(2), "b": ds.Sample(torch.zeros(1), 1, "x"), "c": np.float64(1.0)}
    assert_same_batches(ok, clone_batch(ok))
    wrong = [
        {"b": ok["b"], "a": ok["a"], "c": ok["c"]},                        # key order
        {**ok, "a": torch.ones(2, dtype=torch.float64)},                   # dtype
        {**ok, "a": torch.ones(1, 2)},                                     # shape
        {**ok, "a": torch.tensor([1.0, 2.0])},                             # values
        {**ok, "b": tuple(ok["b"])},                                       # namedtuple -> tuple
        {**ok, "c": 1.0},                                                  # np.float64 -> float
        {**ok, "b": ds.Sample(torch.zeros(1), True, "x")},                 # int -> bool
        {**ok, "b": ds.Sample(torch.zeros(1), 1, b"x")},                   # str -> bytes
    ]
    for other in wrong:
        with pytest.raises(AssertionError):
            assert_same_batches(ok, other)
    a, b = ds.Batch(torch.ones(2), torch.zeros(2), [1]), ds.Batch(torch.ones(2), torch.ones(2), [1])
    with pytest.raises(AssertionError):
        assert_same_batches(a, b)


# ---- the fork matrix -----------------------------------------------------------------
#
# Every dataset x every batching x {sequential, seeded shuffle}.  The worker count
# (1..3) and the sharing strategy rotate over each dataset's cells so that every dataset
# meets all six (num_workers, strategy) pairs; RandomDataset, whose batches depend on
# which worker computed them, gets the full product.  FASTLOADER_FULL_MATRIX=1 runs the
# full product for every dataset (about 6x longer; too slow for a 2-core box).

DATASETS = {
    "tensor": (ds.TensorLabelDataset, None),
    "numpy": (ds.NumpyDataset, None),
    "dict": (ds.MixedDictDataset, None),
    "str": (ds.StringDataset, None),
    "namedtuple": (ds.NamedTupleDataset, None),
    "nested": (ds.NestedDataset, None),
    "dtypes": (ds.DtypesDataset, None),
    "random": (ds.RandomDataset, None),
    "varlen_pad": (ds.VarLenDataset, ds.pad_collate),
    "batch_object": (ds.TensorLabelDataset, ds.batch_object_collate),
    "edge": (ds.TensorLabelDataset, ds.edge_collate),
}
BATCHING = {
    "bs4": dict(batch_size=4, drop_last=False),      # 22 samples: last batch has 2
    "bs4_drop": dict(batch_size=4, drop_last=True),
    "bs1": dict(batch_size=1),
    "unbatched": dict(batch_size=None),              # no auto-collation: default_convert
}
WORKER_STRATEGY_PAIRS = [(nw, s) for s in STRATEGIES for nw in (1, 2, 3)]
FULL_MATRIX = os.environ.get("FASTLOADER_FULL_MATRIX", "") not in ("", "0")


def _matrix():
    params = []
    for d_index, (dname, (_, collate)) in enumerate(DATASETS.items()):
        cells = [(bname, seed) for bname in BATCHING for seed in (None, 1234)
                 if not (bname == "unbatched" and collate is not None)]
        # a batch collate_fn applied to single samples is meaningless: no "unbatched" there
        for k, (bname, seed) in enumerate(cells):
            if FULL_MATRIX or dname == "random":
                pairs = WORKER_STRATEGY_PAIRS
            else:
                pairs = [WORKER_STRATEGY_PAIRS[(k + d_index) % len(WORKER_STRATEGY_PAIRS)]]
            for nw, strategy in pairs:
                sid = "seq" if seed is None else f"shuffle{seed}"
                params.append(pytest.param(dname, bname, seed, nw, strategy,
                                           id=f"{dname}-{bname}-{sid}-w{nw}-{strategy}"))
    return params


_reference_cache = {}


def _reference(key, make_kwargs, uses):
    """torch's batches for one matrix cell, computed once and reused by the other
    sharing strategy (cloned, so the cache pins no shared memory)."""
    entry = _reference_cache.get(key)
    if entry is None:
        entry = _reference_cache[key] = [run_torch(make_kwargs), 0]
    entry[1] += 1
    if entry[1] >= uses:
        del _reference_cache[key]
    return entry[0]


@pytest.mark.parametrize("dname,bname,seed,nw,strategy", _matrix())
def test_fork_matrix(dname, bname, seed, nw, strategy):
    dataset_cls, collate = DATASETS[dname]

    def make_kwargs():
        kw = dict(dataset=dataset_cls(), num_workers=nw, multiprocessing_context="fork",
                  # the generator also draws the workers' base seed, shuffled or not
                  generator=torch.Generator().manual_seed(seed or 77), **BATCHING[bname])
        if collate is not None:
            kw["collate_fn"] = collate
        if seed is not None:
            kw["shuffle"] = True
        return kw

    uses = len(STRATEGIES) if (FULL_MATRIX or dname == "random") else 1
    expected = _reference((dname, bname, seed, nw), make_kwargs, uses)
    got = run_fast(make_kwargs, strategy)
    assert_same_batch_lists(expected, got, f"{dname}/{bname}/{seed}/w{nw}/{strategy}")


# ---- spawn and forkserver: few loaders, each exercising everything --------------------
#
# torch's output does not depend on the start method (it seeds workers from the base
# seed and worker id alone), so torch's reference runs under "fork" here: a spawn or
# forkserver lifetime costs 2-5 s on a 2-core box, and only fastloader's needs checking.

@pytest.mark.parametrize("ctx,nw", [("spawn", 2), ("forkserver", 1)])
def test_everything_dataset_other_start_methods(ctx, nw):
    def make_kwargs(context):
        return lambda: dict(dataset=ds.EverythingDataset(), batch_size=4, shuffle=True,
                            generator=torch.Generator().manual_seed(11), num_workers=nw,
                            multiprocessing_context=context)

    expected = run_torch(make_kwargs("fork"))
    assert len(expected) == 6
    for strategy in STRATEGIES:
        got = run_fast(make_kwargs(ctx), strategy)
        assert_same_batch_lists(expected, got, f"{ctx}/{strategy}")


@pytest.mark.parametrize("ctx,nw,strategy", [("spawn", 1, "file_system"),
                                             ("forkserver", 3, "file_descriptor")])
def test_custom_object_collate_other_start_methods(ctx, nw, strategy):
    def make_kwargs(context):
        return lambda: dict(dataset=ds.VarLenDataset(), batch_size=3, drop_last=True,
                            collate_fn=ds.padded_object_collate, num_workers=nw,
                            prefetch_factor=1, worker_init_fn=ds.set_offset_worker_init,
                            multiprocessing_context=context)

    expected = run_torch(make_kwargs("fork"))
    got = run_fast(make_kwargs(ctx), strategy)
    assert_same_batch_lists(expected, got, f"{ctx}/{strategy}")


# ---- samplers, batch samplers, loader options (fork) ---------------------------------

def _g(seed):
    return torch.Generator().manual_seed(seed)


SAMPLER_CASES = {
    "subset_random": lambda d: dict(
        sampler=SubsetRandomSampler(list(range(1, ds.N, 2)), generator=_g(3)), batch_size=3),
    "weighted": lambda d: dict(
        sampler=WeightedRandomSampler([1.0 + (i % 3) for i in range(ds.N)], num_samples=15,
                                      replacement=True, generator=_g(4)), batch_size=4),
    "distributed": lambda d: dict(
        sampler=DistributedSampler(d, num_replicas=2, rank=1, shuffle=True, seed=7),
        batch_size=3, drop_last=True),
    "sequential_drop_last": lambda d: dict(
        sampler=SequentialSampler(d), batch_size=5, drop_last=True),
    "batch_sampler_random": lambda d: dict(
        batch_sampler=BatchSampler(RandomSampler(d, generator=_g(5)), 3, drop_last=False)),
    "batch_sampler_variable": lambda d: dict(batch_sampler=ds.VariableBatchSampler()),
    "random_sampler_replacement": lambda d: dict(
        sampler=RandomSampler(d, replacement=True, num_samples=30, generator=_g(6)),
        batch_size=4),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", list(SAMPLER_CASES))
def test_samplers(case, strategy):
    def make_kwargs():
        dataset = ds.RandomDataset()
        return dict(dataset=dataset, num_workers=2, multiprocessing_context="fork",
                    generator=_g(99),  # draws the workers' base seed
                    **SAMPLER_CASES[case](dataset))

    run_both(make_kwargs, strategy, what=case)


@pytest.mark.parametrize("prefetch_factor,nw,strategy", [
    (1, 1, "file_descriptor"), (1, 3, "file_system"), (2, 2, "file_descriptor"),
    (4, 2, "file_system"), (8, 3, "file_descriptor"),
])
def test_prefetch_factor(prefetch_factor, nw, strategy):
    def make_kwargs():
        return dict(dataset=ds.RandomDataset(n=40), batch_size=3, shuffle=True,
                    generator=_g(prefetch_factor), num_workers=nw,
                    prefetch_factor=prefetch_factor, timeout=60,
                    multiprocessing_context="fork")

    run_both(make_kwargs, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_persistent_workers_two_epochs(strategy):
    """Epoch 2 reuses the workers: their RNG streams continue, the sampler reshuffles."""
    def make_kwargs():
        return dict(dataset=ds.RandomDataset(), batch_size=4, shuffle=True, generator=_g(21),
                    num_workers=2, persistent_workers=True, multiprocessing_context="fork")

    expected = run_torch(make_kwargs, epochs=2)
    got = run_fast(make_kwargs, strategy, epochs=2)
    assert len(expected) == 12
    assert_same_batch_lists(expected, got, strategy)
    # the two epochs really differ (the test would be vacuous otherwise)
    assert not torch.equal(got[0]["index"], got[6]["index"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_global_seed_without_generator(strategy):
    """No generator: the base seed and the permutation come from torch's global RNG,
    and must be drawn in the same order as torch draws them."""
    def run(cls, **extra):
        torch.manual_seed(987)
        loader = cls(ds.RandomDataset(), batch_size=4, shuffle=True, num_workers=2,
                     multiprocessing_context="fork", **extra)
        out = [clone_batch(b) for b in collect(loader)]
        after = torch.randint(0, 2 ** 30, (1,)).item()  # global RNG consumed identically
        return out, after

    expected, expected_after = run(TorchLoader)
    got, got_after = run(FastLoader, sharing_strategy=strategy)
    assert_same_batch_lists(expected, got, strategy)
    assert got_after == expected_after, "fastloader consumed the global RNG differently"


@tf.needs_in_order
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_in_order_false_same_batches(strategy):
    """in_order=False may reorder batches but never changes their content."""
    def make_kwargs():
        return dict(dataset=ds.IndexEncodedDataset(n=ds.N, width=3), batch_size=3,
                    num_workers=3, in_order=False, multiprocessing_context="fork")

    def key(batch):
        return int(batch[1][0])

    expected = sorted(run_torch(make_kwargs), key=key)
    got = sorted(run_fast(make_kwargs, strategy), key=key)
    assert_same_batch_lists(expected, got, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_worker_init_fn(strategy):
    def make_kwargs():
        return dict(dataset=ds.OffsetDataset(), batch_size=3, num_workers=2,
                    worker_init_fn=ds.set_offset_worker_init, multiprocessing_context="fork")

    expected = run_torch(make_kwargs)
    assert {int(b[0, 1]) for b in expected} == {1000, 2000}  # the init fn really ran
    assert_same_batch_lists(expected, run_fast(make_kwargs, strategy), strategy)


@pytest.mark.parametrize("nw,batch_size,strategy", [
    (2, 4, "file_descriptor"), (3, None, "file_system"), (1, 5, "file_system"),
])
def test_iterable_dataset(nw, batch_size, strategy):
    def make_kwargs():
        return dict(dataset=ds.ShardedIterableDataset(), batch_size=batch_size,
                    num_workers=nw, multiprocessing_context="fork")

    run_both(make_kwargs, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_positional_arguments(strategy):
    """Same positional order as torch: dataset, batch_size, shuffle, sampler, batch_sampler,
    num_workers, collate_fn, pin_memory, drop_last, timeout, worker_init_fn,
    multiprocessing_context, generator."""
    def args():
        return (ds.TensorLabelDataset(), 4, True, None, None, 2, ds.edge_collate, False,
                True, 0, None, "fork", _g(8))

    expected = [clone_batch(b) for b in collect(TorchLoader(*args()))]
    got = collect(FastLoader(*args(), sharing_strategy=strategy))
    assert_same_batch_lists(expected, got, strategy)


@pytest.mark.parametrize("dname", ["tensor", "dict", "edge", "random", "batch_object"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_num_workers_zero(dname, strategy):
    dataset_cls, collate = DATASETS[dname]

    def run(cls, **extra):
        torch.manual_seed(5)
        np.random.seed(5)
        import random
        random.seed(5)
        loader = cls(dataset_cls(), batch_size=4, shuffle=True, generator=_g(9),
                     collate_fn=collate, num_workers=0, **extra)
        return [clone_batch(b) for b in collect(loader)]

    assert_same_batch_lists(run(TorchLoader), run(FastLoader, sharing_strategy=strategy), dname)


# ---- constructor compatibility -------------------------------------------------------

def test_is_a_torch_dataloader_with_same_attributes():
    dataset = ds.TensorLabelDataset()
    kwargs = dict(batch_size=4, shuffle=True, num_workers=2, drop_last=True,
                  multiprocessing_context="fork", prefetch_factor=3, persistent_workers=True,
                  timeout=7, collate_fn=ds.pad_collate)
    ours = FastLoader(dataset, sharing_strategy="file_system", **kwargs)
    theirs = TorchLoader(dataset, **kwargs)
    assert isinstance(ours, TorchLoader)
    assert len(ours) == len(theirs) == 5
    for attr in ("dataset", "batch_size", "num_workers", "drop_last", "prefetch_factor",
                 "persistent_workers", "timeout", "collate_fn", "pin_memory",
                 "worker_init_fn", "generator", "in_order"):
        # in_order is torch 2.6's: where torch's loader has none, ours has none either
        missing = object()
        assert getattr(ours, attr, missing) == getattr(theirs, attr, missing), attr
    assert type(ours.sampler) is type(theirs.sampler)
    assert type(ours.batch_sampler) is type(theirs.batch_sampler)
    assert ours.multiprocessing_context.get_start_method() == "fork"


def _invalid_cases():
    d = ds.TensorLabelDataset()
    return {
        "batch_size_with_batch_sampler": dict(batch_size=4, batch_sampler=[[0, 1]]),
        "drop_last_with_batch_sampler": dict(drop_last=True, batch_sampler=[[0, 1]]),
        "shuffle_with_sampler": dict(shuffle=True, sampler=SequentialSampler(d)),
        "negative_workers": dict(num_workers=-1),
        "negative_timeout": dict(timeout=-1),
        "prefetch_without_workers": dict(prefetch_factor=2),
        "persistent_without_workers": dict(persistent_workers=True),
        "context_without_workers": dict(multiprocessing_context="fork"),
        "bad_context": dict(num_workers=2, multiprocessing_context="bogus"),
        "batch_size_none_drop_last": dict(batch_size=None, drop_last=True),
    }


@pytest.mark.parametrize("case", list(_invalid_cases()))
def test_validation_errors_match_torch(case):
    kwargs = _invalid_cases()[case]
    with pytest.raises(Exception) as theirs:
        TorchLoader(ds.TensorLabelDataset(), **kwargs)
    with pytest.raises(Exception) as ours:
        FastLoader(ds.TensorLabelDataset(), **kwargs)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value) == str(theirs.value)


def test_torch_global_sharing_strategy_untouched():
    before = torch.multiprocessing.get_sharing_strategy()
    for strategy in STRATEGIES:
        loader = FastLoader(ds.TensorLabelDataset(), batch_size=4, num_workers=1,
                            multiprocessing_context="fork", sharing_strategy=strategy)
        assert len(collect(loader)) == 6
        assert torch.multiprocessing.get_sharing_strategy() == before, strategy


def test_default_sharing_strategy_is_file_descriptor():
    """The default must behave like an explicit "file_descriptor" (and be accepted)."""
    def make_kwargs():
        return dict(dataset=ds.MixedDictDataset(), batch_size=4, num_workers=2,
                    multiprocessing_context="fork")

    expected = run_torch(make_kwargs)
    got = collect(FastLoader(**make_kwargs()))
    assert_same_batch_lists(expected, got, "default strategy")
