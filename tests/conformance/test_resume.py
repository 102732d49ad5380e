"""Mid-epoch resume: stop after k batches, save, restore into a fresh loader (as
a restarted job would), and the rest of the epoch equals an uninterrupted run,
batch by batch, including values drawn from worker RNGs."""
import functools
import gc
import random
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

import fastloader
from tests.support import resume_datasets as rd
from tests.support import torch_features as tf
from tests.support.fault_helpers import workers_cannot_start
from tests.support.helpers import assert_same_batch_lists, clone_batch, deadline, wait_until

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]


def make(dataset, seed=7, **kw):
    kw.setdefault("num_workers", 2)
    return fastloader.DataLoader(dataset, generator=torch.Generator().manual_seed(seed), **kw)


def epochs(loader, n):
    return [[clone_batch(b) for b in loader] for _ in range(n)]


def interrupted(dataset, k, epoch=0, **kw):
    """Run `epoch` full epochs, then k batches of the next; save; resume elsewhere."""
    first = make(dataset, **kw)
    for _ in range(epoch):
        for _ in first:
            pass
    it = iter(first)
    head = [clone_batch(next(it)) for _ in range(k)]
    state = first.state_dict()
    del it, first
    second = make(dataset, seed=999, **kw)   # a different RNG: the state must win
    second.load_state_dict(state)
    return head, [clone_batch(b) for b in second]


@pytest.mark.parametrize("k", [0, 1, 5, 11])
@pytest.mark.parametrize("every", [0, 2])
def test_map_style_shuffled_resume_matches_uninterrupted(k, every):
    ds = rd.RandomAugmented(60)
    kw = dict(batch_size=4, shuffle=True, snapshot_every_n_steps=every)
    (full,) = epochs(make(ds, **kw), 1)
    head, tail = interrupted(ds, k, **kw)
    assert_same_batch_lists(full[:k], head, "before the stop")
    assert_same_batch_lists(full[k:], tail, f"resumed after {k}")


@pytest.mark.parametrize("every", [0, 1])
@pytest.mark.parametrize("k", [0, 1, 3, 9])
def test_persistent_workers_resume_in_second_epoch(k, every):
    """k=0 and 1: saved before a worker's first batch of the epoch arrived; its RNGs
    carry on from the last epoch, and it used to resume freshly seeded."""
    ds = rd.RandomAugmented(40)
    kw = dict(batch_size=4, shuffle=True, persistent_workers=True,
              snapshot_every_n_steps=every)
    full = epochs(make(ds, **kw), 2)
    head, tail = interrupted(ds, k, epoch=1, **kw)
    assert_same_batch_lists(full[1][:k], head, "epoch 2 before the stop")
    assert_same_batch_lists(full[1][k:], tail, f"epoch 2 resumed after {k}")


@pytest.mark.parametrize("every", [0, 2])
@pytest.mark.parametrize("k", [2, 3, 6])
def test_a_stream_that_resets_in_its_iterator_resumes_a_later_persistent_epoch(k, every):
    """Its state_dict() at a persistent epoch's start, before the first batch, still
    says where the last epoch ended: resuming from it lost the epoch (0 of 24
    samples). Once each worker has delivered a batch, the state taken after it is
    the one to resume from (torchdata's StatefulDataLoader resumes there too)."""
    kw = dict(batch_size=3, persistent_workers=True, snapshot_every_n_steps=every)
    full = epochs(make(rd.LazyResetStream(24), **kw), 2)
    assert sorted(x for b in full[1] for x in b["x"].tolist()) == list(range(24))
    head, tail = interrupted(rd.LazyResetStream(24), k, epoch=1, **kw)
    assert_same_batch_lists(full[1][:k], head, "epoch 2 before the stop")
    assert_same_batch_lists(full[1][k:], tail, f"epoch 2 resumed after {k}")


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("every", [1, 2])
def test_a_dataset_state_dict_returning_its_live_state_resumes(every, workers):
    """The snapshot held the dataset's own dict, which the worker read only when it
    sent the batch, after the fetch had moved it on: a resume skipped samples. The
    loader's state, kept while the loop goes on, must not move with it either."""
    kw = dict(batch_size=3, snapshot_every_n_steps=every, num_workers=workers)
    (full,) = epochs(make(rd.LiveStateStream(24), **kw), 1)
    for k in (2, 3, 5):
        loader = make(rd.LiveStateStream(24), **kw)
        it = iter(loader)
        head = [clone_batch(next(it)) for _ in range(k)]
        state = loader.state_dict()
        next(it)   # the loop goes on after the checkpoint
        del it, loader
        second = make(rd.LiveStateStream(24), seed=99, **kw)
        second.load_state_dict(state)
        got = head + [clone_batch(b) for b in second]
        assert [b["x"].tolist() for b in got] == [b["x"].tolist() for b in full], k


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("every", [1, 2])
def test_a_stream_that_resets_in_its_iterator_resumes_a_resumed_run(every, persistent):
    """A resumed worker that restored a snapshot with nothing to replay asked such a
    dataset for its state again before its next batch, when it still said 0: the
    resume of that run repeated samples. The restored snapshot is that state."""
    kw = dict(batch_size=3, snapshot_every_n_steps=every, persistent_workers=persistent)
    full = epochs(make(rd.LazyResetStream(24), **kw), 2)
    loader = make(rd.LazyResetStream(24), **kw)
    for _ in loader:
        pass
    head, s1 = _stop_after(loader, 2)
    second = make(rd.LazyResetStream(24), seed=99, **kw)
    second.load_state_dict(s1)
    mid, s2 = _stop_after(second, 2)
    third = make(rd.LazyResetStream(24), seed=5, **kw)
    third.load_state_dict(s2)
    assert_same_batch_lists(full[1], head + mid + [clone_batch(b) for b in third],
                            "epoch 2 across three runs")


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("kind, epoch", [("stateful", 0), ("plain", 0), ("lazy_reset", 0),
                                         ("lazy_reset", 1)])
def test_a_single_process_iterable_resumes_where_it_stopped(kind, epoch, k):
    """num_workers=0 skipped the yielded batches' indices, which for an iterable
    moves nothing: the resumed epoch started its stream over (0,1 | 0,1,...,7).
    Its position is saved (a stateful dataset) or its batches replayed. (Values
    drawn in the main process come from the user's RNGs: only `x` is compared.
    CountingStream, read in this process, ends its second epoch at once: torch's
    loader too.)"""
    def dataset():
        if kind == "lazy_reset":
            return rd.LazyResetStream(16)
        return rd.CountingStream(16, stateful=kind == "stateful")
    kw = dict(batch_size=2, num_workers=0)
    full = epochs(make(dataset(), **kw), epoch + 1)[epoch]
    first = make(dataset(), **kw)
    for _ in range(epoch):
        for _ in first:
            pass
    head, state = _stop_after(first, k)
    assert ("dataset" in state) == (kind != "plain")
    second = make(dataset(), seed=999, **kw)
    second.load_state_dict(state)
    got = head + [clone_batch(b) for b in second]
    assert [b["x"].tolist() for b in got] == [b["x"].tolist() for b in full]


def _taking_errors(it, n=None):
    """Up to n calls of next(it), an error caught as "E" (a loop that skips bad
    batches)."""
    out = []
    while n is None or len(out) < n:
        try:
            out.append(next(it).tolist())
        except StopIteration:
            break
        except ValueError:
            out.append("E")
    return out


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("dataset", [rd.RaisingStream(12, bad=(3,)),
                                     rd.RaisingItems(12, bad=(3,))],
                         ids=["iterable", "map-style"])
def test_a_single_process_run_that_caught_an_error_resumes_after_it(dataset, k):
    """num_workers=0 counted only the batches yielded, not the one whose fetch
    raised (torch's count): a resume after a caught error fetched a batch again."""
    kw = dict(batch_size=2, num_workers=0)
    full = _taking_errors(iter(torch.utils.data.DataLoader(dataset, batch_size=2)))
    assert full[1] == "E"
    first = make(dataset, **kw)
    it = iter(first)
    head = _taking_errors(it, k)
    state = first.state_dict()
    del it, first
    second = make(dataset, seed=999, **kw)
    second.load_state_dict(state)
    assert head + _taking_errors(iter(second)) == full


