"""put_index, both channel ends in this process: an int, a list of ints and a list
of Nones travel through the task ring as raw int64s and reach the worker exactly;
anything beyond int64 is declined (False), with nothing queued, so that the
caller pickles it instead."""
import ctypes

import pytest

from fastloader import _core
from tests.support.helpers import loopback_channels

LIMITS = [0, -1, 1, 2**31, -2**31 - 1, 2**63 - 1, -2**63]


@pytest.mark.parametrize("index", LIMITS + [[]] + [[v] for v in LIMITS] + [LIMITS, [None] * 3])
def test_an_index_within_int64_arrives_exactly(index):
    with loopback_channels("indices") as (main, worker):
        assert main.put_index(7, index) is True
        kind, seq, got = worker.get_task()
        assert (seq, got, type(got)) == (7, index, type(index))


class Int(int):
    """An int subclass: not sent raw (its type would be lost), pickled instead."""


@pytest.mark.parametrize("index", [2**63, -2**63 - 1, 2**70, [0, 2**63], [-2**63 - 1, 0],
                                   [1, 2, 2**64], Int(3), [Int(3)], [1, None], (1, 2), "1"])
def test_an_index_beyond_int64_or_of_another_type_is_declined(index):
    with loopback_channels("indices") as (main, worker):
        assert main.put_index(1, index) is False
        assert main.put_index(2, [5]) is True   # nothing was left queued before it
        assert worker.get_task()[1:] == (2, [5])


def test_declining_leaves_the_channel_usable_for_many_tasks():
    """A declined list reserved ring space and did not commit it: the ring must not
    leak that space (more tasks than the ring holds pass after many declines)."""
    with loopback_channels("indices", task_capacity=1 << 12) as (main, worker):
        for seq in range(2000):
            assert main.put_index(seq, [1, 2, 3, 2**63]) is False
            assert main.put_index(seq, [seq, 2, 3]) is True
            assert worker.get_task()[1:] == (seq, [seq, 2, 3])
        assert main.put_index(0, 2**63) is False
        assert _core.recv((main,), 0, 0.0) is None   # and nothing came back by mistake


def _scribble_task_tail(main):
    """Do what a hostile worker can: move the shared task_tail past the main
    process's head (its offset in the control block: csrc/ring.h, fl_ctl)."""
    name = main.handle()["ctl_name"].lstrip("/")
    with open("/proc/self/maps") as f:
        starts = [int(line.split("-")[0], 16) for line in f if name in line]
    assert starts, f"{name} is not mapped here"
    for start in starts:
        tail = ctypes.c_uint64.from_address(start + 128)
        tail.value += 1 << 20


@pytest.mark.parametrize("index", [5, [None] * 4, [1, 2, 3], range(4)])
def test_a_task_ring_the_worker_corrupted_is_reported_as_corrupt_not_full(index):
    with loopback_channels("indices") as (main, worker):
        assert main.put_index(1, [1]) is True
        _scribble_task_tail(main)
        # a list or range the ring refuses is declined; the caller's pickled
        # put_task then reports the ring
        with pytest.raises(RuntimeError, match="failed validation"):
            if main.put_index(2, index) is False:
                main.put_task(_core.TASK_PICKLE, 2, b"x")


def test_a_task_the_ring_has_no_room_for_yet_is_offered_back_then_goes_in_order():
    """offer_task answers False (put_task raises) while the worker has not read the
    records before it; once it has, the task goes, after them."""
    with loopback_channels("offer", task_capacity=1 << 12) as (main, worker):
        payload = b"x" * 1500   # three records of 1,536 bytes: two fit in 4 KiB
        assert main.offer_task(_core.TASK_PICKLE, 1, payload) is True
        assert main.offer_task(_core.TASK_PICKLE, 2, payload) is True
        assert main.offer_task(_core.TASK_PICKLE, 3, payload) is False
        with pytest.raises(RuntimeError, match="full"):
            main.put_task(_core.TASK_PICKLE, 3, payload)
        assert worker.get_task()[:2] == (_core.TASK_PICKLE, 1)
        assert main.offer_task(_core.TASK_PICKLE, 3, payload) is True
        assert [worker.get_task()[1] for _ in range(2)] == [2, 3]


def test_a_task_larger_than_half_the_ring_is_refused_with_the_limit():
    with loopback_channels("offer", task_capacity=1 << 12) as (main, worker):
        for put in (main.offer_task, main.put_task):
            with pytest.raises(ValueError, match=r"a task of 3000 bytes does not fit the task "
                                                 r"ring \(at most 2016 bytes\)"):
                put(_core.TASK_PICKLE, 1, b"x" * 3000)
        assert main.put_index(1, list(range(300))) is False   # 2,400 bytes: declined
        assert main.offer_task(_core.TASK_PICKLE, 2, b"ok") is True
        assert worker.get_task()[1:] == (2, b"ok")


def test_records_wrap_at_the_window_and_a_bigger_task_widens_it():
    """Small tasks go round a 4 KiB window of a 1 MiB ring many times, each arriving
    whole; then tasks bigger than the window (the ring's address space beyond it)
    arrive too, between small ones."""
    with loopback_channels("window", task_capacity=1 << 20, task_window=1 << 12) as (
            main, worker):
        seq = 0
        for size in [40] * 300 + [3000, 40, 40_000, 40, 60_000] + [40] * 300:
            index = list(range(seq, seq + size))
            assert main.put_index(seq, index) is True
            got = worker.get_task()
            assert got[1] == seq and got[2] == index
            seq += 1


def test_a_record_not_committed_after_its_padding_leaves_no_padding_behind():
    """A record that needs padding before it (it does not fit before the window's
    end) and then is not committed (an index beyond int64): the padding must not
    stay, unread by the worker (it skips padding only once a record follows) yet
    counted as taken by the main process, so that a bigger task then had no room
    until the worker read on, which it never would."""
    with loopback_channels("pad", task_capacity=1 << 20, task_window=1 << 12) as (
            main, worker):
        for seq in (1, 2):   # two records of 1,536 bytes, read: the next starts at 3,072
            assert main.offer_task(_core.TASK_PICKLE, seq, b"x" * 1500) is True
            assert worker.get_task()[1] == seq
        # 2,048 bytes do not fit before 4,096: padding first, then no record
        assert main.put_index(3, list(range(249)) + [2**64]) is False
        # 4,032 bytes: the window widens; it fits where the padding would have gone
        assert main.offer_task(_core.TASK_PICKLE, 4, b"y" * 4000) is True
        assert worker.get_task()[1:] == (4, b"y" * 4000)


@pytest.mark.parametrize("index", [7, [None] * 3])
def test_an_index_the_full_ring_has_no_room_for_is_declined_not_an_error(index):
    """The iterator then offers it again once the worker has read on; it raised
    "ring is full" out of next()."""
    with loopback_channels("full", task_capacity=1 << 12) as (main, worker):
        assert main.offer_task(_core.TASK_PICKLE, 1, b"x" * 2000) is True
        assert main.offer_task(_core.TASK_PICKLE, 2, b"x" * 2000) is True
        assert main.put_index(3, index) is False
        assert worker.get_task()[1] == 1
        assert main.put_index(3, index) is True
        assert [worker.get_task()[1:] for _ in range(2)] == [(2, b"x" * 2000), (3, index)]
