"""Batches of indices bigger than what the task ring was sized for (a batch sampler
whose batch size the loader cannot know, or one that varies) reach the workers, as
with torch; one too big for any ring raises in its own turn and loses nothing."""
import os

import pytest
import torch
from torch.utils.data import BatchSampler, SequentialSampler
from torch.utils.data import DataLoader as TorchDataLoader

from fastloader import DataLoader
from tests.support.helpers import collect, deadline
from tests.support.task_datasets import IndexSum, batches_of

MIB = 1 << 20


def _both(**kwargs):
    """The batches of torch's loader and of ours, same arguments."""
    return [collect(cls(IndexSum(), **kwargs), seconds=180)
            for cls in (TorchDataLoader, DataLoader)]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_batches_of_2_17_indices_from_a_batch_sampler_given_as_sampler_arrive_as_with_torch(
        context):
    """sampler=BatchSampler(...) with batch_size=None (a common pattern for tabular
    data): the loader sees no batch size, so the task ring's window was sized for
    small tasks; a task of 1 MiB of indices used to be refused ("does not fit the
    task ring")."""
    sampler = BatchSampler(SequentialSampler(range(8 << 17)), batch_size=1 << 17,
                           drop_last=False)
    torch_batches, ours = _both(sampler=sampler, batch_size=None, num_workers=2,
                                multiprocessing_context=context)
    assert len(ours) == 8
    assert [int(b) for b in ours] == [int(b) for b in torch_batches]


def test_one_big_batch_in_the_middle_of_small_ones_arrives_in_its_place():
    """A batch_sampler of variable batch sizes (no batch_size attribute): the one big
    task widens its worker's ring window; the batches around it are unchanged."""
    sizes = [20] * 6 + [200_000] + [20] * 5
    torch_batches, ours = _both(batch_sampler=batches_of(sizes), num_workers=2,
                                multiprocessing_context="fork")
    assert [b.tolist() for b in ours] == [b.tolist() for b in torch_batches]
    assert len(ours) == len(sizes)


def test_big_tasks_the_ring_has_no_room_for_yet_wait_for_the_worker_in_order():
    """Four tasks of 2-3 MiB handed to a spawned worker before it has read any: the
    fourth finds its ring full (the records before it are unread) and is kept back,
    then sent once the worker has read enough; every batch arrives, in order."""
    sizes = [250_000, 375_000, 375_000, 375_000, 10, 375_000]
    loader = DataLoader(IndexSum(), batch_sampler=batches_of(sizes), num_workers=1,
                        prefetch_factor=4, multiprocessing_context="spawn")
    torch_loader = TorchDataLoader(IndexSum(), batch_sampler=batches_of(sizes),
                                   num_workers=1, prefetch_factor=4,
                                   multiprocessing_context="spawn")
    with deadline(180, "loader"):
        it = iter(loader)
        # the worker is still starting (spawn): nothing of the ring was read yet
        kept_back = it._unsent_count
        ours = [b.tolist() for b in it]
    assert kept_back >= 1
    assert ours == [b.tolist() for b in collect(torch_loader, seconds=180)]


def test_a_task_larger_than_any_ring_is_that_batchs_error_and_loses_nothing():
    """8M indices (64 MiB as int64s, 40 MB pickled) are more than half of the 64 MiB
    ring: that batch raises a ValueError in its turn, naming the size and the
    limit; the batch in hand before it and those after it are delivered."""
    sampler = batches_of([10, 10, 10])
    sampler += [[70_000] * 8_000_000] + batches_of([10, 10], start=30)
    loader = DataLoader(IndexSum(), batch_sampler=sampler, num_workers=2,
                        multiprocessing_context="fork")
    got = []
    with deadline(180, "loader"):
        it = iter(loader)
        while True:
            try:
                got.append(next(it).tolist())
            except StopIteration:
                break
            except ValueError as exc:
                got.append(str(exc))
    assert len(got) == 6, got
    assert "does not fit the task ring" in got[3], got[3]
    assert "in the main process, sending batch 3's task" in got[3], got[3]
    assert got[:3] + got[4:] == [[sum(b)] for b in sampler[:3] + sampler[4:]]