def test_a_single_process_state_saved_right_after_a_resume_keeps_its_position():
    """Saved again before the resumed run's first batch: the dataset, whose loaded
    position applies only once its __iter__'s body runs, still said 0 then, and
    the third run started the stream over."""
    kw = dict(batch_size=2, num_workers=0)
    (full,) = epochs(make(rd.LazyResetStream(14), **kw), 1)
    head, s1 = _stop_after(make(rd.LazyResetStream(14), **kw), 2)
    second = make(rd.LazyResetStream(14), **kw)
    second.load_state_dict(s1)
    it = iter(second)
    s2 = second.state_dict()
    del it
    third = make(rd.LazyResetStream(14), **kw)
    third.load_state_dict(s2)
    got = head + [clone_batch(b) for b in third]
    assert [b["x"].tolist() for b in got] == [b["x"].tolist() for b in full]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_loaded_twice_resumes_twice(workers):
    """A dataset that keeps the dict load_state_dict() gives it, and moves it on:
    without workers it was the user's own state, and a second resume from it
    started at the end."""
    kw = dict(batch_size=2, num_workers=workers)
    head, state = _stop_after(make(rd.KeepsLoadedStream(12), **kw), 2)
    for _ in range(2):
        loader = make(rd.KeepsLoadedStream(12), **kw)
        loader.load_state_dict(state)
        got = head + [clone_batch(b) for b in loader]
        assert sorted(x for b in got for x in b.tolist()) == sorted(list(range(12)) * max(1, workers))


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("stateful", [True, False])
def test_an_iter_that_draws_when_called_resumes_the_workers_randomness(stateful, k):
    """A resumed worker restored its RNGs, then called the dataset's __iter__,
    which drew once more: every later value was shifted by one draw."""
    kw = dict(batch_size=2)
    (full,) = epochs(make(rd.EagerDrawStream(12, stateful), **kw), 1)
    head, tail = interrupted(rd.EagerDrawStream(12, stateful), k, **kw)
    assert_same_batch_lists(full[:k], head, "before the stop")
    assert_same_batch_lists(full[k:], tail, f"resumed after {k}")


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("stateful", [False, True])
def test_a_worker_whose_stream_ended_with_a_batch_not_yet_yielded_resumes_it(
        tmp_path, stateful, persistent):
    """Worker 0's batch 6 and its end of stream arrive while batch 5 (worker 1's) is
    awaited; a state saved after batch 5 marked worker 0 as ended, and the resumed
    epoch never yielded its batch 6."""
    gate, ended = tmp_path / "gate", tmp_path / "ended"
    kw = dict(batch_size=2, persistent_workers=persistent)
    gate.touch()
    (full,) = epochs(make(rd.GatedStream(16, 9, gate, ended, stateful), **kw), 1)
    assert [b["x"].tolist() for b in full][5:] == [[9, 11], [12, 14], [13, 15]]
    gate.unlink()
    ended.unlink()
    first = make(rd.GatedStream(16, 9, gate, ended, stateful), **kw)
    it = iter(first)
    head = [clone_batch(next(it)) for _ in range(5)]
    wait_until(ended.exists, 60)   # worker 0 is done: batch 6 and its end are sent
    time.sleep(0.2)
    # batch 5 is let go once next() waits for it: that wait takes worker 0's batch 6
    # and end first (let go before, on a loaded box batch 5 could be there before
    # next() looked, and next() returned it without reading worker 0's ring)
    opener = threading.Timer(1.0, gate.touch)
    opener.start()
    head.append(clone_batch(next(it)))   # batch 5, worker 1's
    opener.join()
    assert not it._workers_status[0], "worker 0's end of stream had not arrived"
    state = first.state_dict()
    del it, first
    second = make(rd.GatedStream(16, 9, gate, ended, stateful), seed=999, **kw)
    second.load_state_dict(state)
    assert_same_batch_lists(full, head + [clone_batch(b) for b in second], "the epoch")


@pytest.mark.parametrize("stateful", [True, False])
@pytest.mark.parametrize("k", [2, 7])
def test_iterable_dataset_resume(stateful, k):
    kw = dict(batch_size=3, snapshot_every_n_steps=2)
    (full,) = epochs(make(rd.CountingStream(45, stateful), **kw), 1)
    head, tail = interrupted(rd.CountingStream(45, stateful), k, **kw)
    assert_same_batch_lists(full[:k], head, "before the stop")
    assert_same_batch_lists(full[k:], tail, f"resumed after {k}")


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("unknown", ["stream_len", "sampler_len_notimplemented",
                                     "sampler_len_typeerror"])
def test_state_dict_and_resume_where_a_length_is_unknown(unknown, workers):
    """A stream whose __len__ raises NotImplementedError, a sampler whose __len__
    raises: the loader iterates as torch's does, so state_dict() (which Lightning
    calls at every checkpoint) must work too, and the resume continue the epoch.
    state_dict() used to raise the length's error."""
    if unknown == "stream_len":
        def dataset():
            return rd.UnknownLengthStream(30)
        kw = dict(batch_size=3, num_workers=workers)
    else:
        error = NotImplementedError if unknown.endswith("notimplemented") else TypeError
        def dataset():
            return list(range(30))
        kw = dict(batch_size=3, num_workers=workers, sampler=rd.UnsizedSampler(30, error))
    (full,) = epochs(make(dataset(), **kw), 1)
    head, tail = interrupted(dataset(), 4, **kw)
    if unknown == "stream_len" and workers == 0:
        # the stream's noise is drawn from the main process's own RNG, which a
        # resume leaves to the user (README): compare the positions
        full, head, tail = ([b["x"] for b in part] for part in (full, head, tail))
    assert_same_batch_lists(full[:4], head, "before the stop")
    assert_same_batch_lists(full[4:], tail, "resumed after 4")


@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_where_a_samplers_attribute_raises(workers):
    """A dynamic batch sampler whose batch_size property raises, a sampler whose
    num_replicas raises: torch never reads them, so state_dict() must not raise
    either, and the resume continues the epoch."""
    def loader():
        return make(list(range(20)), batch_sampler=rd.DynamicBatchSampler(), num_workers=workers)
    (full,) = epochs(loader(), 1)
    first = loader()
    it = iter(first)
    head = [clone_batch(next(it)) for _ in range(2)]
    state = first.state_dict()
    del it, first
    second = loader()
    second.load_state_dict(state)
    assert_same_batch_lists(full[:2], head, "before the stop")
    assert_same_batch_lists(full[2:], [clone_batch(b) for b in second], "resumed after 2")


@pytest.mark.parametrize("k", [0, 4])
def test_single_process_resume(k):
    ds = rd.RandomAugmented(30)
    kw = dict(batch_size=4, shuffle=True, num_workers=0)
    (full,) = epochs(make(ds, **kw), 1)
    first = make(ds, **kw)
    it = iter(first)
    for _ in range(k):
        next(it)
    state = first.state_dict()
    second = make(ds, seed=3, **kw)
    second.load_state_dict(state)
    got = [clone_batch(b) for b in second]
    assert [b["i"].tolist() for b in got] == [b["i"].tolist() for b in full[k:]]


@pytest.mark.parametrize("persistent", [False, True])
def test_state_between_epochs_starts_the_next_epoch(persistent):
    """With persistent workers too: the uninterrupted run's workers drew no seed
    for the next epoch, and the resumed loader's new ones did, which shifted its
    shuffle (the workers' own randomness starts afresh there, see the README)."""
    ds = rd.RandomAugmented(24)
    kw = dict(batch_size=4, shuffle=True, persistent_workers=persistent)
    loader = make(ds, **kw)
    (e1,) = epochs(loader, 1)
    state = loader.state_dict()
    (e2,) = epochs(loader, 1)
    other = make(ds, seed=5, **kw)
    other.load_state_dict(state)
    (again,) = epochs(other, 1)
    if persistent:
        assert [b["i"].tolist() for b in again] == [b["i"].tolist() for b in e2]
        return
    assert_same_batch_lists(e2, again, "the epoch after a saved finished epoch")


def _steps(loader, n):
    """n batches taken by next(), as a loop that counts its steps takes them: the
    iterator is not asked again, so it has not raised StopIteration."""
    it = iter(loader)
    return it, [clone_batch(next(it)) for _ in range(n)]


def _an_epoch_and_a_state_after(ds, k, **kw):
    """An uninterrupted epoch's batches, and the state of another run after k."""
    (full,) = epochs(make(ds, **kw), 1)
    first = make(ds, **kw)
    it, _ = _steps(first, k)
    state = first.state_dict()
    del it
    return full, state


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_a_state_saved_once_every_batch_was_yielded_starts_the_next_epoch(workers, persistent):
    """As torchdata's StatefulDataLoader: it used to resume an empty epoch, which
    shifted an epoch loop's count by one. The saving run goes on unchanged."""
    ds = rd.RandomAugmented(24)
    kw = dict(batch_size=4, shuffle=True, num_workers=workers, persistent_workers=persistent)
    e1, e2 = epochs(make(ds, **kw), 2)
    loader = make(ds, **kw)
    # without workers the samples draw from this process's RNGs, which the loader
    # leaves alone; persistent workers' randomness starts afresh (see the README)
    exact = workers > 0 and not persistent

    def same(expected, got, what):
        if exact:
            assert_same_batch_lists(expected, got, what)
        else:
            assert [b["i"].tolist() for b in got] == [b["i"].tolist() for b in expected], what

    it, head = _steps(loader, len(loader))
    same(e1, head, "the first epoch")
    state = loader.state_dict()
    # with workers the sampler has ended (asked for each next task); without, it
    # was not asked again, and load_state_dict() finds its end (as_epoch_end)
    assert state["epoch_done"] if workers else state["yielded_all"]
    with pytest.raises(StopIteration):
        next(it)
    del it
    same(e2, epochs(loader, 1)[0], "the saving run's next epoch")
    other = make(ds, seed=5, **kw)
    other.load_state_dict(state)
    same(e2, epochs(other, 1)[0], "the epoch after the saved one")


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("when", ["fresh", "every batch yielded", "between epochs"])
@pytest.mark.parametrize("change", [dict(batch_size=5), dict(drop_last=True),
                                    dict(dataset=rd.RandomAugmented(30))])
