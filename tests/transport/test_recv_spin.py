"""recv(..., spin_ns): where a CPU is spare the main process spins for a batch
before it sleeps, so the worker that publishes it need not wake it (a system call
and an interrupt to another CPU); the worker counts each wake-up it paid for in
stats()["main_wakeups"]. The spin never outlasts the caller's timeout, and the
time spent spinning is waiting for data like a sleep."""
import os
import threading
import time

import pytest

from fastloader import _core
from tests.support.helpers import loopback_channels

PUBLISH_AFTER_S = 0.2
LONG_SPIN_NS = 5_000_000_000   # far beyond PUBLISH_AFTER_S, even on a loaded box

needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                    reason="recv never spins with one usable CPU")


@pytest.fixture
def pair():
    with loopback_channels("spin") as channels:
        yield channels


def publish_later(worker, seq):
    def run():
        time.sleep(PUBLISH_AFTER_S)
        worker.publish(_core.RES_BATCH, seq, {"seq": seq})
    t = threading.Thread(target=run)
    t.start()
    return t


@needs_two_cpus
def test_a_spinning_main_process_takes_the_batch_and_the_worker_wakes_no_one(pair):
    main, worker = pair
    t = publish_later(worker, 5)
    started = time.perf_counter()
    got = _core.recv((main,), 0, 30.0, True, LONG_SPIN_NS)
    took = time.perf_counter() - started
    t.join()
    assert got[:2] == (0, 5) and got[3] == {"seq": 5}
    assert main.stats()["main_wakeups"] == 0    # it never slept: nothing to wake
    assert main.wait_s >= PUBLISH_AFTER_S - 0.02, main.wait_s   # a data stall all the same
    assert took < 5.0, took


def test_without_a_spin_the_worker_pays_for_waking_the_main_process(pair):
    main, worker = pair
    t = publish_later(worker, 6)
    got = _core.recv((main,), 0, 30.0, True, 0)
    t.join()
    assert got[:2] == (0, 6)
    assert main.stats()["main_wakeups"] == 1
    assert main.wait_s >= PUBLISH_AFTER_S - 0.02, main.wait_s


@needs_two_cpus
def test_a_spin_never_runs_past_the_timeout(pair):
    main, _worker = pair
    started = time.perf_counter()
    assert _core.recv((main,), 0, 0.3, True, LONG_SPIN_NS) is None
    took = time.perf_counter() - started
    assert 0.3 - 0.02 <= took < 3.0, took   # the 5 s spin was cut at the deadline
    assert _core.recv((main,), 0, 0.0, True, LONG_SPIN_NS) is None   # a poll: no spin


def test_recv_refuses_a_wrong_number_of_arguments(pair):
    main, _worker = pair
    with pytest.raises(TypeError, match="spin_ns"):
        _core.recv((main,), 0, 0.0, True, 0, 1)
