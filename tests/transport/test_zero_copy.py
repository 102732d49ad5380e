"""Batches are views of the shared-memory ring, slots are recycled, and nothing a
consumer still holds is ever overwritten or unmapped (overflow segments instead)."""
import gc

import pytest
import torch
import torch.utils.data

import fastloader
from tests.support import datasets as ds
from tests.support.helpers import (
    assert_same_batch_lists, clone_batch, deadline, iter_tensors, may_be_copied_out, num_fds,
    settle, span_in_segments, tensor_span,
)

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

STRATEGIES = ("file_descriptor", "file_system")


def torch_reference(dataset, **kwargs):
    """Deterministic datasets only: torch in-process gives the expected batches."""
    loader = torch.utils.data.DataLoader(dataset, num_workers=0, **kwargs)
    return [clone_batch(b) for b in loader]


def check_segments(segments):
    assert isinstance(segments, list) and segments, f"no segments reported: {segments!r}"
    for seg in segments:
        assert isinstance(seg, tuple) and len(seg) == 2, seg
        addr, nbytes = seg
        assert isinstance(addr, int) and isinstance(nbytes, int), seg
        assert addr > 0 and nbytes > 0, seg


def check_stats(stats, batches):
    for key in ("batches", "slot_batches", "overflow_batches"):
        assert isinstance(stats.get(key), int), f"stats()[{key!r}] missing or not int: {stats!r}"
    assert stats["batches"] == batches, stats
    assert stats["slot_batches"] + stats["overflow_batches"] == batches, stats


def consume_checking_placement(it, hold=True, on_batch=None):
    """Iterate `it`, asserting after every batch that the counters moved by exactly one
    and that a batch counted as delivered from a ring slot really is a view of a ring
    segment (every tensor's bytes inside one of it.segments()).

    Returns (held batches or [], number of slot batches whose placement was checked)."""
    held = []
    count = slot_before = checked = 0
    for batch in it:
        count += 1
        stats = it.stats()
        check_stats(stats, count)
        assert stats["slot_batches"] - slot_before in (0, 1), (slot_before, stats)
        if stats["slot_batches"] > slot_before:
            segments = it.segments()
            check_segments(segments)
            for t in iter_tensors(batch):
                assert span_in_segments(tensor_span(t), segments) or may_be_copied_out(t, batch), (
                    f"batch {count - 1} counted as a slot batch, but a tensor at "
                    f"{t.data_ptr():#x} is not inside any ring segment "
                    f"{[(hex(a), n) for a, n in segments]}: it was copied")
            checked += 1
        slot_before = stats["slot_batches"]
        if on_batch is not None:
            on_batch(count - 1, batch)
        if hold:
            held.append(batch)
        del batch
    return held, checked


def assert_disjoint(tensors):
    """No two live tensors may share bytes (a reused slot under a live batch would)."""
    spans = sorted(tensor_span(t) for t in tensors if t.numel())
    for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
        assert e0 <= s1, f"live tensors overlap: [{s0:#x}, {e0:#x}) and [{s1:#x}, {e1:#x})"