def test_a_state_outside_an_epoch_loads_with_other_settings(change, when, workers):
    """Nothing of an epoch is continued there: the next one starts from the saved
    generator with the new settings (a mid-epoch state raises, see below)."""
    kw = dict(dataset=rd.RandomAugmented(24), batch_size=4, shuffle=True, num_workers=workers)
    loader = make(**kw)
    if when == "every batch yielded":
        it, _ = _steps(loader, len(loader))
    elif when == "between epochs":
        epochs(loader, 1)
    state = loader.state_dict()
    reference = make(**kw)   # where the saving run's generator is at that point
    epochs(reference, 1)
    kw.update(change)
    # a fresh state has nothing to restore: the loader keeps its own generator
    expected = make(seed=5, **kw)
    if when == "every batch yielded" and not workers and "dataset" in change:
        # the sampler's end is found with this loader's sampler (as_epoch_end)
        reference = make(**kw)
        reference.generator.set_state(state["sampler_rng"])
        list(reference.sampler)
    if when != "fresh":
        expected.generator.set_state(reference.generator.get_state())
    resumed = make(seed=5, **kw)
    resumed.load_state_dict(state)
    assert [b["i"].tolist() for b in resumed] == [b["i"].tolist() for b in expected]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epochs_end_without_a_generator_keeps_the_global_rng_the_loop_moved(workers):
    """generator=None: the sampler draws its seed from the global RNG, which the
    training loop moves too (dropout, augmentation). Finding the epoch's end must
    not rewind it to the epoch's start: the next epoch's shuffle is the
    uninterrupted run's."""
    def loader():
        return fastloader.DataLoader(list(range(16)), batch_size=4, shuffle=True,
                                     num_workers=workers)

    torch.manual_seed(123)
    first = loader()
    it, _ = _steps(first, len(first))
    torch.rand(10)   # the last training step's own draw
    state = first.state_dict()
    with pytest.raises(StopIteration):
        next(it)
    del it
    uninterrupted = [b.tolist() for b in first]
    torch.manual_seed(999)   # a restarted job: its global RNG is anything
    resumed = loader()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == uninterrupted


@pytest.mark.parametrize("restores", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [0, 2])
def test_a_mid_epoch_resume_without_a_generator_leaves_the_global_rng_as_saved(
        workers, k, restores):
    """generator=None: the resumed epoch draws its seeds again from the epoch's
    starting RNG, and left the global RNG there, so the training loop's draws after
    the resume (dropout, augmentation) repeated the epoch's first ones. Whether the
    job restores its RNG itself (a plain script) or not (Lightning does not)."""
    def loader():
        return fastloader.DataLoader(list(range(16)), batch_size=4, shuffle=True,
                                     num_workers=workers)

    torch.manual_seed(3)
    first = loader()
    it = iter(first)
    for _ in range(k):
        next(it)
    torch.rand(3)   # the training loop's own draws
    state, rng = first.state_dict(), torch.get_rng_state()
    rest = [b.tolist() for b in it]
    uninterrupted_draw = torch.rand(2)   # the loop's next draw
    del it
    torch.manual_seed(99)
    resumed = loader()
    resumed.load_state_dict(state)
    if restores:
        torch.set_rng_state(rng)
    assert [b.tolist() for b in resumed] == rest
    assert torch.equal(torch.rand(2), uninterrupted_draw)


def test_a_loaded_state_survives_an_epoch_that_could_not_start(monkeypatch):
    """No workers could start (no fds left): the state loaded for the epoch was
    taken all the same, and the next iter() restarted the epoch from its start."""
    ds = rd.RandomAugmented(24)
    kw = dict(batch_size=4, shuffle=True)
    full, state = _an_epoch_and_a_state_after(ds, 2, **kw)
    resumed = make(ds, seed=5, **kw)
    resumed.load_state_dict(state)
    with workers_cannot_start(monkeypatch), pytest.raises(OSError, match="Too many"):
        iter(resumed)
    assert resumed.state_dict()["next_seq"] == 2
    assert_same_batch_lists(full[2:], [clone_batch(b) for b in resumed], "after the failed start")


@pytest.mark.parametrize("case, workers", [("a sampler drawing each index", 0),
                                           ("a draw before next()", 0),
                                           ("a draw before next()", 1)])
def test_the_global_rng_of_a_resumed_epoch_without_a_generator(case, workers):
    """Without workers: a sampler that draws every index from the global RNG had
    the RNG set back after its first skipped index (the others then drew from the
    saved run's); and the epoch's starting RNG was taken at iter(), though the
    sampler draws at the first next(), after any draw the loop makes between.
    (With workers a sampler drawing each index draws ahead of the loop, in an
    order that depends on timing: not resumable exactly.)"""
    ds = rd.RandomAugmented(16)
    if case == "a sampler drawing each index":
        kw = dict(batch_size=2, sampler=rd.GlobalRandomIndices(16))
    else:
        kw = dict(batch_size=2, shuffle=True)
    torch.manual_seed(5)
    first = fastloader.DataLoader(ds, num_workers=workers, **kw)
    it = iter(first)
    torch.rand(1)   # the loop draws before it asks for a batch
    for _ in range(3):
        next(it)
    torch.rand(2)
    state = first.state_dict()
    rest = [b["i"].tolist() for b in it]
    del it
    torch.manual_seed(77)
    resumed = fastloader.DataLoader(ds, num_workers=workers, **kw)
    resumed.load_state_dict(state)
    assert [b["i"].tolist() for b in resumed] == rest


@pytest.mark.parametrize("workers", [0, 1])
def test_a_sampler_that_raises_while_a_resume_skips_its_indices_raises(workers):
    """Without workers its error was taken for a skipped batch's and dropped, and
    the resumed epoch came out empty."""
    ds = rd.RandomAugmented(8)
    kw = dict(batch_size=2, num_workers=workers)
    first = make(ds, sampler=rd.FailsWhenResumed(ds), **kw)
    it, _ = _steps(first, 3)
    state = first.state_dict()
    del it
    resumed = make(ds, sampler=rd.FailsWhenResumed(ds), **kw)
    resumed.load_state_dict(state)
    rd.FailsWhenResumed.armed = True
    try:
        with pytest.raises(OSError, match="the sampler failed"):
            list(resumed)
    finally:
        rd.FailsWhenResumed.armed = False


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_an_epoch_end_state_keeps_the_draws_made_after_loading_it(workers, persistent):
    """generator=None, a state taken at an epoch's end, then validation draws from
    the global RNG before the next epoch: resuming a persistent loader set the
    RNG back to the state's, undoing those draws (its next epoch shuffled
    otherwise)."""
    def loader():
        return fastloader.DataLoader(list(range(12)), batch_size=2, shuffle=True,
                                     num_workers=workers, persistent_workers=persistent)

    torch.manual_seed(0)
    first = loader()
    for _ in first:
        pass
    state = first.state_dict()
    torch.rand(3)   # validation, after the checkpoint
    uninterrupted = [b.tolist() for b in first], torch.rand(1)
    torch.manual_seed(9)
    torch.set_rng_state(state["rng_now"])   # the job restores its RNG with the rest
    resumed = loader()
    resumed.load_state_dict(state)
    torch.rand(3)
    again = [b.tolist() for b in resumed], torch.rand(1)
    assert again[0] == uninterrupted[0] and torch.equal(again[1], uninterrupted[1])


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("at_end", [False, True])
def test_an_epoch_that_could_not_start_leaves_the_generator_for_the_retry(
        monkeypatch, at_end, persistent):
    """The failed start drew the iterator's base seed from the generator the state
    had set: the retry of an epoch-end state shuffled otherwise."""
    ds = rd.RandomAugmented(12)
    kw = dict(batch_size=2, shuffle=True, persistent_workers=persistent)
    first = make(ds, **kw)
    if at_end:
        for _ in first:
            pass
        state = first.state_dict()
        expected = [b["i"].tolist() for b in first]
    else:
        it, _ = _steps(first, 2)
        state = first.state_dict()
        expected = [b["i"].tolist() for b in it]
        del it
    resumed = make(ds, seed=5, **kw)
    resumed.load_state_dict(state)
    with workers_cannot_start(monkeypatch), pytest.raises(OSError, match="Too many"):
        iter(resumed)
    assert [b["i"].tolist() for b in resumed] == expected


def test_loading_a_fresh_state_after_another_one_starts_afresh():
    """The last state loaded wins (a fresh one left the earlier one pending)."""
    ds = rd.RandomAugmented(16)
    kw = dict(batch_size=4, num_workers=0)
    fresh = make(ds, **kw).state_dict()
    first = make(ds, **kw)
    it, _ = _steps(first, 2)
    mid = first.state_dict()
    del it
    loader = make(ds, **kw)
    loader.load_state_dict(mid)
    loader.load_state_dict(fresh)
    assert loader.state_dict().get("fresh")
    assert len(list(loader)) == 4


