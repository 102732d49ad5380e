"""Conformance: every behaviour of torch.utils.data.DataLoader (torch 2.13), run under
torch's DataLoader and under fastloader's, with the same outcome asserted.

Each test is a *scenario*: a function of the loader class that builds loaders,
iterates them and returns what it observed. `conform` runs the scenario with
torch's class, then with fastloader's, and compares the two outcomes:

* the returned value, exactly (types at every level, dtypes, shapes, values, dict
  key order, dict-subclass attributes, defaultdict factories);
* the exception that escaped, if any: same type and same message;
* every warning raised meanwhile: same categories and messages, in the same order.

Known, intended differences are normalised, never ignored wholesale:

* an exception from a worker names ``in DataLoader worker process {id}`` under torch
  and ``in DataLoader worker process {id} (batch N, index ...)`` (or ``(in
  worker_init_fn)``) under fastloader, and
  the worker's traceback shows each library's own frames: messages are compared on
  the "Caught X in DataLoader worker process N" line, the frames of the user's code
  (file, line, function, source) and the exception lines;
* a dead worker raises ``RuntimeError`` under torch and ``fastloader.WorkerError`` (a
  RuntimeError subclass) with its own message under fastloader;
* warnings are compared by category, text and the file and line they point at
  (test_dropin checks that a filter on torch's module, which those decide, treats
  both alike);
* "Exception ignored in ..." reports (unraisable exceptions, e.g. from a __del__) are
  recorded: torch has some (its iterator's __del__ fails when its __init__ raised),
  fastloader must have none.

Start methods: everything runs under "fork"; a behaviour whose outcome could depend
on how workers start (seeding, WorkerInfo, worker_init_fn, replicas of iterable
datasets, persistent workers, the multiprocessing_context itself) also runs under
"spawn" and "forkserver". Those cost about a second per loader on a 2-core box, so
they get few, small loaders.
"""
import dataclasses
import gc
import inspect
import json
import multiprocessing
import os
import random
import re
import subprocess
import sys
import traceback
import typing
import uuid
import warnings

import numpy as np
import pytest
import torch
import torch.multiprocessing
import torch.utils.data
from torch.utils.data import (
    BatchSampler, DistributedSampler, RandomSampler, SequentialSampler, TensorDataset,
    get_worker_info,
)

import fastloader
from tests.support import conformance_datasets as cds
from tests.support import datasets as ds
from tests.support import torch_features as tf
from tests.support.helpers import assert_same_batches, deadline

TORCH = torch.utils.data.DataLoader
FAST = fastloader.DataLoader
START_METHODS = ("fork", "spawn", "forkserver")
# before torch.accelerator (torch 2.6), CUDA was the accelerator pinning used
HAS_ACCELERATOR = (torch.accelerator.is_available() if tf.HAS_ACCELERATOR_API
                   else torch.cuda.is_available())


# ======================================================================================
# Observing a scenario and comparing outcomes
# ======================================================================================

_WHERE_LINE = re.compile(
    r"^(Caught \w+ in DataLoader worker process \d+)(?: \((?:batch .*|in worker_init_fn|in the dataset's __iter__)\))?\.$")
_USER_FRAME = re.compile(r'^  File "(?:[^"]*/)?(conformance_datasets\.py|datasets\.py)", '
                         r"line (\d+), in (\S+)$")


def normalize_message(message):
    """A worker exception's message minus what legitimately differs between the two
    loaders: fastloader's "(batch N, index ...)" suffix on the where-line and each
    library's own traceback frames. Kept: the where-line, the user's frames (with
    their source lines) and every unindented line (the exception lines)."""
    lines = message.split("\n")
    match = _WHERE_LINE.match(lines[0])
    if not match:
        return message
    kept = [match.group(1) + "."]
    keep_source = False
    for line in lines[1:]:
        frame = _USER_FRAME.match(line)
        if frame:
            kept.append(f'  File "{frame.group(1)}", line {frame.group(2)}, in {frame.group(3)}')
            keep_source = True
        elif line.startswith("    ") and keep_source:
            if line.strip() and set(line.strip()) - set("^~"):
                kept.append(line)
        elif line.startswith("  "):
            keep_source = False
        else:
            keep_source = False
            kept.append(line)
    return "\n".join(kept)


