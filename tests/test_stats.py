"""loader.stats() and FASTLOADER_STATS=1: the figures add up to what happened."""
import os
import subprocess
import sys
import time

import pytest

import fastloader
from tests.support import datasets as ds
from tests.support.helpers import deadline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_stats_add_up_over_an_epoch():
    loader = fastloader.DataLoader(ds.SlowDataset(n=48, delay=0.002), batch_size=4,
                                   num_workers=2)
    assert loader.stats() is None
    started = time.perf_counter()
    with deadline(60):
        batches = [b for b in loader]
    elapsed = time.perf_counter() - started
    s = loader.stats()
    assert s["batches"] == len(batches) == 12
    assert s["batches_per_worker"] == [6, 6]   # round robin
    assert s["slot_batches"] + s["overflow_batches"] == s["batches"]
    assert 0 <= s["wait_s"] <= s["wall_s"] <= elapsed + 0.5
    assert 0.0 <= s["data_stall_fraction"] <= 1.0
    assert len(s["workers"]) == 2
    for w in s["workers"]:
        assert w["published"] >= 6 and w["received"] >= 6
        assert w["busy_s"] > 0 and w["idle_s"] >= 0
        assert 0.0 <= w["busy_fraction"] <= 1.0
        assert 0.0 <= w["ring_occupancy"] <= 1.0
        assert w["slots"] >= 2 and w["slot_size"] > 0


def test_slow_workers_show_as_a_data_stall():
    # each sample sleeps 5 ms, the consumer does nothing: the main process waits
    loader = fastloader.DataLoader(ds.SlowDataset(n=40, delay=0.005), batch_size=4,
                                   num_workers=1)
    with deadline(60):
        for _ in loader:
            pass
    assert loader.stats()["data_stall_fraction"] > 0.5


def test_held_batches_show_in_ring_occupancy_and_worker_memory():
    loader = fastloader.DataLoader(ds.TensorLabelDataset(n=64), batch_size=4, num_workers=1)
    it = iter(loader)
    with deadline(60):
        held = [next(it) for _ in range(3)]
    w = it.stats()["workers"][0]
    assert w["slots_held"] >= 3 - w["overflow_segments"]
    assert w["uss_bytes"] and w["uss_bytes"] > 0 and w["pss_bytes"] > 0
    del held, it


def test_env_var_prints_one_line_per_epoch(subprocess_env):
    code = ("import fastloader\n"
            "from tests.support import datasets as ds\n"
            "if __name__ == '__main__':\n"
            "    dl = fastloader.DataLoader(ds.TensorLabelDataset(n=32), batch_size=4,"
            " num_workers=2, persistent_workers=True)\n"
            "    for _ in range(2):\n"
            "        for _ in dl: pass\n")
    env = dict(subprocess_env, FASTLOADER_STATS="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("fastloader: epoch")]
    assert [l.split(":")[1].strip() for l in lines] == ["epoch 1", "epoch 2"], proc.stderr
    assert all("8 batches" in l and "stall" in l for l in lines), lines


def test_recv_times_its_sleep_on_the_wanted_channel_and_nothing_on_the_fast_path():
    """The data stall is timed by recv() in C, only while it sleeps, and charged to
    the channel whose result was wanted (the loader reads the growth per epoch)."""
    from benchmarks.loopback import exchange, make_pair
    from fastloader import _core

    main, worker = make_pair(prefix=f"fastloader-test-stats-{os.getpid()}")
    worker_batches = []
    try:
        assert main.wait_s == 0.0
        started = time.perf_counter()
        assert _core.recv((main,), 0, 0.3) is None   # nothing published: times out
        slept = time.perf_counter() - started
        assert 0.25 <= main.wait_s <= slept + 0.05
        before = main.wait_s
        worker_batches = [exchange(main, worker, i, [i], {"i": i}) for i in range(20)]
        assert [b[1] for b in worker_batches] == list(range(20))
        # each result was published before recv() looked: no sleep, no time
        assert main.wait_s == before
    finally:
        del worker_batches
        main.close()


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_epochs_are_numbered_per_loader(workers, persistent):
    """stats() and state_dict() number the loader's epochs 1, 2, 3 whatever makes
    them: without persistent workers each epoch has an iterator of its own, and
    every one used to say epoch 1 (so did FASTLOADER_STATS's line)."""
    dl = fastloader.DataLoader(ds.TensorLabelDataset(n=8), batch_size=2, num_workers=workers,
                               persistent_workers=persistent)
    numbers = []
    for _ in range(3):
        for _ in dl:
            pass
        numbers.append((dl.stats()["epoch"] if workers else None, dl.state_dict()["epoch"]))
    expected = [(n if workers else None, n) for n in (1, 2, 3)]
    assert numbers == expected


def test_an_installed_torch_loader_numbers_its_epochs():
    """A torch DataLoader given fastloader's workers by install(): its iterators
    number its epochs too."""
    import torch

    fastloader.install()
    try:
        dl = torch.utils.data.DataLoader(ds.TensorLabelDataset(n=8), batch_size=2,
                                         num_workers=2)
        numbers = []
        for _ in range(3):
            it = iter(dl)
            for _ in it:
                pass
            numbers.append(it.stats()["epoch"])
            del it
    finally:
        fastloader.uninstall()
    assert numbers == [1, 2, 3]