@pytest.mark.parametrize("workers", [0, 2])
def test_an_empty_state_is_nothing_to_load(workers):
    """torchdata's StatefulDataLoader takes {} as nothing to load (code written for
    it loads `checkpoint.get("loader", {})`): the live iterator goes, a state loaded
    before stays. Ours raised ValueError."""
    ds = rd.RandomAugmented(16)
    kw = dict(batch_size=4, num_workers=workers, persistent_workers=workers > 0)
    torch.manual_seed(3)
    expected = [b["i"].tolist() for b in make(ds, **kw)]
    fresh = make(ds, **kw)
    fresh.load_state_dict({})
    torch.manual_seed(3)
    assert [b["i"].tolist() for b in fresh] == expected
    # a live persistent iterator is dropped (its workers stop) ...
    if workers:
        live = fresh._iterator
        assert live is not None and live.worker_pids
        fresh.load_state_dict({})
        assert fresh._iterator is None and live._shutdown
    # ... and a state loaded before is still what the next epoch resumes from
    first = make(ds, **kw)
    it, head = _steps(first, 2)
    mid = first.state_dict()
    rest = [b["i"].tolist() for b in it]
    del it
    resumed = make(ds, **kw)
    resumed.load_state_dict(mid)
    resumed.load_state_dict({})
    assert [b["i"].tolist() for b in resumed] == rest


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("after", ["a later epoch ended", "a fresh state was loaded"])
def test_an_older_iterator_dropped_later_leaves_the_loaders_state_alone(workers, after):
    """An iterator kept past the loader's next epoch (or past a load_state_dict)
    and dropped afterwards used to leave its own mid-epoch state as the loader's:
    a loader resumed from it replayed the rest of that older epoch. Its stats
    took over too."""
    ds = rd.RandomAugmented(40)
    kw = dict(batch_size=4, num_workers=workers)
    loader = make(ds, **kw)
    old = iter(loader)
    next(old), next(old)
    if after == "a later epoch ended":
        for _ in loader:
            pass
        stats = loader.stats()
    else:
        loader.load_state_dict(make(ds, **kw).state_dict())
        stats = None
    def where(state):
        return {k: state.get(k) for k in ("fresh", "epoch", "epoch_done", "next_seq")}
    state = where(loader.state_dict())
    del old
    gc.collect()
    assert where(loader.state_dict()) == state
    if workers:
        assert loader.stats() == stats
    if after == "a later epoch ended" and workers:
        # resumed, the third epoch is the loader's own (in the main process, the
        # samples' random draws come from the process's RNG, which both share)
        resumed = make(ds, seed=999, **kw)
        resumed.load_state_dict(loader.state_dict())
        assert_same_batch_lists(epochs(loader, 1)[0], [clone_batch(b) for b in resumed])


@tf.needs_in_order
def test_an_in_order_false_epoch_whose_batches_were_all_yielded_is_at_its_end():
    """Out of order, the cursor of the batch due lags behind batches delivered
    ahead of it: the state of such an epoch resumed as an empty epoch."""
    ds = rd.SlowAt(n=4, slow=(0,), delay=0.5)
    kw = dict(batch_size=1, num_workers=2, in_order=False)
    loader = make(ds, **kw)
    it, head = _steps(loader, len(loader))
    assert sorted(b["i"].item() for b in head) == [0, 1, 2, 3]
    state = loader.state_dict()
    assert state["epoch_done"]
    del it
    resumed = make(ds, **kw)
    resumed.load_state_dict(state)
    assert sorted(b["i"].item() for b in resumed) == [0, 1, 2, 3]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_after_loading_and_before_iterating_keeps_its_position(workers):
    """It said "fresh": a checkpoint taken between load_state_dict() and iter()
    (a framework saving at once after restoring) restarted the epoch."""
    ds = rd.RandomAugmented(24)
    kw = dict(batch_size=4, shuffle=True, num_workers=workers)
    full, state = _an_epoch_and_a_state_after(ds, 2, **kw)
    second = make(ds, seed=5, **kw)
    second.load_state_dict(state)
    again = second.state_dict()
    assert not again.get("fresh") and again["next_seq"] == 2
    third = make(ds, seed=6, **kw)
    third.load_state_dict(again)
    tail = [clone_batch(b) for b in third]
    if workers:
        assert_same_batch_lists(full[2:], tail, "resumed from the state saved again")
    else:   # the samples draw from this process's RNGs
        assert [b["i"].tolist() for b in tail] == [b["i"].tolist() for b in full[2:]]


@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_after_every_batch_changes_nothing_in_the_saving_run(workers):
    """A loop that counts its steps leaves the iterator without asking it again:
    its sampler has not ended (a RandomSampler's last draw from the generator is
    still to come), and the next epoch's shuffle depends on that. Asking for the
    state there must not end the sampler."""
    ds = rd.RandomAugmented(24)
    kw = dict(batch_size=4, shuffle=True, num_workers=workers)
    nexts = []
    for save in (False, True):
        loader = make(ds, **kw)
        it, _ = _steps(loader, len(loader))
        if save:
            loader.state_dict()
        del it
        nexts.append([b["i"].tolist() for b in loader])
    assert nexts[0] == nexts[1]


@pytest.mark.parametrize("other", ["endless sampler", "stream"])
def test_a_state_at_an_epochs_end_into_a_loader_that_never_ends_does_not_hang(other):
    """Finding the epoch's end runs this loader's sampler: not one without end."""
    loader = make(rd.RandomAugmented(8), batch_size=2, num_workers=0)
    it, _ = _steps(loader, len(loader))
    state = loader.state_dict()
    assert state["yielded_all"]
    if other == "stream":   # another dataset length: refused
        resumed = make(rd.UnknownLengthStream(8), batch_size=2, num_workers=0)
        with deadline(60), pytest.raises(ValueError, match="dataset length"):
            resumed.load_state_dict(state)
        return
    # the same fingerprint: a mid-epoch state, whose 4 batches are skipped
    resumed = make(rd.RandomAugmented(8), batch_size=2, num_workers=0,
                   sampler=rd.EndlessSampler(8))
    with deadline(60):
        resumed.load_state_dict(state)
        it = iter(resumed)
        assert [next(it)["i"].tolist() for _ in range(2)] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_longer_than_its_length_is_not_at_its_end(workers):
    """Its batches past its length are the rest of the epoch, in the saving run and
    in the resumed one."""
    ds = rd.RandomAugmented(12)
    kw = dict(batch_size=2, num_workers=workers)
    full = [b["i"].tolist() for b in make(ds, sampler=rd.LongerThanItsLength(ds), **kw)]
    assert len(full) == 6
    loader = make(ds, sampler=rd.LongerThanItsLength(ds), **kw)
    it, head = _steps(loader, len(loader))
    state = loader.state_dict()
    assert not state["epoch_done"]
    tail = [b["i"].tolist() for b in it]
    assert [b["i"].tolist() for b in head] + tail == full
    other = make(ds, sampler=rd.LongerThanItsLength(ds), **kw)
    other.load_state_dict(state)
    assert [b["i"].tolist() for b in other] == full[len(head):]


@pytest.mark.parametrize("change,match", [
    (dict(dataset=rd.RandomAugmented(61)), "dataset length"),
    (dict(batch_size=5), "batch size"),
])
def test_mismatched_state_raises(change, match):
    kw = dict(dataset=rd.RandomAugmented(60), batch_size=4, shuffle=True)
    loader = make(**kw)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        make(**kw).load_state_dict(state)


def test_world_size_mismatch_raises():
    ds = rd.RandomAugmented(60)
    s2 = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=1)
    loader = fastloader.DataLoader(ds, batch_size=4, sampler=s2, num_workers=1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    s4 = DistributedSampler(ds, num_replicas=4, rank=0, shuffle=True, seed=1)
    with pytest.raises(ValueError, match="world size"):
        fastloader.DataLoader(ds, batch_size=4, sampler=s4, num_workers=1).load_state_dict(state)


def test_distributed_sampler_resume_with_set_epoch():
    ds = rd.RandomAugmented(50)

    def build():
        torch.manual_seed(0)   # base seed from the global RNG, as a job that seeds would
        s = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
        s.set_epoch(4)
        return fastloader.DataLoader(ds, batch_size=3, sampler=s, num_workers=2)

    full = [clone_batch(b) for b in build()]
    first = build()
    it = iter(first)
    head = [clone_batch(next(it)) for _ in range(3)]
    state = first.state_dict()
    del it
    second = build()
    second.load_state_dict(state)
    tail = [clone_batch(b) for b in second]
    assert_same_batch_lists(full, head + tail, "DistributedSampler resume")


# -- datasets with a state_dict() of their own, and where the state is saved -------
@pytest.mark.parametrize("how", ["import", "install"])
def test_a_dataset_whose_state_dict_needs_arguments_loads_as_torchs(how):
    """MosaicML streaming and litdata datasets have a `state_dict(...)` that needs
    arguments: torch's DataLoader never calls it, and fastloader used to call it
    with none in every worker at each epoch's first batch (TypeError: the epoch
    failed)."""
    ds = rd.ArgumentStateStream(24)
    torch.manual_seed(3)
    want = [clone_batch(b) for b in torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2)]
    torch.manual_seed(3)
    if how == "install":
        fastloader.install()
        try:
            it = iter(torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2))
            assert type(it).__module__.startswith("fastloader")
            got = [clone_batch(b) for b in it]
        finally:
            fastloader.uninstall()
    else:
        got = [clone_batch(b) for b in fastloader.DataLoader(ds, batch_size=2, num_workers=2)]
    assert [b["x"].tolist() for b in got] == [b["x"].tolist() for b in want]
    assert_same_batch_lists(want, got, "ArgumentStateStream")