def release(exc):
    """Break the exception <-> frame cycles of a caught exception (torch's
    ExceptionWrapper.reraise keeps the exception in a local of its frame), so that the
    iterator its frames reference is freed by refcount, as soon as the scenario drops
    it, instead of by the cyclic GC. Under torch, an iterator that the GC collects
    takes 5 s per worker to shut down (its queues' feeder threads are finalized
    first), which would dominate this suite's run time."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


@dataclasses.dataclass
class Raised:
    """An exception, as observed (the exception object itself is not kept: its
    traceback would keep iterators, and with them worker processes, alive)."""
    type: type
    message: str

    @classmethod
    def of(cls, exc):
        release(exc)
        return cls(type(exc), str(exc))

    @property
    def normalized(self):
        return normalize_message(self.message)

    def __eq__(self, other):
        return (isinstance(other, Raised) and self.type is other.type
                and self.normalized == other.normalized)

    def __repr__(self):
        return f"Raised({self.type.__name__}: {self.message!r})"


class Warned(typing.NamedTuple):
    """A warning, as observed: what it says and where it points (the file and line
    that warnings filters and the printed warning use)."""
    category: type
    message: str
    filename: str
    lineno: int

    @classmethod
    def of(cls, w):
        return cls(w.category, str(w.message), w.filename, w.lineno)


END = "<StopIteration>"


@dataclasses.dataclass
class Outcome:
    loader: str
    value: object = None
    error: Raised = None
    warnings: list = dataclasses.field(default_factory=list)
    # "Exception ignored in ..." (e.g. in a __del__): torch has some (its iterator's
    # __del__ fails when its __init__ raised); fastloader must have none
    unraisable: list = dataclasses.field(default_factory=list)

    def describe(self):
        return (f"{self.loader}: error={self.error!r}\n    warnings={self.warnings!r}"
                f"\n    unraisable={self.unraisable!r}")


def observe(scenario, cls, seconds):
    name = "torch" if cls is TORCH else "fastloader"
    outcome = Outcome(name)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: outcome.unraisable.append(
        f"{u.err_msg or 'Exception ignored in'}: {u.object!r}: "
        f"{u.exc_type.__name__}: {u.exc_value}")
    # both runs start from the same global RNG state (num_workers=0 draws from it);
    # the session's state is restored afterwards
    saved_rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with deadline(seconds, f"{name} scenario"):
                    outcome.value = scenario(cls)
            except Exception as exc:  # noqa: BLE001 - the exception is the observation
                outcome.error = Raised.of(exc)
            gc.collect()   # iterators in cycles: their shutdown warnings belong to this run
    finally:
        sys.unraisablehook = previous_hook
        torch.set_rng_state(saved_rng[0])
        random.setstate(saved_rng[1])
        np.random.set_state(saved_rng[2])
    outcome.warnings = [Warned.of(w) for w in caught]
    return outcome


def assert_same(a, b, path="value"):
    """Exactly the same value (see helpers.assert_same_batches); an observed
    exception matches by type and normalized message."""
    assert_same_batches(a, b, path, exact=(Raised,))


def conform(scenario, *, seconds=60, dead_worker=False):
    """Run `scenario` under torch's DataLoader, then fastloader's; assert the same
    outcome. Returns both outcomes for extra, behaviour-specific checks."""
    theirs = observe(scenario, TORCH, seconds)
    ours = observe(scenario, FAST, seconds)
    context = f"\n  torch      -> {theirs.describe()}\n  fastloader -> {ours.describe()}"
    if dead_worker:
        # known difference: torch raises RuntimeError, fastloader its WorkerError
        assert theirs.error is not None and issubclass(theirs.error.type, RuntimeError), context
        assert ours.error is not None and ours.error.type is fastloader.WorkerError, context
    elif theirs.error is None:
        assert ours.error is None, f"only fastloader raised:{context}"
    else:
        assert ours.error is not None, f"torch raised, fastloader did not:{context}"
        assert ours.error.type is theirs.error.type, f"exception types differ:{context}"
        assert ours.error.normalized == theirs.error.normalized, (
            f"exception messages differ:\n--- torch:\n{theirs.error.normalized}\n"
            f"--- fastloader:\n{ours.error.normalized}")
    assert ours.warnings == theirs.warnings, f"warnings differ:{context}"
    assert not ours.unraisable, f"fastloader: exceptions ignored in __del__ or the like:{context}"
    try:
        assert_same(theirs.value, ours.value)
    except AssertionError as exc:
        raise AssertionError(f"values differ (left: torch, right: fastloader): {exc}") from None
    return theirs, ours


def drain(iterator, limit=500, stop_on_error=False):
    """Everything an iterator produces, exceptions included (as Raised, continuing
    with the next call as a user's try/except would), up to StopIteration (END)."""
    out = []
    while len(out) < limit:
        try:
            out.append(next(iterator))
        except StopIteration as exc:
            release(exc)
            out.append(END)
            break
        except Exception as exc:  # noqa: BLE001
            out.append(Raised.of(exc))
            if stop_on_error:
                break
    return out


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_a_subclass_that_defines_eq_iterates_as_torchs():
    """A DataLoader subclass with __eq__ (so unhashable, as a dataclass is) iterates,
    with and without workers, and two loaders that compare equal are still two."""
    def scenario(DL):
        class Equal(DL):
            def __eq__(self, other):
                return isinstance(other, Equal)

        out = [[b.tolist() for b in Equal(list(range(6)), batch_size=2, num_workers=nw,
                                          multiprocessing_context="fork" if nw else None)]
               for nw in (0, 2)]
        a, b = Equal(list(range(4)), batch_size=2), Equal(list(range(10, 16)), batch_size=3)
        it_a, it_b = iter(a), iter(b)
        out.append([next(it_a).tolist(), next(it_b).tolist(), next(it_a).tolist()])
        return out

    conform(scenario)


class _BucketBatchSampler:
    """A batch sampler whose `batch_size` is not one number (torch never reads it)."""

    def __init__(self, batch_size):
        self._batch_size = batch_size

    @property
    def batch_size(self):
        if self._batch_size == "raise":
            raise RuntimeError("no single batch size")
        return self._batch_size

    def __iter__(self):
        yield [0, 1]
        yield [2]
        yield [5, 4, 3]

    def __len__(self):
        return 3


@pytest.mark.parametrize("batch_size", [[4, 2], "dynamic", "raise", None, 2.5],
                         ids=["per-bucket", "str", "raises", "none", "float"])
def test_a_batch_sampler_whose_batch_size_is_not_a_number_loads_as_torchs(batch_size):
    """fastloader sizes its task ring from a batch sampler's batch_size; one that is
    a list, a string or a property that raises must not stop the loader."""
    def scenario(DL):
        loader = DL(list(range(6)), batch_sampler=_BucketBatchSampler(batch_size), num_workers=2,
                    multiprocessing_context="fork")
        return [b.tolist() for b in loader]

    conform(scenario)


@pytest.mark.parametrize("n", [6, 0])
@pytest.mark.parametrize("size", [0, -2, None, 2.0, True], ids=["0", "-2", "None", "2.0", "True"])
@pytest.mark.parametrize("drop_last", [True, False])
def test_batch_size_set_after_construction_batches_as_torchs(size, drop_last, n):
    """0 or less ends the epoch; None (without drop_last: the rest in one batch),
    a float, a bool: torch's result or error, not fastloader's range arithmetic's
    (an empty dataset included: torch reads batch_size once the sampler is out)."""
    def scenario(DL):
        loader = DL(list(range(n)), batch_size=2, drop_last=drop_last, num_workers=1,
                    multiprocessing_context="fork")
        loader.batch_sampler.batch_size = size
        return [b.tolist() for b in loader]

    conform(scenario)


def test_loaders_that_compare_equal_keep_their_own_state():
    """fastloader's state_dict() is each loader's own, whatever __eq__ and __hash__
    say (its per-loader state is not looked up by equality)."""
    class SameHash(FAST):
        def __eq__(self, other):
            return isinstance(other, SameHash)

        def __hash__(self):
            return 1

    a, b = SameHash(list(range(4)), batch_size=2), SameHash(list(range(10, 16)), batch_size=3)
    it_a, it_b = iter(a), iter(b)
    next(it_a), next(it_b), next(it_a)
    assert (a.state_dict()["yielded"], b.state_dict()["yielded"]) == (2, 1)


# ======================================================================================
# IterableDataset
# ======================================================================================

@pytest.mark.parametrize("batch_size", [2, None])
@pytest.mark.parametrize("nw", [1, 2])
def test_iterable_each_worker_iterates_its_own_replica(nw, batch_size):
    """Without sharding every worker yields the whole dataset (duplicates), batches
    alternating between workers."""
    def scenario(DL):
        return list(DL(cds.RangeIterable(n=5, mode="replica"), batch_size=batch_size,
                       num_workers=nw, multiprocessing_context="fork"))

    theirs, _ = conform(scenario)
    expected = 5 * nw if batch_size is None else 3 * nw
    assert len(theirs.value) == expected


@pytest.mark.parametrize("ctx", START_METHODS)
def test_iterable_sharding_with_get_worker_info(ctx):
    """Sharding on get_worker_info() (id, num_workers, seed, dataset replica) and the
    workers' seeded RNGs, under every start method."""
    def scenario(DL):
        return list(DL(cds.InfoIterable(per_worker=3), batch_size=2, num_workers=2,
                       multiprocessing_context=ctx, generator=gen(31)))

    theirs, _ = conform(scenario)
    values = sorted(int(v) for batch in theirs.value for v in batch["value"])
    assert values == [0, 1, 2, 100, 101, 102]


UNEVEN = [
    # (samples per worker, batch_size, drop_last)
    ((1, 6), 2, False),
    ((0, 5), 2, False),
    ((6, 1), 2, False),
    ((5, 2), 2, True),
    ((3, 4), 3, True),
    ((4, 1), None, False),
    ((2, 7), 1, False),
]


@pytest.mark.parametrize("sizes,batch_size,drop_last", UNEVEN,
                         ids=[f"{s[0]}-{s[1]}-bs{b}-drop{d}" for s, b, d in UNEVEN])
@pytest.mark.parametrize("prefetch_factor", [1, 2])
def test_iterable_stopiteration_ends_only_that_worker(sizes, batch_size, drop_last,
                                                      prefetch_factor):
    """A worker whose replica is exhausted stops; the others go on. drop_last drops
    each worker's own incomplete last batch."""
    def scenario(DL):
        return list(DL(cds.RangeIterable(mode="sizes", sizes=sizes), batch_size=batch_size,
                       drop_last=drop_last, num_workers=len(sizes),
                       prefetch_factor=prefetch_factor, multiprocessing_context="fork"))

    conform(scenario)


@pytest.mark.parametrize("call_len", [True, False], ids=["len-called", "len-not-called"])
@pytest.mark.parametrize("batch_size,drop_last", [(2, False), (3, True), (None, False)])
@pytest.mark.parametrize("nw", [0, 2])
def test_iterable_len_and_overrun_warning(nw, batch_size, drop_last, call_len):
    """len(loader) of a sized IterableDataset, and the warning for every batch past it
    (only when len() was called before the iterator was created)."""
    def scenario(DL):
        loader = DL(cds.SizedRangeIterable(length=3, n=8, mode="shard"),
                    batch_size=batch_size, drop_last=drop_last, num_workers=nw,
                    multiprocessing_context="fork" if nw else None)
        length = len(loader) if call_len else None
        return length, list(loader)

    theirs, _ = conform(scenario)
    # torch compares batches yielded with len(dataset) (not len(loader))
    assert bool(theirs.warnings) == (call_len and len(theirs.value[1]) > 3)


def test_iterable_len_warning_with_persistent_workers():
    """With persistent workers the iterator is reused: len() called between epochs
    turns the warning on for the next epoch."""
    def scenario(DL):
        loader = DL(cds.SizedRangeIterable(length=2, n=6, mode="shard"), batch_size=1,
                    num_workers=2, persistent_workers=True, multiprocessing_context="fork")
        epochs = []
        for _ in range(2):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                batches = list(loader)
            epochs.append((batches, [str(w.message) for w in caught]))
            len(loader)
        return epochs

    theirs, _ = conform(scenario)
    assert not theirs.value[0][1] and theirs.value[1][1]


@pytest.mark.parametrize("nw", [1, 2])
def test_iterable_exception_mid_stream(nw):
    """An exception raised by a replica's iterator reaches the main process; that
    replica is then exhausted, the others continue."""
    def scenario(DL):
        loader = DL(cds.RangeIterable(n=6, mode="shard", raise_at=1), batch_size=1,
                    num_workers=nw, multiprocessing_context="fork")
        return drain(iter(loader))

    theirs, _ = conform(scenario)
    assert any(isinstance(x, Raised) for x in theirs.value)


@pytest.mark.parametrize("nw", [0, 2])
def test_iterable_batch_size_none_converts_numpy(nw):
    """batch_size=None with an IterableDataset: samples one by one, default_convert."""
    def scenario(DL):
        return list(DL(cds.RangeIterable(n=5, mode="shard", as_numpy=True), batch_size=None,
                       num_workers=nw, multiprocessing_context="fork" if nw else None))

    theirs, _ = conform(scenario)
    assert all(isinstance(x, torch.Tensor) for x in theirs.value)


# ======================================================================================
# No auto-batching (default_convert) and auto-batching (default_collate) per kind
# ======================================================================================

@pytest.mark.parametrize("kind", cds.CONVERT_KINDS)
def test_batch_size_none_default_convert(kind):
    def scenario(DL):
        return list(DL(cds.KindDataset(kind), batch_size=None, num_workers=2,
                       multiprocessing_context="fork"))

    conform(scenario)


@pytest.mark.parametrize("kind", cds.CONVERT_KINDS)
def test_default_collate_per_kind(kind):
    """default_collate on each kind: same batch, or the same error from the worker."""
    def scenario(DL):
        return drain(iter(DL(cds.KindDataset(kind), batch_size=3, num_workers=2,
                             multiprocessing_context="fork")))

    conform(scenario)


_SPARSE_SCRIPT = """
import json, sys, warnings
import torch
from tests.support import conformance_datasets as cds
if sys.argv[1] == "torch":
    from torch.utils.data import DataLoader
else:
    from fastloader import DataLoader
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = [[(str(t.layout), t.is_coalesced() if t.layout == torch.sparse_coo else None,
             t.to_dense().tolist()) for t in batch]
           for batch in DataLoader(cds.SparseDataset(), batch_size=None, num_workers=1,
                                   multiprocessing_context="fork")]
print(json.dumps({"batches": out, "warnings": [
    (w.category.__name__, str(w.message), w.filename, w.lineno) for w in caught]}))
"""


@tf.torch_before((2, 5), "its own loader hangs on a sparse tensor from a worker")
def test_sparse_tensors_arrive_as_torchs_rebuilds_them(subprocess_env):
    """torch's transport rebuilds a sparse tensor with torch.sparse_coo_tensor() or
    torch.sparse_compressed_tensor() in the main process, whose warnings (each
    once per process: hence a fresh one per loader) come from torch's line there;
    fastloader unpickled it without them."""
    seen = {}
    for loader in ("torch", "fastloader"):
        run = subprocess.run([sys.executable, "-c", _SPARSE_SCRIPT, loader], env=subprocess_env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        seen[loader] = json.loads(run.stdout)
    assert seen["fastloader"] == seen["torch"]
    assert any("Sparse" in message for _, message, _, _ in seen["torch"]["warnings"])


# ======================================================================================
# __getitems__
# ======================================================================================

GETITEMS_CASES = {
    "batched": lambda: dict(dataset=cds.GetitemsDataset(), batch_size=3),
    "unbatched_uses_getitem": lambda: dict(dataset=cds.GetitemsDataset(), batch_size=None),
    "batch_sampler": lambda: dict(dataset=cds.GetitemsDataset(),
                                  batch_sampler=ds.VariableBatchSampler(10)),
    "columns_custom_collate": lambda: dict(dataset=cds.GetitemsDataset(batch_type="columns"),
                                           batch_size=4, collate_fn=cds.columns_collate),
    "getitems_is_none": lambda: dict(dataset=cds.GetitemsNoneDataset(), batch_size=3),
}


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("case", list(GETITEMS_CASES))
def test_getitems_used_when_present(case, nw):
    def scenario(DL):
        return list(DL(**GETITEMS_CASES[case](), num_workers=nw,
                       multiprocessing_context="fork" if nw else None))

    theirs, _ = conform(scenario)
    if case in ("batched", "batch_sampler"):
        assert all(v == "__getitems__" for b in theirs.value for v in b["via"])


# ======================================================================================
# persistent_workers
# ======================================================================================

def _pid_labels(epochs):
    """Replace pids by their order of first appearance (pids differ between runs)."""
    labels = {}
    out = []
    for batches in epochs:
        new = []
        for b in batches:
            b = dict(b)
            b["pid"] = [labels.setdefault(int(p), len(labels)) for p in b["pid"]]
            new.append(b)
        out.append(new)
    return out, len(labels)


@pytest.mark.parametrize("ctx", START_METHODS)
def test_persistent_workers_survive_epochs(ctx):
    """Same worker processes and dataset replicas across epochs (state carries over),
    the same iterator object, a fresh permutation per epoch."""
    nw = 2 if ctx == "fork" else 1   # a spawned worker costs a second: one is enough

    def scenario(DL):
        loader = DL(cds.StatefulDataset(n=8), batch_size=2, shuffle=True, generator=gen(5),
                    num_workers=nw, persistent_workers=True, multiprocessing_context=ctx)
        epochs, iterators = [], []
        for _ in range(3):
            it = iter(loader)
            iterators.append(it)
            epochs.append(list(it))
        labelled, n_pids = _pid_labels(epochs)
        same_iterator = all(i is iterators[0] for i in iterators)
        del iterators, it
        return labelled, n_pids, same_iterator

    theirs, _ = conform(scenario)
    _, n_pids, same_iterator = theirs.value
    assert n_pids == nw and same_iterator


def test_without_persistent_workers_each_epoch_starts_fresh():
    def scenario(DL):
        loader = DL(cds.StatefulDataset(n=8), batch_size=2, shuffle=True, generator=gen(5),
                    num_workers=2, multiprocessing_context="fork")
        labelled, n_pids = _pid_labels([list(loader) for _ in range(2)])
        return labelled, n_pids

    theirs, _ = conform(scenario)
    assert theirs.value[1] == 4


@pytest.mark.parametrize("in_order", [True, False])
def test_persistent_workers_restart_iterable_replicas(in_order):
    """Each epoch restarts every replica, including those that ended early."""
    def scenario(DL):
        loader = DL(cds.RangeIterable(mode="sizes", sizes=(2, 5)), batch_size=2,
                    num_workers=2, persistent_workers=True, in_order=in_order,
                    multiprocessing_context="fork")
        epochs = [list(loader) for _ in range(3)]
        if not in_order:
            epochs = [sorted(e, key=lambda b: b[:, 0].tolist()) for e in epochs]
        return epochs

    conform(scenario)


@pytest.mark.parametrize("shuffle", [False, True])
def test_persistent_workers_epoch_abandoned_midway(shuffle):
    """An epoch left after 2 batches (its prefetched batches are discarded), a new one
    started, and another abandoned by a second iter() call."""
    def scenario(DL):
        loader = DL(cds.IndexDataset(n=12), batch_size=2, shuffle=shuffle, generator=gen(9),
                    num_workers=2, persistent_workers=True, multiprocessing_context="fork")
        it = iter(loader)
        first = [next(it), next(it)]
        second = list(iter(loader))
        it = iter(loader)
        third = [next(it)]
        fourth = list(iter(loader))
        return first, second, third, fourth, loader.generator.get_state()

    conform(scenario)


@pytest.mark.parametrize("persistent", [False, True])
def test_seeds_over_epochs(persistent):
    """Worker RNG streams over two epochs: continued by persistent workers (base seed
    drawn once), re-seeded from a new base seed otherwise."""
    def scenario(DL):
        loader = DL(cds.InfoDataset(n=8), batch_size=2, shuffle=True, generator=gen(13),
                    num_workers=2, persistent_workers=persistent,
                    multiprocessing_context="fork")
        epochs = []
        for _ in range(2):
            epochs.append(list(loader))
            epochs.append(loader.generator.get_state())
        return epochs

    conform(scenario)


# ======================================================================================
# in_order=False
# ======================================================================================

@tf.needs_in_order
@pytest.mark.parametrize("in_order", [True, False])
def test_in_order_false_delivers_batches_as_they_complete(in_order):
    """Index 0 takes 1.2 s: with in_order=False the other workers' batches come first;
    either way every batch arrives exactly once."""
    def scenario(DL):
        loader = DL(cds.IndexDataset(n=8, delays={0: 1.2}), batch_size=1, num_workers=2,
                    in_order=in_order, multiprocessing_context="fork")
        got = [int(b[0, 0]) for b in loader]
        return sorted(got), got[0] == 0, (got if in_order else None)

    theirs, _ = conform(scenario)
    assert theirs.value[0] == list(range(8))
    assert theirs.value[1] == in_order


@pytest.mark.parametrize("dataset", ["map", "iterable"])
def test_in_order_false_every_batch_exactly_once(dataset):
    def scenario(DL):
        if dataset == "map":
            data = dict(dataset=cds.IndexDataset(n=15), shuffle=True, generator=gen(2))
        else:
            data = dict(dataset=cds.RangeIterable(mode="sizes", sizes=(3, 9, 1)))
        loader = DL(**data, batch_size=2, num_workers=2, in_order=False, prefetch_factor=3,
                    persistent_workers=True, multiprocessing_context="fork")
        return [sorted(b[:, 0].tolist() for b in loader) for _ in range(2)]

    conform(scenario)


# ======================================================================================
# timeout
# ======================================================================================

@pytest.mark.parametrize("timeout", [0.5, 1])
def test_timeout_exceeded(timeout):
    def scenario(DL):
        loader = DL(cds.IndexDataset(n=4, delays={0: timeout + 0.5}), batch_size=1,
                    num_workers=1, timeout=timeout, multiprocessing_context="fork")
        return next(iter(loader))

    theirs, _ = conform(scenario)
    assert theirs.error.type is RuntimeError and "timed out" in theirs.error.message


def test_timeout_not_exceeded():
    def scenario(DL):
        return list(DL(cds.IndexDataset(n=6), batch_size=2, num_workers=2, timeout=30,
                       multiprocessing_context="fork"))

    conform(scenario)


# ======================================================================================
# worker_init_fn
# ======================================================================================

@pytest.mark.parametrize("ctx", START_METHODS)
def test_worker_init_fn_runs_in_every_worker_after_seeding(ctx):
    def scenario(DL):
        return list(DL(cds.InfoDataset(n=8), batch_size=2, num_workers=2, generator=gen(3),
                       worker_init_fn=cds.record_init, multiprocessing_context=ctx))

    theirs, _ = conform(scenario)
    records = {r for b in theirs.value for r in b["init"]}
    assert len(records) == 2 and all(r.startswith("worker_id=") for r in records)


INIT_FAILURES = [
    ("fork", 0, ValueError), ("fork", 1, ValueError), ("fork", None, KeyError),
    ("fork", 1, cds.TwoArgError), ("spawn", None, ValueError), ("forkserver", 1, KeyError),
]


@pytest.mark.parametrize("ctx,fail_on,exc_type", INIT_FAILURES,
                         ids=[f"{c}-fail{f}-{e.__name__}" for c, f, e in INIT_FAILURES])
def test_worker_init_fn_exception_reraised_with_traceback(ctx, fail_on, exc_type):
    """The error surfaces at the first batch of the failing worker, with its type,
    the worker id and the init function's traceback."""
    nw = 2 if fail_on == 1 or ctx == "fork" else 1

    def scenario(DL):
        loader = DL(cds.IndexDataset(n=6), batch_size=1, num_workers=nw,
                    worker_init_fn=cds.FailingInit(fail_on, exc_type),
                    multiprocessing_context=ctx)
        return drain(iter(loader), stop_on_error=True)

    theirs, _ = conform(scenario)
    error = theirs.value[-1]
    assert isinstance(error, Raised) and "raise_from_init" in error.normalized


@pytest.mark.parametrize("fail_on", [0, None], ids=["one-worker", "every-worker"])
@pytest.mark.parametrize("nw", [1, 2])
def test_worker_init_fn_error_then_each_later_batch_of_that_worker_fails_as_torchs(nw, fail_on):
    """The failed worker's first batch raises the init error; each of its later
    batches fails too, with torch's type (UnboundLocalError: its loop never bound a
    fetcher); the others' batches arrive, and the epoch ends."""
    def scenario(DL):
        loader = DL(cds.IndexDataset(n=6), batch_size=1, num_workers=nw,
                    worker_init_fn=cds.FailingInit(fail_on), multiprocessing_context="fork")
        return [r.type.__name__ if isinstance(r, Raised) else r for r in drain(iter(loader))]

    theirs, _ = conform(scenario)
    assert theirs.value.count("UnboundLocalError") >= 2, theirs.value


@pytest.mark.parametrize("exc_type", [ValueError, KeyError, cds.TwoArgError, StopIteration])
@pytest.mark.parametrize("nw", [1, 2])
def test_getitem_exception_then_iteration_continues(nw, exc_type):
    """An exception in __getitem__ is re-raised for its batch; the next call goes on
    with the following batches (a StopIteration from a map-style dataset ends the
    loop, as under torch)."""
    def scenario(DL):
        loader = DL(cds.RaiseAtDataset(n=8, bad=(2, 5), exc_type=exc_type), batch_size=1,
                    num_workers=nw, multiprocessing_context="fork")
        return drain(iter(loader))

    conform(scenario)


# ======================================================================================
# Seeds and get_worker_info
# ======================================================================================

SEED_CASES = [("fork", False), ("fork", True), ("spawn", True), ("forkserver", False)]


@pytest.mark.parametrize("ctx,shuffle", SEED_CASES,
                         ids=[f"{c}-shuffle{s}" for c, s in SEED_CASES])
def test_seeds_from_generator(ctx, shuffle):
    """base_seed drawn from `generator` as torch draws it; random, torch and numpy in
    worker i seeded as torch seeds them; WorkerInfo as torch's."""
    def scenario(DL):
        g = gen(1234)
        batches = list(DL(cds.InfoDataset(n=8), batch_size=2, shuffle=shuffle, generator=g,
                          num_workers=2, multiprocessing_context=ctx))
        return batches, g.get_state()

    theirs, _ = conform(scenario)
    worker = theirs.value[0][0]["worker"]
    assert all(worker["in_worker"]) and set(worker["num_workers"].tolist()) == {2}


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("nw", [1, 2])
def test_seeds_from_global_rng(nw, shuffle):
    """No generator: the base seed (and the permutation) come from torch's global RNG,
    drawn when the iterator is created; Python's and NumPy's global RNGs in the main
    process are left alone."""
    def scenario(DL):
        loader = DL(cds.InfoDataset(n=6), batch_size=2, shuffle=shuffle, num_workers=nw,
                    multiprocessing_context="fork")
        torch.manual_seed(2024)
        random.seed(7)
        np.random.seed(7)
        epochs = [list(loader) for _ in range(2)]
        return epochs, torch.rand(3), random.random(), np.random.rand()

    conform(scenario)


def test_worker_process_environment():
    """Inside a worker: the thread name torch gives it ("pt_data_worker", what top and
    py-spy show), one intra-op thread, a daemonic process, user code on the main
    thread."""
    def scenario(DL):
        return list(DL(cds.ProcessEnvDataset(), batch_size=2, num_workers=2,
                       multiprocessing_context="fork"))

    conform(scenario)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("nw", [0, 2])
def test_get_worker_info_is_none_in_main_process(nw, persistent):
    def scenario(DL):
        seen = [get_worker_info()]
        loader = DL(cds.InfoDataset(n=4), batch_size=2, num_workers=nw,
                    persistent_workers=persistent and nw > 0,
                    multiprocessing_context="fork" if nw else None)
        it = iter(loader)
        seen.append(get_worker_info())
        first = next(it)
        seen.append(get_worker_info())
        rest = list(it)
        seen.append(get_worker_info())
        del it
        return seen, first["worker"]["in_worker"], len(rest)

    theirs, _ = conform(scenario)
    assert theirs.value[0] == [None] * 4


# ======================================================================================
# pin_memory / pin_memory_device
# ======================================================================================

@pytest.mark.skipif(HAS_ACCELERATOR, reason="warnings only without an accelerator")
@pytest.mark.parametrize("pin_memory,device", [(True, ""), (True, "cuda"), (False, "cuda")])
@pytest.mark.parametrize("nw", [0, 2])
def test_pin_memory_without_accelerator_warns_like_torch(nw, pin_memory, device):
    def scenario(DL):
        loader = DL(cds.IndexDataset(n=4), batch_size=2, num_workers=nw,
                    pin_memory=pin_memory, pin_memory_device=device,
                    multiprocessing_context="fork" if nw else None)
        epochs = [list(loader) for _ in range(2)]
        pinned = [t.is_pinned() for e in epochs for t in e]
        return epochs, pinned

    theirs, _ = conform(scenario)
    if tf.HAS_ACCELERATOR_API:   # older torch warns about neither (nor does fastloader)
        assert bool(theirs.warnings) == pin_memory


@pytest.mark.skipif(not HAS_ACCELERATOR, reason="needs an accelerator (CUDA)")
@pytest.mark.parametrize("device", ["", "cuda"])
@pytest.mark.parametrize("collate", ["default", "pin_memory_method"])
@pytest.mark.parametrize("nw", [0, 2])
def test_pin_memory_with_accelerator_pins_batches(nw, collate, device):
    """Pinned batches (also through a batch type's own pin_memory()), and the
    deprecation warning for pin_memory_device."""
    def scenario(DL):
        loader = DL(cds.IndexDataset(n=6), batch_size=2, num_workers=nw, pin_memory=True,
                    pin_memory_device=device,
                    collate_fn=cds.pinnable_collate if collate != "default" else None,
                    multiprocessing_context="fork" if nw else None)
        out = []
        for batch in loader:
            if isinstance(batch, cds.PinnableBatch):
                out.append((batch.data, batch.data.is_pinned(), batch.pinned_by_hook))
            else:
                out.append((batch, batch.is_pinned()))
        return out

    theirs, _ = conform(scenario)
    assert all(entry[1] for entry in theirs.value)


# ======================================================================================
# multiprocessing_context
# ======================================================================================

def _context_values():
    return {
        "none": None,
        "fork": "fork",
        "spawn": "spawn",
        "forkserver": "forkserver",
        "stdlib_spawn_ctx": multiprocessing.get_context("spawn"),
        "torch_forkserver_ctx": torch.multiprocessing.get_context("forkserver"),
        "stdlib_fork_ctx": multiprocessing.get_context("fork"),
    }


def _describe_context(ctx, given):
    if ctx is None:
        return None
    return (type(ctx).__module__, type(ctx).__name__, ctx.get_start_method(),
            ctx is given if not isinstance(given, str) else None)


@pytest.mark.parametrize("how", ["constructor", "setter"])
@pytest.mark.parametrize("name", list(_context_values()))
def test_multiprocessing_context_accepted(name, how):
    value = _context_values()[name]

    def scenario(DL):
        if how == "constructor":
            loader = DL(cds.IndexDataset(), num_workers=2, multiprocessing_context=value)
        else:
            loader = DL(cds.IndexDataset(), num_workers=2)
            loader.multiprocessing_context = value
        return _describe_context(loader.multiprocessing_context, value)

    conform(scenario)


_NOT_A_CONTEXT = object()

CONTEXT_ERRORS = {
    "bogus_string": (2, "bogus"),
    "empty_string": (2, ""),
    "upper_case": (2, "FORK"),
    "int": (2, 123),
    "object": (2, _NOT_A_CONTEXT),
    "module_not_context": (2, multiprocessing),
    "without_workers": (0, "fork"),
    "context_object_without_workers": (0, multiprocessing.get_context("fork")),
}


@pytest.mark.parametrize("how", ["constructor", "setter"])
@pytest.mark.parametrize("case", list(CONTEXT_ERRORS))
def test_multiprocessing_context_rejected(case, how):
    nw, value = CONTEXT_ERRORS[case]

    def scenario(DL):
        if how == "constructor":
            DL(cds.IndexDataset(), num_workers=nw, multiprocessing_context=value)
        else:
            loader = DL(cds.IndexDataset(), num_workers=nw)
            loader.multiprocessing_context = value
        return "accepted"

    theirs, _ = conform(scenario)
    assert theirs.error is not None


CONTEXT_STARTS = [
    ("default", None), ("fork", "string"), ("fork", "stdlib_ctx"), ("spawn", "string"),
    ("spawn", "stdlib_ctx"), ("forkserver", "torch_ctx"), ("forkserver", "setter"),
]


@pytest.mark.parametrize("method,form", CONTEXT_STARTS,
                         ids=[f"{m}-{f}" for m, f in CONTEXT_STARTS])
def test_multiprocessing_context_starts_workers_that_way(method, form):
    """The workers really start with the loader's context (a forked worker inherits
    the main process's module state; a spawned one is our child but does not; a
    forkserver one is the forkserver's child)."""
    def scenario(DL):
        token = uuid.uuid4().hex
        cds.START_MARKER = token
        dataset = cds.StartMethodDataset(token)
        if form is None:
            value = None
        elif form in ("string", "setter"):
            value = method
        elif form == "stdlib_ctx":
            value = multiprocessing.get_context(method)
        else:
            value = torch.multiprocessing.get_context(method)
        if form == "setter":
            loader = DL(dataset, batch_size=None, num_workers=1, multiprocessing_context="fork")
            loader.multiprocessing_context = value
        else:
            loader = DL(dataset, batch_size=None, num_workers=1, multiprocessing_context=value)
        try:
            return list(loader)
        finally:
            cds.START_MARKER = None

    theirs, _ = conform(scenario)
    expected = "fork" if method == "default" else method
    assert theirs.value[0]["method"] == expected


# ======================================================================================
# check_worker_number_rationality, attributes after init
# ======================================================================================

# the usable CPUs, as torch counts them for its warning (torch._utils.cpu_count
# from torch 2.13, the affinity in older versions): the module imports with any torch
TOO_MANY_WORKERS = len(os.sched_getaffinity(0)) + 1


@pytest.mark.skipif(TOO_MANY_WORKERS > 33, reason="too many CPUs to fork one worker more")
@pytest.mark.parametrize("case", ["constructor", "after_init", "direct_call"])
def test_worker_number_rationality_warning(case):
    """More workers than usable CPUs: the same warning text, at construction and at
    each iter() (pointing at the same file and line)."""
    def scenario(DL):
        if case == "constructor":
            loader = DL(cds.IndexDataset(n=8), batch_size=2, num_workers=TOO_MANY_WORKERS,
                        multiprocessing_context="fork")
        else:
            loader = DL(cds.IndexDataset(n=8), batch_size=2, num_workers=1,
                        multiprocessing_context="fork")
            loader.num_workers = TOO_MANY_WORKERS
        if case == "direct_call":
            loader.check_worker_number_rationality()
            return None
        return list(loader)

    theirs, _ = conform(scenario)
    assert theirs.warnings and all("worker processes in total" in w.message for w in theirs.warnings)


FROZEN = {
    "batch_size": 8, "batch_sampler": None, "sampler": [0, 1], "drop_last": True,
    "dataset": ds.TensorLabelDataset(), "persistent_workers": True,
}


@pytest.mark.parametrize("attr", list(FROZEN))
def test_attribute_may_not_be_set_after_init(attr):
    def scenario(DL):
        loader = DL(cds.IndexDataset(), batch_size=2, num_workers=2)
        setattr(loader, attr, FROZEN[attr])
        return "set"

    theirs, _ = conform(scenario)
    assert theirs.error.type is ValueError


SETTABLE = {
    "num_workers_2_to_1": lambda L: setattr(L, "num_workers", 1),
    "num_workers_0_to_2_with_prefetch": lambda L: (setattr(L, "num_workers", 2),
                                                   setattr(L, "prefetch_factor", 2)),
    "num_workers_0_to_2_without_prefetch": lambda L: setattr(L, "num_workers", 2),
    "timeout": lambda L: setattr(L, "timeout", 30),
    "collate_fn": lambda L: setattr(L, "collate_fn", cds.tagged_collate),
    "worker_init_fn": lambda L: setattr(L, "worker_init_fn", cds.record_init),
    "generator": lambda L: setattr(L, "generator", gen(77)),
    "prefetch_factor": lambda L: setattr(L, "prefetch_factor", 1),
    "pin_memory": lambda L: setattr(L, "pin_memory", True),
    "in_order": lambda L: setattr(L, "in_order", False),
}


@pytest.mark.parametrize("case", list(SETTABLE))
def test_attribute_set_after_init_takes_effect(case):
    """Attributes torch lets you change after construction act on the next iterator
    exactly as under torch (or fail the same way)."""
    def scenario(DL):
        nw = 0 if "0_to_2" in case else 2
        loader = DL(cds.InfoDataset(n=6), batch_size=2, shuffle=True, generator=gen(4),
                    num_workers=nw, multiprocessing_context=None)
        if case == "collate_fn":
            loader = DL(cds.IndexDataset(n=6), batch_size=2, num_workers=nw)
        SETTABLE[case](loader)
        batches = list(loader)
        if case == "in_order":
            batches = sorted(batches, key=lambda b: b["index"].tolist())
        return batches

    conform(scenario)


# ======================================================================================
# Iterators: two live ones, one dropped mid-epoch; len(loader)
# ======================================================================================

@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_two_live_iterators_on_one_loader(shuffle, persistent):
    """Two iterators interleaved (a persistent loader has only one iterator: the second
    iter() restarts it)."""
    def scenario(DL):
        loader = DL(cds.IndexDataset(n=8), batch_size=2, shuffle=shuffle, generator=gen(6),
                    num_workers=2, persistent_workers=persistent,
                    multiprocessing_context="fork")
        it1 = iter(loader)
        log = [("it1", next(it1))]
        it2 = iter(loader)
        done = set()
        while len(done) < 2 and len(log) < 40:
            for name, it in (("it2", it2), ("it1", it1)):
                if name in done:
                    continue
                try:
                    log.append((name, next(it)))
                except StopIteration:
                    log.append((name, END))
                    done.add(name)
        same = it1 is it2
        del it1, it2, it
        return log, same

    conform(scenario)


@pytest.mark.parametrize("how", ["del", "break"])
@pytest.mark.parametrize("persistent", [False, True])
def test_iterator_dropped_mid_epoch(persistent, how):
    """An epoch abandoned after 2 batches: no warning, no error, and the next epoch is
    complete and as under torch (same RNG consumption)."""
    def scenario(DL):
        loader = DL(cds.InfoDataset(n=12), batch_size=2, shuffle=True, generator=gen(8),
                    num_workers=2, persistent_workers=persistent,
                    multiprocessing_context="fork")
        partial = []
        if how == "del":
            it = iter(loader)
            partial = [next(it), next(it)]
            del it
        else:
            for batch in loader:
                partial.append(batch)
                if len(partial) == 2:
                    break
        gc.collect()
        return partial, list(loader), loader.generator.get_state()

    theirs, _ = conform(scenario)
    assert not theirs.warnings


LEN_CASES = {
    "map_bs4": lambda: dict(dataset=ds.TensorLabelDataset(), batch_size=4),
    "map_bs4_drop_last": lambda: dict(dataset=ds.TensorLabelDataset(), batch_size=4,
                                      drop_last=True),
    "map_unbatched": lambda: dict(dataset=ds.TensorLabelDataset(), batch_size=None),
    "map_batch_sampler": lambda: dict(dataset=ds.TensorLabelDataset(),
                                      batch_sampler=ds.VariableBatchSampler()),
    "map_list_sampler": lambda: dict(dataset=ds.TensorLabelDataset(), sampler=[0, 2, 4],
                                     batch_size=2),
    "map_distributed": lambda: dict(dataset=ds.TensorLabelDataset(), batch_size=3,
                                    sampler=DistributedSampler(ds.TensorLabelDataset(),
                                                               num_replicas=3, rank=2)),
    "iterable_sized_bs3": lambda: dict(dataset=cds.SizedRangeIterable(length=10, n=10),
                                       batch_size=3),
    "iterable_sized_bs3_drop_last": lambda: dict(
        dataset=cds.SizedRangeIterable(length=10, n=10), batch_size=3, drop_last=True),
    "iterable_sized_unbatched": lambda: dict(dataset=cds.SizedRangeIterable(length=10, n=10),
                                             batch_size=None),
    "iterable_without_len": lambda: dict(dataset=cds.RangeIterable(n=10), batch_size=3),
    "map_without_len": lambda: dict(dataset=cds.NoLenDataset(), sampler=[0, 1, 2],
                                    batch_size=2),
}


@pytest.mark.parametrize("case", list(LEN_CASES))
def test_len(case):
    """len(loader), len(iterator), and the number of batches an epoch really yields."""
    def scenario(DL):
        loader = DL(**LEN_CASES[case](), num_workers=2, multiprocessing_context="fork")
        try:
            length = len(loader)
        except TypeError as exc:
            length = Raised.of(exc)
        it = iter(loader)
        try:
            it_length = len(it)
        except TypeError as exc:
            it_length = Raised.of(exc)
        return length, it_length, len(list(it))

    conform(scenario)


# ======================================================================================
# Invalid combinations: same exception type and message
# ======================================================================================

def _invalid_cases():
    d = ds.TensorLabelDataset()
    it_ds = cds.RangeIterable(n=4)
    sampler = SequentialSampler(d)
    bsampler = BatchSampler(SequentialSampler(d), 2, False)

    def local_collate(batch):
        return batch

    cases = {
        # at construction
        "negative_num_workers": lambda DL: DL(d, num_workers=-1),
        "negative_timeout": lambda DL: DL(d, timeout=-1),
        "prefetch_factor_without_workers": lambda DL: DL(d, prefetch_factor=2),
        "negative_prefetch_factor": lambda DL: DL(d, num_workers=2, prefetch_factor=-1),
        "persistent_without_workers": lambda DL: DL(d, persistent_workers=True),
        "sampler_and_shuffle": lambda DL: DL(d, sampler=sampler, shuffle=True),
        "batch_sampler_and_batch_size": lambda DL: DL(d, batch_sampler=bsampler, batch_size=4),
        "batch_sampler_and_shuffle": lambda DL: DL(d, batch_sampler=bsampler, shuffle=True),
        "batch_sampler_and_sampler": lambda DL: DL(d, batch_sampler=bsampler, sampler=sampler),
        "batch_sampler_and_drop_last": lambda DL: DL(d, batch_sampler=bsampler, drop_last=True),
        "batch_size_none_and_drop_last": lambda DL: DL(d, batch_size=None, drop_last=True),
        "batch_size_zero": lambda DL: DL(d, batch_size=0),
        "batch_size_negative": lambda DL: DL(d, batch_size=-2),
        "batch_size_float": lambda DL: DL(d, batch_size=2.5),
        "drop_last_not_bool": lambda DL: DL(d, batch_size=2, drop_last="yes"),
        "iterable_and_shuffle": lambda DL: DL(it_ds, shuffle=True),
        "iterable_and_sampler": lambda DL: DL(it_ds, sampler=sampler),
        "iterable_and_batch_sampler": lambda DL: DL(it_ds, batch_sampler=bsampler),
        "shuffle_without_len": lambda DL: DL(cds.NoLenDataset(), shuffle=True),
        # when iterating
        "timeout_without_workers": lambda DL: next(iter(DL(d, timeout=1))),
        "prefetch_factor_zero": lambda DL: next(iter(DL(d, num_workers=2, prefetch_factor=0,
                                                        multiprocessing_context="fork"))),
        "dataset_without_len_iterated": lambda DL: next(iter(DL(
            cds.NoLenDataset(), num_workers=2, multiprocessing_context="fork"))),
        "generator_not_a_generator": lambda DL: next(iter(DL(
            d, num_workers=2, generator="seed", multiprocessing_context="fork"))),
        "collate_fn_not_callable": lambda DL: next(iter(DL(
            d, num_workers=2, collate_fn=5, multiprocessing_context="fork"))),
        "worker_init_fn_not_callable": lambda DL: next(iter(DL(
            d, num_workers=2, worker_init_fn=5, multiprocessing_context="fork"))),
        "index_out_of_range": lambda DL: list(DL(
            TensorDataset(torch.arange(4)), sampler=[0, 9], num_workers=2,
            multiprocessing_context="fork")),
        "collate_mismatched_shapes": lambda DL: list(DL(
            ds.VarLenDataset(), batch_size=4, num_workers=2, multiprocessing_context="fork")),
        "unpicklable_collate_fn_spawn": lambda DL: next(iter(DL(
            d, num_workers=1, collate_fn=local_collate, multiprocessing_context="spawn"))),
        "unpicklable_collate_fn_forkserver": lambda DL: next(iter(DL(
            d, num_workers=1, collate_fn=local_collate, multiprocessing_context="forkserver"))),
        "unpicklable_worker_init_fn_spawn": lambda DL: next(iter(DL(
            d, num_workers=1, worker_init_fn=lambda i: None, multiprocessing_context="spawn"))),
    }
    return cases


@pytest.mark.parametrize("case", list(_invalid_cases()))
def test_invalid_combination_raises_like_torch(case):
    scenario = _invalid_cases()[case]
    theirs, _ = conform(scenario)
    assert theirs.error is not None, "torch accepted it: not an invalid combination"


def test_constructor_signature_matches_torch():
    """torch's parameters first, with the same order, kinds, defaults (what frameworks
    read to rebuild a loader), then fastloader's own: keyword-only, with defaults,
    sharing_strategy among them."""
    theirs = list(inspect.signature(TORCH.__init__).parameters.values())
    ours = list(inspect.signature(FAST.__init__).parameters.values())
    assert ours[:len(theirs)] == theirs
    extra = ours[len(theirs):]
    assert "sharing_strategy" in [p.name for p in extra]
    for p in extra:
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not p.empty, p


# ======================================================================================
# DistributedSampler, and frameworks that rebuild the loader to inject one
# ======================================================================================

DIST_CASES = [
    # (rank, shuffle, drop_last, persistent, set_epoch)
    (0, True, False, False, True),
    (1, True, True, True, True),
    (1, False, False, False, True),
    (0, True, False, True, False),
]


@pytest.mark.parametrize("rank,shuffle,drop_last,persistent,set_epoch", DIST_CASES,
                         ids=[f"rank{r}-shuffle{s}-drop{d}-persistent{p}-set_epoch{e}"
                              for r, s, d, p, e in DIST_CASES])
def test_distributed_sampler_set_epoch(rank, shuffle, drop_last, persistent, set_epoch):
    def scenario(DL):
        dataset = cds.InfoDataset(n=11)
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=shuffle,
                                     seed=17, drop_last=drop_last)
        loader = DL(dataset, batch_size=2, sampler=sampler, num_workers=2, generator=gen(1),
                    persistent_workers=persistent, multiprocessing_context="fork")
        epochs = []
        for epoch in range(3):
            if set_epoch:
                sampler.set_epoch(epoch)
            epochs.append(list(loader))
        return epochs

    theirs, _ = conform(scenario)
    orders = [[i for b in e for i in b["index"].tolist()] for e in theirs.value]
    assert (orders[0] != orders[1]) == (shuffle and set_epoch)


def rebuild_like_a_framework(loader, style, rank, num_replicas=2):
    """What Lightning / accelerate do to inject a distributed sampler: read the
    constructor's signature, collect the same-named attributes from the instance, swap
    the (batch) sampler, and call type(loader)(**kwargs)."""
    params = inspect.signature(type(loader).__init__).parameters
    attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
    attrs["multiprocessing_context"] = loader.multiprocessing_context
    kwargs = {}
    for name, p in params.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in attrs:
            kwargs[name] = attrs[name]
        elif p.default is p.empty:
            raise TypeError(f"cannot rebuild: {name!r} is not an attribute")
    shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = DistributedSampler(loader.dataset, num_replicas=num_replicas, rank=rank,
                                 shuffle=shuffle, seed=3)
    if style == "sampler":            # Lightning
        kwargs.update(sampler=sampler, shuffle=None, batch_sampler=None,
                      batch_size=loader.batch_size, drop_last=loader.drop_last)
    else:                             # a batch sampler around it (accelerate-like)
        kwargs.update(batch_sampler=BatchSampler(sampler, loader.batch_size, loader.drop_last),
                      sampler=None, shuffle=None, batch_size=1, drop_last=False)
    return type(loader)(**kwargs), sampler


REBUILD_CASES = [("sampler", 0, 2, False), ("sampler", 1, 2, True),
                 ("batch_sampler", 1, 2, False), ("batch_sampler", 0, 0, False)]


@pytest.mark.parametrize("style,rank,nw,persistent", REBUILD_CASES,
                         ids=[f"{s}-rank{r}-w{n}-persistent{p}" for s, r, n, p in REBUILD_CASES])
def test_framework_rebuild_with_distributed_sampler(style, rank, nw, persistent):
    def scenario(DL):
        extra = {"sharing_strategy": "file_system"} if DL is FAST else {}
        original = DL(cds.InfoDataset(n=10), batch_size=3, shuffle=True, generator=gen(2),
                      num_workers=nw, persistent_workers=persistent, timeout=30 if nw else 0,
                      prefetch_factor=3 if nw else None, worker_init_fn=cds.record_init,
                      multiprocessing_context="fork" if nw else None, **extra)
        loader, sampler = rebuild_like_a_framework(original, style, rank)
        assert type(loader) is DL
        if DL is FAST:
            assert loader.sharing_strategy == "file_system"
        epochs = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            epochs.append(list(loader))
        return epochs

    conform(scenario)


# ======================================================================================
# Indices as the sampler made them; torch's own dataset classes; DataPipes; pickling
# ======================================================================================

INDEX_CASES = {
    "python_ints": lambda: dict(sampler=[0, 3, 5], batch_size=2),
    "numpy_int64": lambda: dict(sampler=np.arange(4), batch_size=2),
    "numpy_int32_unbatched": lambda: dict(sampler=np.arange(3, dtype=np.int32),
                                          batch_size=None),
    "tensor_indices": lambda: dict(sampler=torch.arange(3), batch_size=2),
    "string_keys": lambda: dict(sampler=["a", "bb", "é"], batch_size=2),
    "tuple_keys": lambda: dict(sampler=[(0, 1), (2, "x")], batch_size=None),
    "large_and_negative": lambda: dict(sampler=[2 ** 40, -1, 2 ** 63 - 1], batch_size=2),
    "batch_sampler_numpy": lambda: dict(batch_sampler=[np.array([0, 1]), np.array([2])]),
    "batch_sampler_tuples": lambda: dict(batch_sampler=[(0, 1), (2, 3, 4)]),
    "batch_sampler_tensor": lambda: dict(batch_sampler=[torch.tensor([1, 2])]),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_indices_reach_the_dataset_unchanged(case):
    def scenario(DL):
        return list(DL(cds.IndexTypeDataset(), num_workers=2, multiprocessing_context="fork",
                       **INDEX_CASES[case]()))

    conform(scenario)


def _torch_dataset(case):
    d = torch.utils.data
    if case == "tensor_dataset":
        return d.TensorDataset(torch.arange(10), torch.arange(10) * 2.5)
    if case == "subset":
        return d.Subset(ds.TensorLabelDataset(), [5, 1, 7, 3, 9])
    if case == "concat":
        return d.ConcatDataset([ds.TensorLabelDataset(4), ds.TensorLabelDataset(5)])
    if case == "stack_dataset":
        return d.StackDataset(a=ds.TensorLabelDataset(6), b=ds.StringDataset(6))
    if case == "random_split":
        return d.random_split(ds.TensorLabelDataset(10), [0.6, 0.4], generator=gen(3))[1]
    if case == "chain_dataset":
        return d.ChainDataset([cds.RangeIterable(n=4, mode="shard"),
                               cds.RangeIterable(n=3, mode="replica")])
    raise ValueError(case)


@pytest.mark.parametrize("case", ["tensor_dataset", "subset", "concat", "stack_dataset",
                                  "random_split", "chain_dataset"])
def test_torch_dataset_classes(case):
    def scenario(DL):
        return list(DL(_torch_dataset(case), batch_size=3, num_workers=2,
                       multiprocessing_context="fork"))

    conform(scenario)


DATAPIPE_CASES = ["sharding_filter", "shuffle_sharding_filter", "no_sharding", "map_datapipe"]


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("case", DATAPIPE_CASES)
def test_datapipes(case, persistent):
    """torch's DataLoader shards an IterDataPipe across workers (sharding_filter), and
    seeds its shuffle with a seed shared by all workers, drawn from the generator."""
    from torch.utils.data.datapipes.iter import IterableWrapper
    from torch.utils.data.datapipes.map import SequenceWrapper

    def scenario(DL):
        if case == "map_datapipe":
            pipe = SequenceWrapper(list(range(10)))
        else:
            pipe = IterableWrapper(list(range(10)))
            if case.startswith("shuffle"):
                pipe = pipe.shuffle()
            if case.endswith("sharding_filter"):
                pipe = pipe.sharding_filter()
        loader = DL(pipe, batch_size=2, num_workers=2, generator=gen(4),
                    persistent_workers=persistent, multiprocessing_context="fork")
        return [list(loader) for _ in range(2)]

    conform(scenario)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize("persistent", [False, True])
def test_loader_pickle_and_deepcopy(persistent, how):
    """A loader can be pickled or deep-copied before iterating (the copy loads the
    same batches); once a persistent loader holds its iterator, it cannot (torch:
    NotImplementedError)."""
    import copy
    import pickle

    def clone(loader):
        if how == "pickle":
            return pickle.loads(pickle.dumps(loader))
        return copy.deepcopy(loader)

    def scenario(DL):
        loader = DL(ds.TensorLabelDataset(8), batch_size=3, shuffle=True, generator=gen(1),
                    num_workers=2, persistent_workers=persistent,
                    multiprocessing_context="fork")
        copied = clone(loader)
        assert type(copied) is DL
        out = [list(copied), list(loader)]
        try:
            clone(loader)
            out.append("copied after iterating")
        except Exception as exc:  # noqa: BLE001
            out.append(exc.__class__)
        return out

    conform(scenario)


# ======================================================================================
# A dead worker (known difference: fastloader.WorkerError, its own message)
# ======================================================================================

def test_dead_worker_raises_a_runtime_error():
    # Worker 1 dies on its first index, before it has sent anything. Were it to die
    # later (at=3), torch's main process could still be fetching worker 1's earlier
    # batch through the fd-passing socket of that worker, and would then raise
    # ConnectionResetError instead of its RuntimeError (1 run in ~40, torch 2.13).
    def scenario(DL):
        loader = DL(ds.WorkerDeathDataset(n=20, at=1, how="exit3"), batch_size=1,
                    num_workers=2, multiprocessing_context="fork")
        for _ in loader:
            pass

    conform(scenario, dead_worker=True)
