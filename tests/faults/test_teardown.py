"""Nothing left behind: an iterator exhausted, dropped or left by break joins its workers;
live iterators at interpreter exit end quietly; and 200 or 1,000 loader lifetimes or
100 persistent epochs leave fds, mappings, threads, processes and /dev/shm where they
started.

Every wait runs under `deadline` (SIGALRM) or a subprocess timeout, and
faulthandler_timeout (pyproject) dumps stacks if all else fails.
"""
import psutil
import pytest
import torch

from fastloader import DataLoader
from tests.support import datasets as ds
from tests.support import reliability_datasets as rd
from tests.support.fault_helpers import (
    QUIET_WORKER_COUNT_WARNING, STRATEGIES, _my_shm, _reaped_later, run_script,
)
from tests.support.helpers import (
    assert_no_shm_left, deadline, is_gone, is_reaped, loader_children, num_fds, num_maps,
    settle, shm_names, wait_until,
)

pytestmark = [QUIET_WORKER_COUNT_WARNING]


@pytest.mark.parametrize("how", ["exhaust", "del", "break"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_iterator_end_joins_workers(how, strategy):
    loader = DataLoader(ds.TensorLabelDataset(n=40), batch_size=2, num_workers=2,
                        multiprocessing_context="fork", sharing_strategy=strategy)
    with deadline(30):
        it = iter(loader)
        pids = list(it.worker_pids)
        assert all(pid in loader_children() for pid in pids)
        if how == "exhaust":
            assert len(list(it)) == 20
        elif how == "del":
            next(it), next(it)
            del it
        else:
            for i, _ in enumerate(it):
                if i == 1:
                    break
            del it
    settle()
    # joined means reaped: not running, and not a zombie child either
    assert wait_until(lambda: all(is_reaped(p) for p in pids), 2), [
        p for p in pids if not is_reaped(p)]


def test_interpreter_exit_with_live_iterators(subprocess_env):
    """Iterators still alive mid-epoch at exit: clean exit, no warning or traceback,
    workers gone, nothing in /dev/shm."""
    shm_before = shm_names()
    result = run_script("""
        from fastloader import DataLoader
        from tests.support.datasets import TensorLabelDataset
        its = []
        for strategy in ("file_descriptor", "file_system"):
            loader = DataLoader(TensorLabelDataset(n=200), batch_size=2, num_workers=2,
                                multiprocessing_context="fork", sharing_strategy=strategy)
            it = iter(loader)
            batch = next(it)
            its.append((it, batch))
        print(" ".join(str(p) for it, _ in its for p in it.worker_pids), flush=True)
    """, subprocess_env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", f"output at exit:\n{result.stderr}"
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 4, result.stdout
    assert wait_until(lambda: all(is_gone(p) for p in pids), 5), [p for p in pids if not is_gone(p)]
    assert_no_shm_left(shm_before)


def test_no_growth_after_200_partial_loaders():
    """fds, mappings, processes and /dev/shm entries are back where they started after
    200 loader lifetimes that each stopped after two batches."""
    dataset = ds.TensorLabelDataset(n=64)

    def lifetime(i):
        loader = DataLoader(dataset, batch_size=4, num_workers=2,
                            multiprocessing_context="fork",
                            sharing_strategy=STRATEGIES[i % 2])
        if i % 3 == 0:
            for j, batch in enumerate(loader):
                if j == 1:
                    break
        else:
            it = iter(loader)
            x, y = next(it)
            x, y = next(it)
            del it, x, y
        del loader

    with deadline(180, "200 loader lifetimes"):
        for i in range(6):  # warm up: lazily created, process-lifetime state
            lifetime(i)
        settle()
        fds0, maps0, children0, shm0 = num_fds(), num_maps(), loader_children(), shm_names()
        for i in range(200):
            lifetime(i)
    settle()
    wait_until(lambda: loader_children() <= children0, 5)
    fds1, maps1, children1 = num_fds(), num_maps(), loader_children()
    assert not (children1 - children0), f"processes left: {sorted(children1 - children0)}"
    assert fds1 - fds0 <= 2, f"fds grew from {fds0} to {fds1} over 200 loaders"
    assert maps1 - maps0 <= 8, f"mappings grew from {maps0} to {maps1} over 200 loaders"
    assert_no_shm_left(shm0)


def _measure():
    settle()
    me = psutil.Process()
    return {"fds": num_fds(), "maps": num_maps(), "threads": me.num_threads(),
            "children": loader_children(), "shm": _my_shm()}


def _assert_no_growth(before, after, what, fd_slack=2, map_slack=8):
    assert not (after["children"] - before["children"]), \
        f"{what}: processes left: {sorted(after['children'] - before['children'])}"
    assert after["fds"] - before["fds"] <= fd_slack, \
        f"{what}: fds grew from {before['fds']} to {after['fds']}"
    assert after["maps"] - before["maps"] <= map_slack, \
        f"{what}: mappings grew from {before['maps']} to {after['maps']}"
    assert after["threads"] <= before["threads"], \
        f"{what}: threads grew from {before['threads']} to {after['threads']}"
    assert not after["shm"], f"{what}: left in /dev/shm: {sorted(after['shm'])}"


def test_1000_loader_lifetimes_with_early_break():
    dataset = rd.SmallDataset(n=64)

    def lifetime(i):
        loader = DataLoader(dataset, batch_size=4, num_workers=1,
                            multiprocessing_context="fork", sharing_strategy=STRATEGIES[i % 2])
        for j, (x, y) in enumerate(loader):
            assert int(y[0]) == 4 * j
            if j == i % 3:
                break
        del loader, x, y

    with deadline(150, "1,000 loader lifetimes"):
        for i in range(8):   # warm-up: lazily created, process-lifetime state
            lifetime(i)
        start = _measure()
        for i in range(500):
            lifetime(i)
        wait_until(lambda: loader_children() <= start["children"], 5)
        half = _measure()
        for i in range(500, 1000):
            lifetime(i)
        wait_until(lambda: loader_children() <= start["children"], 5)
        end = _measure()
    _assert_no_growth(start, half, "after 500 lifetimes")
    _assert_no_growth(start, end, "after 1,000 lifetimes")
    # whatever noise there is may not grow with the count
    assert end["fds"] <= max(half["fds"], start["fds"] + 1)
    assert end["maps"] <= max(half["maps"], start["maps"]) + 4


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_100_epochs_with_persistent_workers(strategy):
    """Same workers throughout; every other epoch breaks after its first batch (the
    next epoch must drop what was prefetched for it); no growth in anything."""
    loader = DataLoader(rd.SmallDataset(n=24), batch_size=4, num_workers=2,
                        persistent_workers=True, multiprocessing_context="fork",
                        sharing_strategy=strategy)

    def epoch(e):
        for j, (x, y) in enumerate(loader):
            assert torch.equal(y, torch.arange(4 * j, 4 * j + 4)), (e, j, y)
            assert torch.equal(x, y[:, None] * 10 + torch.arange(4)), (e, j)
            if e % 2 and j == 0:
                break
        return j

    with deadline(90, "100 persistent epochs"):
        for e in range(4):
            epoch(e)
        pids = list(loader._iterator.worker_pids)
        start = _measure()
        for e in range(4, 104):
            last = epoch(e)
            assert last == (0 if e % 2 else 5)
        end = _measure()
        assert list(loader._iterator.worker_pids) == pids, "workers were restarted"
        assert all(not is_gone(p) for p in pids)
    _assert_no_growth(start, end, "after 100 persistent epochs")
    del loader
    _reaped_later(pids)