@pytest.mark.parametrize("k", [2, 7])
def test_a_dataset_whose_state_dict_needs_arguments_resumes_by_replay(k):
    kw = dict(batch_size=3, snapshot_every_n_steps=2)
    (full,) = epochs(make(rd.ArgumentStateStream(24), **kw), 1)
    head, tail = interrupted(rd.ArgumentStateStream(24), k, **kw)
    assert_same_batch_lists(full[:k], head, "before the stop")
    assert_same_batch_lists(full[k:], tail, f"resumed after {k}")


@pytest.mark.parametrize("k", [2, 7])
def test_a_dataset_state_that_cannot_be_sent_loses_no_batch_and_resume_replays(k):
    kw = dict(batch_size=3, snapshot_every_n_steps=2)
    torch.manual_seed(5)
    want = [clone_batch(b) for b in torch.utils.data.DataLoader(
        rd.UnsendableStateStream(45), batch_size=3, num_workers=2)]
    torch.manual_seed(5)
    got = [clone_batch(b) for b in fastloader.DataLoader(
        rd.UnsendableStateStream(45), batch_size=3, num_workers=2)]
    assert_same_batch_lists(want, got, "a state_dict() that cannot be sent")
    (full,) = epochs(make(rd.UnsendableStateStream(45), **kw), 1)
    head, tail = interrupted(rd.UnsendableStateStream(45), k, **kw)
    assert_same_batch_lists(full[:k], head, "before the stop")
    assert_same_batch_lists(full[k:], tail, f"resumed after {k}")


@pytest.mark.parametrize("fail", [rd.fail_always, rd.fail_past_start])
@pytest.mark.parametrize("k", [2, 7])
def test_a_failing_dataset_state_dict_loses_no_batch_and_resume_replays(fail, k):
    """torch never calls the dataset's state_dict(): when it raises in a worker the
    epoch goes on as torch's, and a resume falls back to the epoch's start (the
    snapshot holds no position) and replays, giving the same batches."""
    kw = dict(batch_size=3, snapshot_every_n_steps=2)
    torch.manual_seed(5)
    want = [clone_batch(b) for b in torch.utils.data.DataLoader(
        rd.FailingStateStream(45, fail), batch_size=3, num_workers=2)]
    torch.manual_seed(5)
    got = [clone_batch(b) for b in fastloader.DataLoader(
        rd.FailingStateStream(45, fail), batch_size=3, num_workers=2)]
    assert_same_batch_lists(want, got, "a failing state_dict()")
    (full,) = epochs(make(rd.FailingStateStream(45, fail), **kw), 1)
    head, tail = interrupted(rd.FailingStateStream(45, fail), k, **kw)
    assert_same_batch_lists(full[:k], head, "before the stop")
    assert_same_batch_lists(full[k:], tail, f"resumed after {k}")


@tf.torch_before((2, 5), "torch.load(weights_only=True) warns that TypedStorage is "
                         "deprecated as it loads any tensor")
@pytest.mark.parametrize("dataset, num_workers", [
    ("map", 0), ("map", 2), ("stateful_iterable", 2), ("iterable", 2)])
def test_the_state_loads_with_torch_load_defaults(tmp_path, num_workers, dataset):
    """Lightning saves a resumable loader's state in every checkpoint, and both it
    and torch.load default to weights_only=True: the state must load that way (it
    held the workers' numpy RNG as an ndarray, which that loader refuses), and
    resuming from the loaded copy must give the uninterrupted run's batches."""
    if dataset == "map":
        ds, kw = rd.RandomAugmented(40), dict(batch_size=4, shuffle=True)
    else:
        ds, kw = rd.CountingStream(45, dataset == "stateful_iterable"), dict(batch_size=3)
    kw.update(num_workers=num_workers, snapshot_every_n_steps=2)
    (full,) = epochs(make(ds, **kw), 1)
    first = make(ds, **kw)
    it = iter(first)
    head = [clone_batch(next(it)) for _ in range(5)]
    torch.save({"loader": first.state_dict()}, tmp_path / "ckpt.pt")
    del it, first
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]
    second = make(ds, seed=999, **kw)
    second.load_state_dict(state)
    tail = [clone_batch(b) for b in second]
    if num_workers == 0:
        # in-process randomness runs on the user's own RNGs, which no resume restores
        assert [b["i"].tolist() for b in tail] == [b["i"].tolist() for b in full[5:]]
        return
    assert_same_batch_lists(full[:5], head, "before the stop")
    assert_same_batch_lists(full[5:], tail, "resumed from disk")


@pytest.mark.parametrize("saved_workers, workers", [(2, 1), (2, 3), (2, 0), (0, 2), (1, 2)])
def test_a_map_style_epoch_resumes_with_another_number_of_workers(saved_workers, workers):
    """Lightning resumes every checkpoint's loader state, and moving a job to a box
    with another worker count used to make that resume raise (torch's loader,
    which Lightning cannot resume, restarts the epoch instead). The index batches
    of a map-style epoch do not depend on the workers: the rest of the epoch comes
    exactly, with a warning that worker randomness starts afresh."""
    ds = rd.RandomAugmented(60)
    kw = dict(batch_size=4, shuffle=True, snapshot_every_n_steps=2)
    full, following = epochs(make(ds, num_workers=saved_workers, **kw), 2)
    first = make(ds, num_workers=saved_workers, **kw)
    it = iter(first)
    head = [clone_batch(next(it)) for _ in range(5)]
    state = first.state_dict()
    del it, first
    second = make(ds, seed=999, num_workers=workers, **kw)
    with pytest.warns(fastloader.FastLoaderWarning, match="random streams start afresh"):
        second.load_state_dict(state)
    tail = [clone_batch(b) for b in second]
    assert [b["i"].tolist() for b in head] == [b["i"].tolist() for b in full[:5]]
    assert [b["i"].tolist() for b in tail] == [b["i"].tolist() for b in full[5:]]
    # and the next epoch draws the uninterrupted loader's next order
    assert [b["i"].tolist() for b in second] == [b["i"].tolist() for b in following]


@pytest.mark.parametrize("when", ["fresh", "between epochs"])
def test_an_iterable_state_outside_an_epoch_loads_with_another_number_of_workers(when):
    """Nothing outside an epoch depends on the workers (Lightning's end-of-epoch
    checkpoints hold such a state): it loads, and the next epoch is a whole one."""
    loader = make(rd.CountingStream(45, True), batch_size=3)
    if when == "between epochs":
        epochs(loader, 1)
    state = loader.state_dict()
    other = make(rd.CountingStream(45, True), batch_size=3, num_workers=1)
    other.load_state_dict(state)
    assert sorted(x for b in other for x in b["x"].tolist()) == list(range(45))


def test_an_iterable_epoch_does_not_resume_with_another_number_of_workers():
    loader = make(rd.CountingStream(45, True), batch_size=3)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    with pytest.raises(ValueError, match="num_workers"):
        make(rd.CountingStream(45, True), batch_size=3, num_workers=1).load_state_dict(state)


@tf.needs_in_order
@pytest.mark.parametrize("workers", [0, 1, 3])
def test_an_in_order_false_state_resumes_each_batch_once_with_another_number_of_workers(workers):
    """A state saved with in_order=False holds the batches delivered ahead of the
    next one due: resumed with another num_workers (0 included, where
    single-process iteration skipped by count and so repeated one batch and lost
    another), each undelivered batch comes exactly once."""
    kw = dict(batch_size=4, in_order=False)
    first = make(rd.SlowAt(40, slow=(8,)), **kw)
    it = iter(first)
    head = [clone_batch(next(it)) for _ in range(4)]
    state = first.state_dict()
    del it, first
    assert state["delivered_ahead"], "the slow batch did not fall behind"
    second = make(rd.SlowAt(40, slow=()), seed=999, num_workers=workers, **kw)
    with pytest.warns(fastloader.FastLoaderWarning):
        second.load_state_dict(state)
    firsts = [b["i"][0].item() for b in head] + [b["i"][0].item() for b in second]
    assert sorted(firsts) == list(range(0, 40, 4))


