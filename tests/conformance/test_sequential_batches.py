"""torch's default unshuffled sampler is sent as ranges (index_batches.py): the
dataset must still receive exactly what torch's DataLoader hands it, a list with
the same ints, batch for batch; only that exact sampler pair takes the path, and
a range that the user's own sampler yields still reaches the dataset as a range."""
import functools
import os
import subprocess
import sys

import pytest
import torch
import torch.utils.data
from torch.utils.data import BatchSampler, Dataset, RandomSampler, Sampler, SequentialSampler

import fastloader
from fastloader import index_batches
from fastloader import iterator as iterator_module
from fastloader.protocol import Replay
from tests.support import torch_features as tf
from tests.support.helpers import loopback_channels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TorchLoader = torch.utils.data.DataLoader
FastLoader = fastloader.DataLoader


class SeenIndices(Dataset):
    """A batch is what ``__getitems__`` received: its type's name and its ints
    (as strings, so ints beyond int64 come back too)."""

    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return ("int", str(index))

    def __getitems__(self, indices):
        return [(type(indices).__name__, str(i)) for i in indices]


def seen(loader, epochs=1):
    return [(list(kinds), list(ints)) for _ in range(epochs) for kinds, ints in loader]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [1, 7, 64])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
def test_the_dataset_gets_the_lists_torch_gives_it(length, batch_size, drop_last):
    kwargs = dict(batch_size=batch_size, drop_last=drop_last)
    expected = seen(TorchLoader(SeenIndices(length), **kwargs))
    got = seen(FastLoader(SeenIndices(length), num_workers=2, **kwargs))
    assert got == expected
    assert all(kind == "list" for kinds, _ in got for kind in kinds)


def test_the_length_is_read_anew_every_epoch():
    dataset = SeenIndices(10)
    fast = FastLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True)
    reference = TorchLoader(dataset, batch_size=4)
    first = (seen(fast), seen(reference))
    dataset.length = 13
    second = (seen(fast), seen(reference))
    assert first[0] == first[1] and second[0] == second[1]
    assert len(second[0]) == 4 and second[0][-1][1] == ["12"]


