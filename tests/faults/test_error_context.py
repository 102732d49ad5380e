"""A worker's error names the batch and the indices it was building (or worker_init_fn),
under fork and spawn, and the loader's workers are joined afterwards.

(test_worker_init_fn_exception_reraised here is the fork-and-spawn twin of the one in
test_worker_errors.py: the two modules keep their names apart.)

Every wait runs under `deadline` (SIGALRM) or a subprocess timeout, and
faulthandler_timeout (pyproject) dumps stacks if all else fails.
"""
import pytest
import torch.utils.data

from fastloader import DataLoader, WorkerError
from tests.support import datasets as ds
from tests.support import reliability_datasets as rd
from tests.support.fault_helpers import (
    CONTEXTS, QUIET_WORKER_COUNT_WARNING, _reaped_later, _strategy_for,
)
from tests.support.helpers import deadline

pytestmark = [QUIET_WORKER_COUNT_WARNING]


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_getitem_exception_names_batch_and_indices(ctx):
    """Index 5 is in batch 2 ([4, 5]), which goes to worker 2 % 2 = 0."""
    loader = DataLoader(ds.RaisingDataset(n=20, bad_index=5), batch_size=2, num_workers=2,
                        multiprocessing_context=ctx, sharing_strategy=_strategy_for(ctx))
    got = []
    with deadline(60):
        it = iter(loader)
        pids = list(it.worker_pids)
        with pytest.raises(ValueError) as info:
            for batch in it:
                got.append(batch.flatten().tolist())
    assert type(info.value) is ValueError
    message = str(info.value)
    assert "in DataLoader worker process 0 (batch 2, index [4, 5])" in message, message
    assert "Original Traceback" in message, message
    assert 'raise ValueError(f"bad sample {index}")' in message, message
    assert "bad sample 5" in message, message
    assert got == [[0, 1], [2, 3]], got
    del it, loader, info
    _reaped_later(pids)


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_collate_exception_names_batch_and_indices(ctx):
    loader = DataLoader(ds.TensorLabelDataset(n=16), batch_size=4, num_workers=2,
                        collate_fn=ds.raising_collate, multiprocessing_context=ctx,
                        sharing_strategy=_strategy_for(ctx, 1))
    with deadline(60), pytest.raises(LookupError) as info:
        next(iter(loader))
    assert type(info.value) is LookupError
    message = str(info.value)
    assert "in DataLoader worker process 0 (batch 0, index [0, 1, 2, 3])" in message, message
    assert "Original Traceback" in message and "raising_collate" in message, message
    assert 'raise LookupError(f"collate refused a batch of {len(batch)}")' in message, message
    assert "collate refused a batch of 4" in message, message


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_worker_init_fn_exception_reraised(ctx):
    loader = DataLoader(ds.TensorLabelDataset(n=16), batch_size=4, num_workers=2,
                        worker_init_fn=ds.raising_worker_init, multiprocessing_context=ctx,
                        sharing_strategy=_strategy_for(ctx))
    with deadline(60), pytest.raises(KeyError) as info:
        next(iter(loader))
    assert type(info.value) is KeyError
    message = str(info.value)
    # batch 0 is worker 0's: its init error is what the main process meets first
    assert "in DataLoader worker process 0" in message, message
    assert "worker_init_fn" in message, message
    assert "Original Traceback" in message and "raising_worker_init" in message, message
    assert 'raise KeyError(f"init failed in {worker_id}")' in message, message
    assert "init failed in 0" in message, message


@pytest.mark.parametrize("ctx", CONTEXTS)
def test_unencodable_sample_names_type_and_indices(ctx):
    """Sample 5 holds a generator; batch 1 is indices [4, 5, 6, 7] (worker 1)."""
    loader = DataLoader(rd.UnpicklableDataset(n=16, bad=5), batch_size=4, num_workers=2,
                        collate_fn=rd.list_collate, multiprocessing_context=ctx,
                        sharing_strategy=_strategy_for(ctx))
    got = []
    with deadline(60), pytest.raises(Exception) as info:
        for batch in loader:
            got.append([s["index"] for s in batch])
    message = str(info.value)
    assert not isinstance(info.value, WorkerError), message
    assert "generator" in message, message
    assert "[4, 5, 6, 7]" in message, message
    assert got == [[0, 1, 2, 3]], got


class _IterRaises(torch.utils.data.IterableDataset):
    def __iter__(self):
        raise ValueError("no shard for this worker")