@tf.needs_in_order
@pytest.mark.parametrize("stateful", [True, False])
@pytest.mark.parametrize("every", [0, 2])
def test_an_iterable_in_order_false_state_resumes_each_sample_once(stateful, every):
    """With in_order=False a worker's stream moves on for the batches it delivered
    ahead of the next one due: a resumed worker replays those too (they used to
    be skipped, so their samples came again)."""
    kw = dict(batch_size=3, in_order=False, snapshot_every_n_steps=every)
    first = make(rd.SlowStream(48, stateful, slow=(6,)), **kw)
    it = iter(first)
    head = [clone_batch(next(it)) for _ in range(5)]
    state = first.state_dict()
    del it, first
    assert state["delivered_ahead"], "the slow batch did not fall behind"
    second = make(rd.SlowStream(48, stateful, slow=()), seed=999, **kw)
    second.load_state_dict(state)
    xs = [x for b in head + [clone_batch(b) for b in second] for x in b["x"].tolist()]
    assert sorted(xs) == list(range(48))


def _twice_resumed_in_order_false(slow, second_workers, third_workers):
    """in_order=False: stop with a slow batch behind (so the state lists batches
    delivered ahead), resume with `second_workers`, take one batch and save again
    before passing those, resume that with `third_workers`: the first sample of
    every batch of the epoch, as delivered across the three runs."""
    kw = dict(batch_size=4, in_order=False)
    first = make(rd.SlowAt(40, slow=(slow,)), **kw)
    it = iter(first)
    head = [clone_batch(next(it)) for _ in range(slow // 4 + 1)]
    s1 = first.state_dict()
    del it, first
    assert s1["delivered_ahead"], "the slow batch did not fall behind"
    batches = list(head)
    state = s1
    for workers, take in ((second_workers, 1), (third_workers, None)):
        loader = make(rd.SlowAt(40, slow=()), seed=999, num_workers=workers, **kw)
        with warnings.catch_warnings():   # another number of workers, see above
            warnings.simplefilter("ignore", fastloader.FastLoaderWarning)
            loader.load_state_dict(state)
        it = iter(loader)
        batches += [clone_batch(b) for b in (it if take is None else
                                             (next(it) for _ in range(take)))]
        state = loader.state_dict() if take is not None else None
        del it, loader
    return [b["i"][0].item() for b in batches]


@tf.needs_in_order
@pytest.mark.parametrize("workers", [2, 3])
def test_a_resumed_in_order_false_run_saves_its_batches_delivered_ahead(workers):
    """Saved again before the batches delivered ahead were passed, a resumed run's
    state must still hold them (it lost them, and the next resume repeated them)."""
    assert sorted(_twice_resumed_in_order_false(8, workers, 2)) == list(range(0, 40, 4))


def test_batches_delivered_ahead_are_forgotten_once_the_cursor_passes_them():
    """in_order=False: the tracker kept every batch delivered ahead for the whole
    epoch (one set entry per batch) although state_dict() lists only those past the
    batch due."""
    tracker = fastloader.resume.EpochTracker(2)
    for seq in range(1, 10_001):   # each delivered just before the one due
        tracker.delivered_ahead(seq, seq - 1)
    assert len(tracker.ahead) <= 128
    assert tracker.ahead_of(9_999) == [9_999, 10_000]


def _resumed_with_a_failing_restore():
    """A fresh loader given a mid-epoch state of a dataset whose load_state_dict()
    raises."""
    kw = dict(batch_size=3, snapshot_every_n_steps=2)
    first = make(rd.FailingRestoreStream(45), **kw)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    del it, first
    second = make(rd.FailingRestoreStream(45), **kw)
    second.load_state_dict(state)
    return second


def test_a_dataset_load_state_dict_that_raises_is_the_resumed_epochs_error():
    """The dataset's own error, with its traceback, in the resumed epoch's turn; the
    worker lived on (it died, and the error was "exited unexpectedly")."""
    second = _resumed_with_a_failing_restore()
    with pytest.raises(RuntimeError, match="cannot restore") as info:
        list(second)
    assert "load_state_dict" in str(info.value) and "WorkerError" not in type(info.value).__name__


def _stop_after(loader, n):
    """n batches of a new epoch of `loader`, then its state_dict() (its iterator
    dropped, as a job that stops)."""
    it = iter(loader)
    batches = [clone_batch(next(it)) for _ in range(n)]
    state = loader.state_dict()
    del it
    return batches, state


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_run_saved_again_resumes_the_same_epoch(workers):
    """A resumed run's state must hold the epoch's starting sampler RNG: it held the
    RNG after the fast-forward's draws, so the resume of a resume shuffled anew."""
    ds = rd.RandomAugmented(48)
    kw = dict(batch_size=4, shuffle=True, num_workers=workers)
    (full,) = epochs(make(ds, **kw), 1)
    head, s1 = _stop_after(make(ds, **kw), 2)
    second = make(ds, seed=99, **kw)
    second.load_state_dict(s1)
    mid, s2 = _stop_after(second, 2)
    third = make(ds, seed=5, **kw)
    third.load_state_dict(s2)
    order = [b["i"].tolist() for b in head + mid + [clone_batch(b) for b in third]]
    assert order == [b["i"].tolist() for b in full]


@tf.needs_in_order
@pytest.mark.parametrize("then", [0, 2])
def test_a_single_process_run_still_skipping_ahead_batches_saves_them(then):
    """From an in_order=False state, a num_workers=0 loader skips the batches that
    were delivered ahead; saved again before it passed them, its state must list
    them (it gave only a count: one batch came twice, another never)."""
    assert sorted(_twice_resumed_in_order_false(4, 0, then)) == list(range(0, 40, 4))


def test_a_failed_resume_of_an_iterable_replica_ends_it_after_its_error():
    """A loop that catches the error goes on to the end of the epoch: the replica
    that could not be put back ends (it answered every later task with an error,
    for ever, as the iterable's sampler never runs out)."""
    second = _resumed_with_a_failing_restore()
    it, errors, batches = iter(second), 0, 0
    while errors + batches < 100:
        try:
            next(it)
            batches += 1
        except StopIteration:
            break
        except RuntimeError as exc:
            assert "cannot restore" in str(exc)
            errors += 1
    assert errors == 2 and errors + batches < 100   # one per worker, then the end


def test_a_persistent_loaders_state_between_epochs_keeps_its_order_without_workers():
    """The saving loader's persistent workers drew no seed for the next epoch;
    a num_workers=0 loader resuming its state draws the same order."""
    ds = rd.RandomAugmented(24)
    kw = dict(batch_size=4, shuffle=True)
    loader = make(ds, persistent_workers=True, **kw)
    epochs(loader, 1)
    state = loader.state_dict()
    (e2,) = epochs(loader, 1)
    other = make(ds, seed=5, num_workers=0, **kw)
    other.load_state_dict(state)
    (again,) = epochs(other, 1)
    assert [b["i"].tolist() for b in again] == [b["i"].tolist() for b in e2]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [2, "end"])
def test_a_resumed_loader_numbers_its_epochs_on_from_the_state(workers, k):
    """A state saved in (k batches) or at the end of (k="end") a loader's third
    epoch: the fresh loader's epoch is that third one, or the fourth, and the next
    one after it follows (not epoch 1 again), in state_dict() and stats()."""
    ds = rd.RandomAugmented(24)
    kw = dict(batch_size=4, shuffle=True, num_workers=workers)
    first = make(ds, **kw)
    for _ in range(2):
        for _ in first:
            pass
    it = iter(first)
    for _ in range(6 if k == "end" else k):
        next(it)
    if k == "end":
        with pytest.raises(StopIteration):
            next(it)
    state = first.state_dict()
    del it, first
    assert state["epoch"] == 3
    second = make(ds, seed=999, **kw)
    second.load_state_dict(state)
    numbers = []
    for _ in range(2):
        for _ in second:
            pass
        numbers.append(second.state_dict()["epoch"])
        if workers:
            assert second.stats()["epoch"] == numbers[-1]
    assert numbers == ([4, 5] if k == "end" else [3, 4])


def test_loading_a_fresh_state_drops_live_persistent_workers():
    """Persistent workers alive from this loader's run are not the fresh state's
    run's: as for any other state, the next epoch starts new workers (they were
    kept, with their dataset and RNGs as this run left them), and it is epoch 1."""
    ds = rd.RandomAugmented(16)
    kw = dict(batch_size=4, persistent_workers=True)
    fresh = make(ds, **kw).state_dict()
    loader = make(ds, **kw)
    epochs(loader, 2)
    old = set(loader._iterator.worker_pids)
    loader.load_state_dict(fresh)
    assert loader._iterator is None
    # as a fresh loader: a checkpoint now does not carry on the old run
    assert loader.state_dict().get("fresh") and loader.stats() is None
    it = iter(loader)
    assert not old & set(it.worker_pids)
    assert len([clone_batch(b) for b in it]) == 4
    assert loader.stats()["epoch"] == loader.state_dict()["epoch"] == 1


def _own_generator_loader(ds, workers, **kw):
    """A sampler that shuffles with a generator of its own, made and seeded afresh
    as a restarted job would (not the loader's generator)."""
    sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(3))
    return make(ds, batch_size=4, num_workers=workers, sampler=sampler, **kw)


