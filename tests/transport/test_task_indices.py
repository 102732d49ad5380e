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
