"""Batches of indices bigger than what the task ring was sized for (a batch sampler
whose batch size the loader cannot know, or one that varies) reach the workers, as
with torch; one too big for any ring raises in its own turn and loses nothing."""
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


class _WhatItGets(torch.utils.data.Dataset):
    """Each sample: what the dataset was given as its index (a tensor), as data."""
    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        assert type(i) is torch.Tensor, type(i)
        return {"value": i.clone(), "dtype": str(i.dtype), "shape": tuple(i.shape),
                "stride": i.stride()}


@pytest.mark.parametrize("how", ["subset_sampler", "tensor_sampler", "split_batches"])
def test_indices_that_are_views_of_one_big_index_tensor_arrive_as_with_torch(how):
    """A sampler yielding the elements of a 100k-index tensor (or a batch sampler
    yielding slices of a 1M-element permutation): plain pickle wrote the whole
    storage for each index, 51 MB per batch of 64, which the task ring refused
    ("does not fit the task ring"), and each batch cost the main process ms."""
    def loader(cls):
        torch.manual_seed(0)
        if how == "subset_sampler":
            kwargs = dict(sampler=torch.utils.data.SubsetRandomSampler(
                torch.arange(0, 200_000, 2)), batch_size=64)
        elif how == "tensor_sampler":
            kwargs = dict(sampler=iter(torch.randperm(100_000)), batch_size=64)
        else:
            kwargs = dict(batch_sampler=torch.randperm(1 << 20).split(64)[:20])
        return cls(_WhatItGets(), num_workers=2, multiprocessing_context="fork",
                   timeout=120, **kwargs)

    def first_batches(cls):
        it = iter(loader(cls))
        return [next(it) for _ in range(5)]

    theirs, ours = first_batches(TorchDataLoader), first_batches(DataLoader)
    for a, b in zip(theirs, ours):
        assert torch.equal(a["value"], b["value"])
        assert (a["dtype"], a["shape"], a["stride"]) == (b["dtype"], b["shape"], b["stride"])


def test_tensor_indices_keep_dtype_shape_strides_and_bytes():
    """Any dtype and layout a sampler may yield reaches the dataset as torch's
    transport delivers it, but for its storage offset and size."""
    import pickle

    from fastloader.index_pickle import dumps_indices

    base = torch.arange(60, dtype=torch.float64).view(6, 10)
    cases = [base[2, 3], base[1:, ::3], base.t(), base[:0], torch.arange(6).expand(4, 6),
             torch.tensor([1.5, -0.0], dtype=torch.bfloat16), torch.tensor(7, dtype=torch.uint8)]
    got = pickle.loads(dumps_indices(cases + [cases[1]]))
    assert got[-1] is got[1]   # one object pickled twice is one object, as with pickle
    for t, g in zip(cases, got):
        assert (g.dtype, g.shape, g.stride()) == (t.dtype, t.shape, t.stride())
        assert torch.equal(g, t)
    # only the bytes an index reaches travel: one float64 of the 60
    assert got[0].untyped_storage().nbytes() == 8


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_nested_and_default_device_tensor_indices_pickle_as_before():
    """A nested tensor keeps pickle's own reduction (it has no strides to span),
    and a tensor index pickles under torch.set_default_device() (the span was
    made on the default device, which refused a CPU storage)."""
    import pickle

    from fastloader.index_pickle import dumps_indices

    nested = torch.nested.nested_tensor([torch.arange(2), torch.arange(3)])
    got = pickle.loads(dumps_indices([nested]))[0]
    assert got.is_nested and [t.tolist() for t in got.unbind()] == [[0, 1], [0, 1, 2]]
    index = torch.arange(10)[3]
    with torch.device("meta"):
        blob = dumps_indices([index])
    got = pickle.loads(blob)[0]
    assert got.device.type == "cpu" and int(got) == 3 and got.untyped_storage().nbytes() == 8