def _saved_in_the_third_epoch(new_loader, k):
    """A loader's state in its third epoch (of 6 batches): after k batches, after
    all of them with the end not asked ("all yielded"), or at its "end"; with how
    many batches were taken and their "i"."""
    first = new_loader()
    epochs(first, 2)
    it = iter(first)
    taken = {"end": 6, "all yielded": 6}.get(k, k)
    head = [next(it)["i"].tolist() for _ in range(taken)]
    if k == "end":
        with pytest.raises(StopIteration):
            next(it)
    return taken, head, first.state_dict()


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("k", [0, 2, "all yielded", "end"])
def test_a_sampler_with_its_own_generator_resumes_its_shuffle(workers, persistent, k):
    """RandomSampler(ds, generator=g) moves g on by one permutation per epoch. A
    state saved in the third epoch (k batches; every batch yielded but the loop
    never asked for the end; or at its end) resumes that epoch's order, or the
    fourth epoch's, in a loader whose g is freshly seeded: the state carries g.
    It did not, and the resumed third epoch shuffled as the first, so some samples
    came twice and others never."""
    ds = rd.RandomAugmented(24)
    kw = dict(persistent_workers=True) if persistent else {}
    full = [[b["i"].tolist() for b in epoch]
            for epoch in epochs(_own_generator_loader(ds, workers, **kw), 5)]
    taken, head, state = _saved_in_the_third_epoch(
        lambda: _own_generator_loader(ds, workers, **kw), k)
    assert head == full[2][:taken]
    second = _own_generator_loader(ds, workers, **kw)
    second.load_state_dict(state)
    rest = [b["i"].tolist() for b in second]
    after = [b["i"].tolist() for b in second]
    if k in ("end", "all yielded"):
        assert (rest, after) == (full[3], full[4])
    else:
        assert rest == full[2][taken:]
        assert after == full[3]


class _GlobalPermutation(torch.utils.data.Sampler):
    """A custom sampler that shuffles with torch.randperm and no generator: it
    draws from the global RNG, whatever the loader was given."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


def _global_sampler_loader(ds, workers, sampler, **kw):
    """A loader with a generator of its own over a sampler that draws from the
    global RNG; made after torch.manual_seed(0), as a restarted job seeds."""
    torch.manual_seed(0)
    made = {"random": lambda: torch.utils.data.RandomSampler(ds),
            "custom": lambda: _GlobalPermutation(len(ds))}[sampler]()
    return make(ds, batch_size=4, num_workers=workers, sampler=made, **kw)


@pytest.mark.parametrize("sampler", ["random", "custom"])
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("k", [0, 2, "all yielded", "end"])
def test_a_sampler_that_draws_from_the_global_rng_resumes_beside_a_loader_generator(
        sampler, workers, persistent, k):
    """DataLoader(ds, sampler=RandomSampler(ds), generator=g): the loader's g is
    not the sampler's, which seeds each epoch from the global RNG (so does a
    custom sampler calling torch.randperm). A state saved in the third epoch
    resumes that epoch's order and then the fourth's, and leaves the global RNG
    where the uninterrupted run has it, in a job that seeded afresh. The state
    held only g: the resumed epoch shuffled from the restarted job's global RNG,
    so some samples came twice and others never."""
    if (sampler, workers, k) == ("custom", 0, 0):
        pytest.skip("without workers a custom sampler draws at the first batch: "
                    "saved before it, the state cannot tell what it draws from")
    ds = rd.RandomAugmented(24)
    kw = dict(persistent_workers=True) if persistent else {}
    loader = _global_sampler_loader(ds, workers, sampler, **kw)
    full = [[b["i"].tolist() for b in epoch] for epoch in epochs(loader, 3)]
    full.append([b["i"].tolist() for b in loader])
    draw_after_epoch_4 = torch.rand(3)
    full.append([b["i"].tolist() for b in loader])
    del loader
    taken, head, state = _saved_in_the_third_epoch(
        lambda: _global_sampler_loader(ds, workers, sampler, **kw), k)
    assert head == full[2][:taken]
    assert state["global_rng"] is not None
    second = _global_sampler_loader(ds, workers, sampler, **kw)
    second.load_state_dict(state)
    rest = [b["i"].tolist() for b in second]
    if k in ("end", "all yielded"):
        assert rest == full[3]
    else:
        assert rest == full[2][taken:]
        assert [b["i"].tolist() for b in second] == full[3]
    assert torch.equal(torch.rand(3), draw_after_epoch_4)
    assert [b["i"].tolist() for b in second] == full[4]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_with_the_loaders_generator_leaves_the_global_rng_alone(workers):
    """shuffle=True hands the loader's generator to the sampler: nothing of the
    global RNG goes into the state, and a resume does not touch the restarted
    job's global RNG."""
    ds = list(range(24))   # draws nothing, in the main process either
    first = make(ds, batch_size=4, num_workers=workers, shuffle=True)
    it = iter(first)
    next(it)
    state = first.state_dict()
    del it, first
    assert state["global_rng"] is None and "global_rng_now" not in state
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    second = make(ds, batch_size=4, num_workers=workers, shuffle=True)
    second.load_state_dict(state)
    assert len([clone_batch(b) for b in second]) == 5
    assert torch.equal(torch.rand(3), expected)


