"""A task put while its worker sleeps costs the main process a wake-up (a system
call), counted per worker in stats()["workers"][i]["wakeups"]; a task put while
the worker is busy, or still spinning for its next task (spin.c), costs none."""
import threading
import time

import pytest

from tests.support.helpers import loopback_channels

ASLEEP_AFTER_S = 0.3   # far beyond the worker's spin (50 us)


@pytest.fixture
def pair():
    with loopback_channels("wakeups") as channels:
        yield channels


def take_task_in_thread(worker, got):
    t = threading.Thread(target=lambda: got.append(worker.get_task()))
    t.start()
    return t


def test_a_task_for_a_sleeping_worker_is_one_wakeup_and_a_queued_one_none(pair):
    main, worker = pair
    assert main.stats()["wakeups"] == 0
    got = []
    t = take_task_in_thread(worker, got)
    time.sleep(ASLEEP_AFTER_S)   # the worker spun, found nothing, and sleeps
    assert main.put_index(0, [1, 2])
    t.join(timeout=10)
    assert not t.is_alive() and got[0][1:] == (0, [1, 2])
    assert main.stats()["wakeups"] == 1

    # nobody waits: queued without a system call, taken at once
    assert main.put_index(1, [3])
    assert worker.get_task()[1:] == (1, [3])
    assert main.stats()["wakeups"] == 1


def test_the_loaders_stats_report_each_workers_wakeups():
    import fastloader
    from tests.support.datasets import TensorLabelDataset

    loader = fastloader.DataLoader(TensorLabelDataset(64), batch_size=4, num_workers=2,
                                   persistent_workers=True)

    def wakeups(it):
        workers = it.stats(memory=False)["workers"]
        assert [type(w["wakeups"]) for w in workers] == [int, int]
        return sum(w["wakeups"] for w in workers)

    it = iter(loader)
    for _ in range(2):   # tasks 0-5 are out: whether they found a worker asleep
        next(it)         # depends on how fast the workers started
        time.sleep(0.1)
    before = wakeups(it)
    # A slow consumer: each of tasks 6-15 is put ~60 ms after its worker's previous
    # one, long done: the worker sleeps in its poll. Not 100 ms a batch: a worker's
    # poll wakes every 200 ms (to watch the main process), and a task put as it
    # does is taken without a wake-up; with tasks 200 ms apart that phase drifts
    # slowly, and several tasks in a row could land there.
    for _ in it:
        time.sleep(0.03)
    assert 8 <= wakeups(it) - before <= 10, (before, wakeups(it))