@pytest.mark.parametrize("ctx,nw,strategy", [
    ("fork", 2, "file_descriptor"), ("fork", 3, "file_system"),
    ("spawn", 1, "file_descriptor"), ("forkserver", 1, "file_system"),
])
def test_batch_tensors_live_in_ring_segments(ctx, nw, strategy):
    dataset = ds.TensorLabelDataset(n=40)
    expected = torch_reference(dataset, batch_size=4)
    loader = fastloader.DataLoader(dataset, batch_size=4, num_workers=nw,
                                   multiprocessing_context=ctx, sharing_strategy=strategy)
    with deadline(60):
        it = iter(loader)
        pids = it.worker_pids
        assert isinstance(pids, list) and len(pids) == nw, pids
        assert all(isinstance(p, int) and p > 0 for p in pids), pids
        assert len(set(pids)) == nw, pids
        got, checked = consume_checking_placement(it)
    # 10 small batches, consumer holding them all: at least the first ones fit slots
    assert checked >= 1, f"no batch came from a ring slot: {it.stats()}"
    assert_same_batch_lists(expected, got, f"{ctx}/{strategy}")
    del it, loader


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_slots_are_reused_once_batches_are_freed(strategy):
    dataset = ds.IndexEncodedDataset(n=240, width=16)
    expected = torch_reference(dataset, batch_size=4)
    loader = fastloader.DataLoader(dataset, batch_size=4, num_workers=2,
                                   multiprocessing_context="fork", sharing_strategy=strategy)
    ptrs = []

    def check_and_forget(i, batch):
        # the consumer never holds more than the current batch
        assert_same_batch_lists([expected[i]], [batch], f"batch {i}")
        ptrs.append(batch[0].data_ptr())

    with deadline(60):
        it = iter(loader)
        consume_checking_placement(it, hold=False, on_batch=check_and_forget)
    stats = it.stats()
    check_stats(stats, 60)
    assert stats["overflow_batches"] == 0, (
        f"batches were freed right away, yet {stats['overflow_batches']} needed an overflow "
        f"segment: slots are not returned to the ring ({stats})")
    assert stats["slot_batches"] == 60, stats
    assert len(set(ptrs)) < len(ptrs), "60 batches in 60 distinct places: slots never reused"
    del it, loader


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_holding_500_batches_keeps_every_value(strategy):
    """The consumer keeps every batch: slots run out, overflow segments take over,
    and no live batch is ever overwritten, moved or unmapped, not even after the
    iterator and the loader are gone."""
    dataset = ds.IndexEncodedDataset(n=1000, width=8)
    expected = torch_reference(dataset, batch_size=2)
    loader = fastloader.DataLoader(dataset, batch_size=2, num_workers=2,
                                   multiprocessing_context="fork", sharing_strategy=strategy)
    with deadline(120):
        it = iter(loader)
        held, _ = consume_checking_placement(it)
    stats = it.stats()
    check_stats(stats, 500)
    assert stats["overflow_batches"] > 0, (
        f"500 batches held and no overflow segment used: {stats}")
    assert_same_batch_lists(expected, held, "while the iterator lives")
    assert_disjoint([t for b in held for t in iter_tensors(b)])

    del it, loader
    settle()
    # workers are gone; the memory under these tensors may go only when they die
    assert_same_batch_lists(expected, held, "after the iterator and loader were dropped")
    for batch in held:  # still mapped and writable, not a dead or read-only mapping
        batch[0].add_(0)
    del held
    settle()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batches_bigger_than_the_first_ones(strategy):
    """Small first batches size the ring; the later 32 MiB batches cannot fit those
    slots.  Each must still arrive intact, either from an overflow segment or from a
    grown ring (then inside it.segments()), and stay valid while held."""
    dataset = ds.BigSampleDataset(n=16 + 2 * 16, small=16)  # batch 0 small, 1-2 big
    expected = torch_reference(dataset, batch_size=16)
    loader = fastloader.DataLoader(dataset, batch_size=16, num_workers=2,
                                   multiprocessing_context="fork", sharing_strategy=strategy)
    with deadline(120):
        it = iter(loader)
        held, _ = consume_checking_placement(it)
    check_stats(it.stats(), 3)
    assert [b[0].shape for b in held] == [b[0].shape for b in expected]
    assert_same_batch_lists(expected, held, strategy)
    assert_disjoint([t for b in held for t in iter_tensors(b)])
    del it, loader
    settle()
    assert_same_batch_lists(expected, held, "after the iterator was dropped")


def test_fd_count_does_not_grow_with_tensors_held():
    """file_descriptor strategy: a constant number of fds per worker, whatever the batch
    holds (torch needs one per live storage: 40 held batches of 64 tensors here)."""
    dataset = ds.ManyTensorsDataset(n=80, count=64)
    expected = torch_reference(dataset, batch_size=2)
    loader = fastloader.DataLoader(dataset, batch_size=2, num_workers=2,
                                   multiprocessing_context="fork",
                                   sharing_strategy="file_descriptor")
    held = []
    with deadline(120):
        it = iter(loader)
        held.append(next(it))
        fds_after_first = num_fds()
        peak = fds_after_first
        for batch in it:
            held.append(batch)
            peak = max(peak, num_fds())
    assert len(held) == 40
    assert peak - fds_after_first <= 16, (
        f"fds grew from {fds_after_first} to {peak} while holding 40 batches of 64 tensors")
    assert_same_batch_lists(expected, held)
    del it, loader, held
    gc.collect()