class RangeBatches(Sampler):
    """A user's batch sampler that yields ranges: torch hands the dataset ranges."""

    def __init__(self, length, size):
        self.length, self.size = length, size

    def __iter__(self):
        return (range(s, min(s + self.size, self.length)) for s in range(0, self.length, self.size))

    def __len__(self):
        return -(-self.length // self.size)


def test_a_range_from_the_users_sampler_reaches_the_dataset_as_a_range():
    expected = seen(TorchLoader(SeenIndices(20), batch_sampler=RangeBatches(20, 6)))
    got = seen(FastLoader(SeenIndices(20), batch_sampler=RangeBatches(20, 6), num_workers=2))
    assert got == expected
    assert {kind for kinds, _ in got for kind in kinds} == {"range"}


class MyBatchSampler(BatchSampler):
    pass


class MySequentialSampler(SequentialSampler):
    pass


@pytest.mark.skipif(tf.VERSION < (2, 6),
                    reason=f"torch {torch.__version__}'s BatchSampler reads batch_size "
                           "otherwise (2.5 and older): no batches are sent as ranges")
def test_only_torchs_exact_unpatched_pair_is_sent_as_ranges(monkeypatch):
    # torch's BatchSampler slices its sampler's iterator (islice, zip) since 2.6
    assert index_batches._reads_batch_size_as_ranges_do()
    data = SeenIndices(10)
    assert index_batches.sequential_batches(BatchSampler(SequentialSampler(data), 3, False))
    for other in (MyBatchSampler(SequentialSampler(data), 3, False),
                  BatchSampler(MySequentialSampler(data), 3, False),
                  BatchSampler(RandomSampler(data), 3, False),
                  SequentialSampler(data)):
        assert index_batches.sequential_batches(other) is None, other

    # a patched BatchSampler.__iter__ is honoured, as torch's DataLoader honours it
    original = BatchSampler.__iter__

    def reversed_batches(self):
        for batch in original(self):
            yield batch[::-1]

    monkeypatch.setattr(BatchSampler, "__iter__", functools.wraps(original)(reversed_batches))
    assert index_batches.sequential_batches(BatchSampler(SequentialSampler(data), 3, False)) is None
    expected = seen(TorchLoader(SeenIndices(10), batch_size=3))
    assert expected[0][1] == ["2", "1", "0"]
    assert seen(FastLoader(SeenIndices(10), batch_size=3, num_workers=2)) == expected


PATCHED_BEFORE_IMPORT = """
import torch.utils.data as data
original = data.SequentialSampler.__iter__
data.SequentialSampler.__iter__ = lambda self: iter(reversed(list(original(self))))
import fastloader
loader = fastloader.DataLoader(list(range(10)), batch_size=4, num_workers=2)
print([b.tolist() for b in loader])
"""


def test_a_patch_made_before_fastloader_is_imported_is_honoured():
    done = subprocess.run([sys.executable, "-c", PATCHED_BEFORE_IMPORT], capture_output=True,
                          text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[[9, 8, 7, 6], [5, 4, 3, 2], [1, 0]]"


def test_a_batch_size_changed_mid_epoch_is_read_as_torch_reads_it():
    def run(cls, **kwargs):
        loader = cls(SeenIndices(30), batch_size=4, **kwargs)
        out = []
        for i, (kinds, ints) in enumerate(loader):
            out.append(list(ints))
            if i == 0:
                loader.batch_sampler.batch_size = 3
        return out

    expected = run(TorchLoader, num_workers=2)
    assert run(FastLoader, num_workers=2) == expected
    assert {3, 4} <= {len(b) for b in expected}   # the change took effect mid-epoch


def test_put_index_writes_a_range_as_its_list_or_declines_it():
    """The C core, both ends in this process: a range goes into the task ring as
    the list of its ints (the worker reads that list), or put_index answers False
    and nothing is queued (the caller then pickles the list)."""
    with loopback_channels("ranges") as (main, worker):
        sent = [range(5, -7, -3), range(2**63 - 4, 2**63 - 1), range(-2**63, -2**63 + 3),
                range(-3, 3, 2**62), range(-2**63, 2**63 - 1, 2**63 + 1), range(7, 8)]
        declined = [range(0), range(2**63 - 2, 2**63 + 1), range(0, 2**70, 2**68),
                    range(-2**63, 2**63 - 1), range(0, 2**61), range(2**62), range(1 << 14)]
        for seq, r in enumerate(sent):
            assert main.put_index(seq, r) is True, r
            kind, got_seq, index = worker.get_task()
            assert (got_seq, index, type(index)) == (seq, list(r), list), r
        for r in declined:
            assert main.put_index(99, r) is False, r
        assert main.put_index(100, [1, 2]) is True   # nothing was left queued before it
        assert worker.get_task()[1:] == (100, [1, 2])


def test_ranges_at_and_beyond_the_int64_limits_arrive_as_their_lists(monkeypatch):
    """The C core writes a range's ints without making them; ends outside int64
    take the pickle path, as a list of such ints does. Either way the dataset gets
    the list."""
    batches = [range(5, -7, -3), range(2**63 - 4, 2**63 - 1), range(-2**63, -2**63 + 3),
               range(2**63 - 2, 2**63 + 1), range(0, 2**70, 2**68), range(-3, 3, 2**62)]
    monkeypatch.setattr(iterator_module, "sequential_batches", lambda sampler: iter(batches))
    got = seen(FastLoader(SeenIndices(10), batch_size=3, num_workers=2))
    assert got == [(["list"] * len(r), [str(i) for i in r]) for r in batches]


@pytest.mark.parametrize("every", [0, 2])
@pytest.mark.parametrize("k", [1, 5])
def test_a_resumed_unshuffled_epoch_replays_lists(k, every, monkeypatch):
    """Resume draws the interrupted run's batches again and replays some in the
    workers: those too reach the dataset as torch's lists."""
    kwargs = dict(batch_size=3, num_workers=2, snapshot_every_n_steps=every)
    full = seen(FastLoader(SeenIndices(40), **kwargs))
    first = FastLoader(SeenIndices(40), **kwargs)
    it = iter(first)
    head = [(list(kinds), list(ints)) for kinds, ints in (next(it) for _ in range(k))]
    state = first.state_dict()
    del it, first
    replayed = []
    encode = iterator_module.encode_control

    def recording(message):
        if isinstance(message, Replay):
            replayed.append(type(message.index))
        return encode(message)

    monkeypatch.setattr(iterator_module, "encode_control", recording)
    second = FastLoader(SeenIndices(40), **kwargs)
    second.load_state_dict(state)
    assert head + seen(second) == full
    assert full == seen(TorchLoader(SeenIndices(40), batch_size=3))
    if every:   # workers snapshot every 2 steps: the tasks since are replayed
        assert replayed and set(replayed) == {list}, replayed
    else:
        assert set(replayed) <= {list}, replayed