def _iter_interrupted_once_the_sampler_drew(loader, workers, monkeypatch, then=None):
    """iter(loader) raises KeyboardInterrupt once its sampler has drawn (the first
    tasks' batches with workers, the resumed epoch's skipped ones without), after
    `then(iterator)`; the next iter() runs as usual."""
    from fastloader import iterator, single

    cls, name = (iterator.FastMultiProcessingIter, "_try_put_index") if workers else \
        (single.SingleProcessIter, "_start_epoch")
    real = getattr(cls, name)

    def draw_then_interrupt(self, *args):
        real(self, *args)
        if then is not None:
            then(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(cls, name, draw_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        iter(loader)
    monkeypatch.setattr(cls, name, real)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_that_could_not_start_keeps_the_sampler_generator_and_epoch_number(
        workers, monkeypatch):
    """iter() after loading the state of epoch 2's end fails (Ctrl-C) once the
    sampler has drawn its first batch: the retry shuffles as the uninterrupted
    epoch 3 (the sampler's own generator is put back as the loader's is), and is
    numbered 3 (the failed start had used the number up)."""
    ds = rd.RandomAugmented(24)
    full = [[b["i"].tolist() for b in epoch]
            for epoch in epochs(_own_generator_loader(ds, workers), 3)]
    first = _own_generator_loader(ds, workers)
    epochs(first, 2)
    state = first.state_dict()
    second = _own_generator_loader(ds, workers)
    second.load_state_dict(state)

    def draw_first_batch(it):
        if workers:
            assert it._send_idx == 1   # the sampler drew the first batch
        else:
            it._next_index()

    _iter_interrupted_once_the_sampler_drew(second, workers, monkeypatch, draw_first_batch)
    assert [b["i"].tolist() for b in second] == full[2]
    assert second.state_dict()["epoch"] == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failed_resume_of_a_global_rng_sampler_leaves_the_global_rng_as_it_was(
        workers, monkeypatch):
    """A mid-epoch state of a sampler that draws from the global RNG beside a loader
    generator: the resume sets the global RNG back to the epoch's start for the
    sampler. If iter() then fails (Ctrl-C) once the sampler drew, the job's global
    RNG is as it was before iter(), and the retry still resumes the epoch."""
    ds = rd.RandomAugmented(24)
    full = [[b["i"].tolist() for b in epoch]
            for epoch in epochs(_global_sampler_loader(ds, workers, "random"), 2)]
    first = _global_sampler_loader(ds, workers, "random")
    epochs(first, 1)
    it = iter(first)
    head = [next(it)["i"].tolist() for _ in range(2)]
    state = first.state_dict()
    del it, first
    second = _global_sampler_loader(ds, workers, "random")
    second.load_state_dict(state)
    before = torch.get_rng_state()
    _iter_interrupted_once_the_sampler_drew(second, workers, monkeypatch)
    assert torch.equal(torch.get_rng_state(), before)
    assert head + [b["i"].tolist() for b in second] == full[1]


def _shuffled_from_the_global_rng(ds, generator, workers, sampler="random"):
    """A loader whose sampler shuffles from the global RNG: without a generator
    (shuffle=True), or beside the loader's (a RandomSampler, or a custom sampler
    calling torch.randperm, made without it)."""
    if generator == "none":
        return fastloader.DataLoader(ds, batch_size=4, shuffle=True, num_workers=workers)
    made = (torch.utils.data.RandomSampler(ds) if sampler == "random"
            else _GlobalPermutation(len(ds)))
    return make(ds, batch_size=4, num_workers=workers, sampler=made)


@pytest.mark.parametrize("generator", ["none", "the loader's, not the sampler's"])
@pytest.mark.parametrize("saved,resumed", [(2, 0), (0, 2), (2, 1)])
def test_a_state_saved_before_the_first_batch_resumes_with_another_worker_count(
        saved, resumed, generator):
    """A sampler that draws from the global RNG: a state taken right after iter(),
    resumed by a loader with another num_workers, yields the epoch the saved run
    went on to yield, and then leaves the global RNG where that run had it. A
    loader with workers draws its sampler's first batches in iter(), one without
    at its first batch: resumed without workers, the sampler drew from the global
    RNG as saved, not from where the saved epoch's sampler had started (shuffled
    otherwise); resumed with workers, it left the global RNG one draw behind."""
    ds = list(range(24))
    loader = functools.partial(_shuffled_from_the_global_rng, ds, generator)
    torch.manual_seed(0)
    first = loader(saved)
    it = iter(first)
    state = first.state_dict()
    expected = [b.tolist() for b in it]
    expected_draw = torch.rand(3)
    del it, first
    torch.manual_seed(99)   # a restarted job's RNG: the state's is what counts
    second = loader(resumed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fastloader.FastLoaderWarning)
        second.load_state_dict(state)
    assert [b.tolist() for b in second] == expected
    assert torch.equal(torch.rand(3), expected_draw)


@pytest.mark.parametrize("generator", ["none", "the loader's, not the sampler's"])
@pytest.mark.parametrize("saved,loaded,resumed", [(2, 0, 2), (0, 2, 0), (2, 0, 0), (0, 2, 2)])
def test_a_loaded_state_saved_again_by_another_worker_count_resumes_as_the_first(
        generator, saved, loaded, resumed):
    """A state taken right after iter() (the loop drew from the global RNG before
    taking it), loaded by a loader with another num_workers and saved again before
    it iterated, resumes as the first state does: the same batches, and the global
    RNG left where the saved run had it. Whether the saved run's sampler had drawn
    was read from the number of workers, which the second save changed."""
    loader = functools.partial(_shuffled_from_the_global_rng, list(range(24)), generator)
    torch.manual_seed(0)
    first = loader(saved)
    it = iter(first)
    torch.rand(5)
    state = first.state_dict()
    expected = [b.tolist() for b in it]
    expected_draw = torch.rand(3)
    del it, first
    torch.manual_seed(99)
    middle = loader(loaded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fastloader.FastLoaderWarning)
        middle.load_state_dict(state)
        again = middle.state_dict()
        torch.manual_seed(42)
        last = loader(resumed)
        last.load_state_dict(again)
    assert [b.tolist() for b in last] == expected
    assert torch.equal(torch.rand(3), expected_draw)


@pytest.mark.parametrize("generator", ["none", "the loader's, not the sampler's"])
def test_a_resumed_loader_without_workers_draws_its_first_batch_in_iter(generator):
    """A state saved with workers right after iter() (their sampler drew its first
    batches there), resumed without workers: the loop's draws from the global RNG
    between iter() and the first next() come from where the saved run had the RNG,
    not from the epoch's start (they shifted the sampler's draw: other batches);
    and a state taken there holds the saved run's RNG and resumes the same way."""
    loader = functools.partial(_shuffled_from_the_global_rng, list(range(24)), generator)
    torch.manual_seed(0)
    first = loader(2)
    it = iter(first)
    state = first.state_dict()
    torch.rand(5)
    expected = [b.tolist() for b in it]
    expected_draw = torch.rand(3)
    del it, first
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fastloader.FastLoaderWarning)
        torch.manual_seed(1)
        second = loader(0)
        second.load_state_dict(state)
        it = iter(second)
        again = second.state_dict()
        torch.rand(5)
        assert [b.tolist() for b in it] == expected
        assert torch.equal(torch.rand(3), expected_draw)
        del it
        torch.manual_seed(2)
        third = loader(0)
        third.load_state_dict(again)
        it = iter(third)
        torch.rand(5)
        assert [b.tolist() for b in it] == expected
        assert torch.equal(torch.rand(3), expected_draw)


def test_a_resumed_epoch_tells_again_whether_its_sampler_draws_from_the_global_rng():
    """A custom sampler drawing from the global RNG beside a loader generator,
    saved without workers right after iter() (that state cannot tell what it draws
    from), resumed with workers: that epoch's sampler draws there, so a state it
    takes 2 batches on says so, and resumes what the resumed run went on to
    yield. It kept the first state's "cannot tell", and the second resume drew
    another order: samples twice, others never."""
    ds = list(range(24))
    loader = functools.partial(_shuffled_from_the_global_rng, ds, "loader's", sampler="custom")
    torch.manual_seed(0)
    first = loader(0)
    it = iter(first)
    state = first.state_dict()
    del it, first
    torch.manual_seed(1)
    second = loader(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fastloader.FastLoaderWarning)
        second.load_state_dict(state)
    it = iter(second)
    head = [next(it).tolist() for _ in range(2)]
    again = second.state_dict()
    rest = [b.tolist() for b in it]
    del it, second
    assert again["global_rng"] is not None
    torch.manual_seed(2)
    third = loader(2)
    third.load_state_dict(again)
    got = [b.tolist() for b in third]
    assert got == rest
    assert sorted(sum(head + got, [])) == ds


def _draws_in_worker_init(worker_id):
    # draws from, and reseeds, each RNG a snapshot holds: the states before the
    # worker's first task are then not what its seeding left
    random.random()
    torch.rand(3)
    np.random.seed(1000 + worker_id + np.random.randint(1 << 16))


def test_a_seeded_snapshot_restores_the_states_the_seeding_left():
    """A worker's first snapshot, where nothing ran since its seeding, holds the
    seeds; restoring it seeds again, to exactly the states a full snapshot holds."""
    from fastloader import resume, seeding

    saved = resume.take_snapshot(None, 0)   # this process's, put back below
    try:
        seeding.seed_worker(123456789, 1)
        full = resume.take_snapshot(None, 0)
        # the worker drew on since, leaving cached Gaussians that seeding must drop
        random.random(), random.gauss(0, 1), torch.rand(5), np.random.randn(7)
        resume.restore_snapshot(None, resume.seeded_snapshot(123456789, 1), lambda: None)
        assert random.getstate() == full["random"]
        assert torch.equal(torch.get_rng_state(), full["torch"])
        now = resume._numpy_state()
        assert now[0] == full["numpy"][0] and torch.equal(now[1], full["numpy"][1])
        assert now[2:] == full["numpy"][2:]
    finally:
        resume.restore_snapshot(None, saved, lambda: None)


@pytest.mark.parametrize("init", ["none", "draws", "second_persistent_epoch"])
def test_a_workers_first_snapshot_is_its_seeds_only_where_nothing_ran_since(init):
    """Not after a worker_init_fn, nor at a persistent worker's later epoch (its
    RNGs carry on from the last one)."""
    kw = dict(batch_size=4, num_workers=2,
              worker_init_fn=_draws_in_worker_init if init == "draws" else None,
              persistent_workers=init == "second_persistent_epoch")
    loader = make(rd.RandomAugmented(40), **kw)
    if init == "second_persistent_epoch":
        for _ in loader:
            pass
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    del it, loader
    assert state["version"] == 2
    snapshots = [w["snapshot"] for w in state["workers"]]
    if init == "none":
        base = state["base_seed"]
        assert snapshots == [{"k": 0, "seeded": (base, 0)}, {"k": 0, "seeded": (base, 1)}]
    else:
        assert all("seeded" not in s and "random" in s and s["k"] == 0 for s in snapshots)


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("init", ["none", "draws"])
def test_a_resume_before_a_workers_second_snapshot_draws_on_as_uninterrupted(k, init):
    """The snapshot restored is each worker's first (snapshot_every_n_steps=0):
    its seeds, or, after a worker_init_fn that drew, its states."""
    kw = dict(batch_size=4, shuffle=True, snapshot_every_n_steps=0,
              worker_init_fn=_draws_in_worker_init if init == "draws" else None)
    ds = rd.RandomAugmented(48)
    (full,) = epochs(make(ds, **kw), 1)
    head, tail = interrupted(ds, k, **kw)
    assert_same_batch_lists(full[:k], head, "before the stop")
    assert_same_batch_lists(full[k:], tail, f"resumed after {k}")


def test_a_version_1_state_loads_and_an_unknown_version_is_refused():
    """Version 1 (every snapshot the RNG states, as a worker_init_fn still makes
    them) resumes exactly; another version raises at load_state_dict()."""
    kw = dict(batch_size=4, worker_init_fn=_draws_in_worker_init)
    ds = rd.RandomAugmented(40)
    (full,) = epochs(make(ds, **kw), 1)
    first = make(ds, **kw)
    it = iter(first)
    head = [clone_batch(next(it)) for _ in range(3)]
    state = dict(first.state_dict(), version=1)
    del it, first
    second = make(ds, seed=999, **kw)
    second.load_state_dict(state)
    assert_same_batch_lists(full, head + [clone_batch(b) for b in second], "a version 1 state")
    with pytest.raises(ValueError, match=r"version 1 or 2\), got a dict of version 3"):
        make(ds, **kw).load_state_dict(dict(state, version=3))
