"""Exceptions raised by user code in a worker (__getitem__, collate_fn, worker_init_fn,
an unencodable sample) are re-raised in the main process with their own type, the
worker's number and its original traceback.

Every wait runs under `deadline` (SIGALRM) or a subprocess timeout, and
faulthandler_timeout (pyproject) dumps stacks if all else fails.
"""
import re
import sys

import pytest

import fastloader
from fastloader import DataLoader, FastLoaderError, WorkerError
from tests.support import datasets as ds
from tests.support.fault_helpers import QUIET_WORKER_COUNT_WARNING
from tests.support.helpers import deadline

pytestmark = [QUIET_WORKER_COUNT_WARNING]


def test_exception_hierarchy():
    assert issubclass(WorkerError, FastLoaderError)
    assert issubclass(WorkerError, RuntimeError)
    assert fastloader.WorkerError is WorkerError


@pytest.mark.parametrize("ctx,nw,strategy,bad_index,worker", [
    ("fork", 2, "file_descriptor", 5, 1),   # batch 5 goes to worker 5 % 2 (round robin)
    ("fork", 3, "file_system", 6, 0),
    ("spawn", 1, "file_descriptor", 3, 0),
])
def test_getitem_exception_reraised_with_type_and_traceback(ctx, nw, strategy, bad_index, worker):
    loader = DataLoader(ds.RaisingDataset(bad_index=bad_index), batch_size=1, num_workers=nw,
                        multiprocessing_context=ctx, sharing_strategy=strategy)
    got = []
    with deadline(60):
        it = iter(loader)
        with pytest.raises(ValueError) as info:
            for batch in it:
                got.append(int(batch))
    assert type(info.value) is ValueError
    message = str(info.value)
    assert f"in DataLoader worker process {worker}" in message, message
    assert "Original Traceback" in message, message
    # the worker's traceback text: file, function, source line and original message
    assert "datasets.py" in message and "__getitem__" in message, message
    assert 'raise ValueError(f"bad sample {index}")' in message, message
    assert f"bad sample {bad_index}" in message, message
    assert got == list(range(bad_index)), "batches before the failing one must arrive in order"
    del it, loader


@pytest.mark.parametrize("exc", [KeyboardInterrupt, GeneratorExit])
def test_a_base_exception_in_getitem_is_a_worker_error_not_itself(exc):
    """A KeyboardInterrupt (or GeneratorExit) raised by the dataset kills torch's
    worker, and torch's main process raises RuntimeError ("exited unexpectedly").
    It was re-raised as itself in the main process, where a KeyboardInterrupt
    reads as the user's Ctrl-C. Now: a WorkerError (a RuntimeError) naming it,
    after the batches before it."""
    loader = DataLoader(ds.BaseExceptionDataset(exc, bad_index=5), batch_size=1,
                        num_workers=2, multiprocessing_context="fork", timeout=60)
    got = []
    with deadline(90):
        with pytest.raises(WorkerError) as info:
            for batch in loader:
                got.append(int(batch))
    assert got == list(range(5))
    message = str(info.value)
    assert "exited unexpectedly" in message and f"{exc.__name__} raised" in message, message
    assert "the dataset raised this at 5" in message, message   # its traceback


def test_collate_exception_reraised():
    loader = DataLoader(ds.TensorLabelDataset(), batch_size=4, num_workers=2,
                        collate_fn=ds.raising_collate, multiprocessing_context="fork")
    with deadline(30), pytest.raises(LookupError) as info:
        next(iter(loader))
    assert type(info.value) is LookupError
    message = str(info.value)
    assert "in DataLoader worker process 0" in message, message
    assert "Original Traceback" in message and "raising_collate" in message, message
    assert "collate refused a batch of 4" in message, message


def test_worker_init_fn_exception_reraised():
    loader = DataLoader(ds.TensorLabelDataset(), batch_size=4, num_workers=2,
                        worker_init_fn=ds.raising_worker_init, multiprocessing_context="fork",
                        sharing_strategy="file_system")
    with deadline(30), pytest.raises(KeyError) as info:
        next(iter(loader))
    assert type(info.value) is KeyError
    message = str(info.value)
    assert re.search(r"in DataLoader worker process \d", message), message
    assert "Original Traceback" in message and "raising_worker_init" in message, message
    assert "init failed in" in message, message


def test_unencodable_sample_names_the_type():
    loader = DataLoader(ds.LockDataset(), batch_size=2, num_workers=1,
                        collate_fn=ds.list_collate, multiprocessing_context="fork")
    with deadline(10), pytest.raises(Exception) as info:
        next(iter(loader))
    assert "lock" in str(info.value).lower(), str(info.value)


def _rebuild_note(batch, worker):
    return (f"fastloader: raised in the main process while rebuilding batch {batch} of "
            f"the epoch (counted from 0), which DataLoader worker process {worker} built "
            f"and sent without error")


def _epoch_with_caught_errors(loader):
    """Every batch as its first ints, or ("error", the exception, its notes then)."""
    got = []
    it = iter(loader)
    with deadline(120):
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return got
            except ValueError as error:
                got.append(("error", error, list(getattr(error, "__notes__", []))))
                continue
            samples = batch if loader.batch_size else [batch]
            got.append([int(sample[0]) for sample in samples])


@pytest.mark.parametrize("how", ["plain", "odd_notes"])
@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_batch_the_main_process_cannot_rebuild_raises_in_its_turn(batch_size, how):
    """A batch that arrives but cannot be rebuilt in the main process (an object
    whose unpickling fails there) raises its own exception at its turn; the
    batches before and after it are delivered. It once raised and lost the
    batch's place: the next next() waited for it for ever. An exception class
    that takes no note (its __notes__ is no list) is raised as it is."""
    dataset = ds.FailsToArriveDataset(n=16, bad=5, how=how)
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=2, timeout=30,
                        collate_fn=ds.list_collate if batch_size else None,
                        multiprocessing_context="fork")
    got = _epoch_with_caught_errors(loader)
    bad = 5 if batch_size is None else 1
    expected = [[i] for i in range(16)] if batch_size is None else \
        [[4 * b + i for i in range(4)] for b in range(4)]
    assert [b if b[0] != "error" else "error" for b in got] == \
        expected[:bad] + ["error"] + expected[bad + 1:]
    _, error, notes = got[bad]
    # unchanged, as torch raises an unpickling error (tests/transport/test_aliasing.py)
    assert type(error) is (ds.NotesNotAList if how == "odd_notes" else ValueError)
    assert str(error) == "sample 5 cannot be rebuilt in the main process"
    # with a note of whose batch it was (round robin: batch `bad` is worker 1's)
    if sys.version_info >= (3, 11) and how == "plain":
        assert notes == [_rebuild_note(bad, 1)]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_one_exception_object_raised_for_two_batches_names_each_in_its_turn():
    loader = DataLoader(ds.FailsToArriveDataset(n=8, bad=(2, 5), how="shared"), batch_size=None,
                        num_workers=2, timeout=30, multiprocessing_context="fork")
    got = _epoch_with_caught_errors(loader)
    errors = [(i, b) for i, b in enumerate(got) if b[0] == "error"]
    assert [i for i, _ in errors] == [2, 5]
    assert all(error is ds.SHARED_REBUILD_ERROR for _, (_, error, _) in errors)
    assert [notes for _, (_, _, notes) in errors] == [[_rebuild_note(2, 0)], [_rebuild_note(5, 1)]]
