"""recv(..., only_prefer=True): while the main process sleeps for the due batch, a
result of another worker does not wake it (in order, it could not be yielded yet);
the due worker's result and the end of the wait still do, and what was published
meanwhile is taken by the next call."""
import os
import time

import pytest

import fastloader  # noqa: F401  (registers the codec hooks)
from fastloader import _core
from tests.support import helpers

PUBLISH_AFTER_S = 0.2
TIMEOUT_S = 1.5


def channel_pair(worker_id, strategy=_core.STRATEGY_FD):
    """Both ends of worker `worker_id`'s channel, in this process."""
    main = _core.MainChannel(worker_id, strategy,
                             f"fastloader-test-recv-{os.getpid()}-{worker_id}", 1 << 16, 16)
    h = main.handle()
    worker = _core.WorkerChannel(h, h["ctl_fd"], h["efd_main"], h["efd_worker"], h["sock"], 3)
    return main, worker


@pytest.fixture
def two_channels():
    # worker 1 file_system: started() (the died test) closes the main process's
    # copy of the channel's socket, which a loopback fd-strategy worker still uses
    pairs = [channel_pair(0), channel_pair(1, _core.STRATEGY_FS)]
    yield pairs
    for main, _worker in pairs:
        main.close()


def publish_later(worker, seq):
    return helpers.publish_later(worker, seq, PUBLISH_AFTER_S)


def timed_recv(mains, only_prefer):
    started = time.perf_counter()
    got = _core.recv(mains, 0, TIMEOUT_S, only_prefer)
    return got, time.perf_counter() - started


def test_another_workers_result_does_not_end_the_sleep_and_the_next_call_takes_it(two_channels):
    mains = tuple(m for m, _ in two_channels)
    t = publish_later(two_channels[1][1], 7)
    got, took = timed_recv(mains, only_prefer=True)
    t.join()
    # not woken by worker 1's result at ~0.2 s: the wait ran to its end
    assert got is None and took >= TIMEOUT_S - 0.05, (got, took)
    assert mains[0].wait_s >= TIMEOUT_S - 0.05
    got = _core.recv(mains, 0, 0.0, True)
    assert got[:3] == (1, 7, _core.RES_BATCH) and got[3] == {"seq": 7}


@pytest.mark.parametrize("publisher,only_prefer", [(1, False), (0, True)],
                         ids=["any-result-without-only_prefer", "the-due-workers-result"])
def test_a_result_that_may_wake_us_ends_the_sleep(two_channels, publisher, only_prefer):
    mains = tuple(m for m, _ in two_channels)
    t = publish_later(two_channels[publisher][1], 3)
    got, took = timed_recv(mains, only_prefer=only_prefer)
    t.join()
    assert got[:2] == (publisher, 3)
    assert took < TIMEOUT_S - 0.05, took   # woken by the result, not by the timeout


def test_a_result_already_published_elsewhere_is_taken_without_sleeping(two_channels):
    (main0, _w0), (main1, w1) = two_channels
    w1.publish(_core.RES_BATCH, 9, {"seq": 9})
    got = _core.recv((main0, main1), 0, TIMEOUT_S, True)
    assert got[:2] == (1, 9)
    assert main0.wait_s == main1.wait_s == 0.0


def test_a_worker_that_published_and_died_meanwhile_is_delivered_then_reported(two_channels):
    """Worker 1 publishes while the main process sleeps for worker 0, then dies: its
    death wakes the main process, which delivers what it published, then the death
    (not a busy loop on the dead worker's pidfd until the wait ends)."""
    mains = tuple(m for m, _ in two_channels)
    main1, worker1 = two_channels[1]
    child = os.fork()
    if child == 0:
        time.sleep(2 * PUBLISH_AFTER_S)   # dies after worker 1's publish below
        os._exit(0)
    try:
        main1.started(child)
        t = publish_later(worker1, 4)
        started = time.perf_counter()
        cpu = time.process_time()
        got = _core.recv(mains, 0, TIMEOUT_S, True)
        took, spent = time.perf_counter() - started, time.process_time() - cpu
        t.join()
        assert got is not None and got[:2] == (1, 4), got
        assert took < TIMEOUT_S - 0.05, took
        assert spent < 0.5 * took, (spent, took)   # it slept; it did not spin
        dead = _core.recv(mains, 0, TIMEOUT_S, True)
        assert dead[:3] == (1, -1, _core.RES_DEAD), dead
    finally:
        os.waitpid(child, 0)