def test_an_iterable_datasets_iter_error_names_iter_not_worker_init_fn():
    """Without a worker_init_fn, an error in __iter__ was said to come from one."""
    loader = DataLoader(_IterRaises(), batch_size=2, num_workers=1,
                        multiprocessing_context="fork")
    with deadline(60), pytest.raises(ValueError) as info:
        next(iter(loader))
    message = str(info.value)
    assert "in DataLoader worker process 0 (in the dataset's __iter__)" in message, message
    assert "worker_init_fn" not in message, message
    assert "no shard for this worker" in message, message


class _IterRaisesLater(torch.utils.data.IterableDataset):
    """Yields 0..3 in its replica's first epoch; its __iter__ raises in later ones."""

    def __init__(self):
        self.epochs = 0

    def __iter__(self):
        self.epochs += 1
        if self.epochs > 1:
            raise ValueError("no shard for this epoch")
        return iter(range(4))


def test_an_iter_error_when_persistent_workers_resume_is_raised_by_next():
    """Persistent workers run __iter__ again at each epoch's start: its error is the
    epoch's first batch's, naming __iter__, as in the first epoch, and the worker
    lives on. (The worker used to exit, and iter() raised WorkerError.)"""
    loader = DataLoader(_IterRaisesLater(), batch_size=2, num_workers=1,
                        persistent_workers=True, multiprocessing_context="fork")
    with deadline(60):
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
        pids = loader._iterator.worker_pids
        it = iter(loader)
        with pytest.raises(ValueError) as info:
            next(it)
        message = str(info.value)
        assert "in DataLoader worker process 0 (in the dataset's __iter__)" in message, message
        assert "no shard for this epoch" in message, message
        assert it.worker_pids == pids
        assert all(w.is_alive() for w in it._workers)


def _local_error_class():
    class LocalError(Exception):
        pass
    return LocalError


class _RaisesUnpicklable(torch.utils.data.Dataset):
    """Index 1 raises an exception whose class, made inside a function, cannot be
    pickled (fork only: the dataset itself is never pickled)."""

    def __init__(self):
        self.error = _local_error_class()

    def __len__(self):
        return 3

    def __getitem__(self, index):
        if index == 1:
            raise self.error("local boom")
        return index


def test_an_exception_whose_class_cannot_be_pickled_arrives_as_a_runtime_error():
    """torch's worker cannot send it, and its main process waits for the batch for
    ever (or for `timeout`); fastloader raises it in its turn as a RuntimeError that
    names the class, with the worker's traceback, and the batches around it arrive."""
    loader = DataLoader(_RaisesUnpicklable(), batch_size=None, num_workers=1,
                        multiprocessing_context="fork")
    with deadline(60):
        it = iter(loader)
        assert int(next(it)) == 0
        with pytest.raises(RuntimeError) as info:
            next(it)
        assert int(next(it)) == 2
        with pytest.raises(StopIteration):
            next(it)
    message = str(info.value)
    assert type(info.value) is RuntimeError
    assert "in DataLoader worker process 0 (batch 1, index 1)" in message, message
    assert "_local_error_class.<locals>.LocalError that cannot be pickled" in message, message
    assert "LocalError: local boom" in message and 'raise self.error("local boom")' in message


class _HoldsALambda:
    """An index that cannot be pickled (its lambda is a local object)."""

    def __init__(self, i):
        self.i = i
        self.f = lambda: i


class _IndexOrHolder(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return getattr(i, "i", i)


class _BatchFiveUnpicklable:
    """Batches of 4 in order; batch 5's indices cannot be pickled."""

    def __iter__(self):
        for b in range(10):
            batch = list(range(b * 4, b * 4 + 4))
            yield [_HoldsALambda(i) for i in batch] if b == 5 else batch

    def __len__(self):
        return 10


@pytest.mark.parametrize("prefetch_factor", [1, 4])
def test_indices_that_cannot_be_pickled_fail_their_own_batch(prefetch_factor):
    """A batch sampler yields indices that cannot be pickled for batch 5. torch's
    loader waits until `timeout` for it; here batch 5 raises the pickling error in
    its turn, naming it, and the batches before and after it arrive. It was raised
    from the iter() or next() that sent batch 5's task, and that next()'s own
    batch was lost."""
    loader = DataLoader(_IndexOrHolder(), batch_sampler=_BatchFiveUnpicklable(),
                        num_workers=2, prefetch_factor=prefetch_factor)
    got, errors = [], []
    with deadline(60):
        it = iter(loader)
        for _ in range(11):
            try:
                got.append(next(it).tolist())
            except StopIteration:
                break
            except AttributeError as e:   # what pickle raises for a local object
                errors.append((len(got), str(e)))
    assert got == [list(range(b * 4, b * 4 + 4)) for b in range(10) if b != 5], got
    assert len(errors) == 1 and errors[0][0] == 5, errors
    assert "in the main process, pickling batch 5's indices" in errors[0][1], errors
    assert "Can't pickle local object" in errors[0][1], errors
