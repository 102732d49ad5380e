"""The main process SIGKILLed, even while it holds batches: its workers exit within
seconds, quietly, and unlink every named segment on their way out.

Every wait runs under `deadline` (SIGALRM) or a subprocess timeout, and
faulthandler_timeout (pyproject) dumps stacks if all else fails.
"""
import signal
import time

import pytest

from tests.support.fault_helpers import (
    CONTEXTS, QUIET_WORKER_COUNT_WARNING, STRATEGIES, _assert_no_shm_of, _read_line, _script,
    run_script,
)
from tests.support.helpers import assert_no_shm_left, deadline, is_gone, shm_names, wait_until

pytestmark = [QUIET_WORKER_COUNT_WARNING]

MAIN_KILL_BOUND_S = 5.0


def test_main_process_killed(subprocess_env):
    """SIGKILL of the main process: its workers exit within seconds, /dev/shm stays clean."""
    shm_before = shm_names()
    result = run_script("""
        import os, signal
        from fastloader import DataLoader
        from tests.support.datasets import SlowDataset
        loader = DataLoader(SlowDataset(n=10_000, delay=0.01), batch_size=2, num_workers=2,
                            multiprocessing_context="fork", sharing_strategy="file_system")
        it = iter(loader)
        held = [next(it), next(it)]
        print(" ".join(str(p) for p in it.worker_pids), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """, subprocess_env)
    assert result.returncode == -signal.SIGKILL, (result.returncode, result.stderr)
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 2, (result.stdout, result.stderr)
    assert wait_until(lambda: all(is_gone(p) for p in pids), 10), \
        f"workers still running 10 s after the main process died: {[p for p in pids if not is_gone(p)]}"
    assert_no_shm_left(shm_before)


_MAIN_KILL_SCRIPT = """
    import glob, os, signal, sys, time
    from fastloader import DataLoader
    from tests.support.reliability_datasets import SlowDataset

    ctx, strategy = sys.argv[1], sys.argv[2]
    loader = DataLoader(SlowDataset(delay=0.002), batch_size=2, num_workers=2,
                        multiprocessing_context=ctx, sharing_strategy=strategy)
    it = iter(loader)
    # more batches held than the rings have slots: overflow segments are live too
    held = [next(it) for _ in range(14)]
    time.sleep(0.3)   # the workers publish their prefetched batches (not taken yet)
    mine = glob.glob(f"/dev/shm/fastloader-{os.getpid()}-*")
    print("pids", *it.worker_pids, flush=True)
    print("named", len(mine), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ctx", CONTEXTS)
def test_main_sigkilled_while_holding_batches(ctx, strategy, subprocess_env):
    with _script(_MAIN_KILL_SCRIPT, subprocess_env, ctx, strategy) as proc:
        pids = [int(p) for p in _read_line(proc, "pids ").split()]
        named = int(_read_line(proc, "named "))
        with deadline(30, "the main-kill script"):
            proc.wait(timeout=25)
        died = time.monotonic()
        assert proc.returncode == -signal.SIGKILL, proc.returncode
        assert len(pids) == 2
        all_gone = wait_until(lambda: all(is_gone(p) for p in pids), MAIN_KILL_BOUND_S)
        gone_after = time.monotonic() - died
        assert all_gone, f"workers still running {MAIN_KILL_BOUND_S} s after the main " \
            f"process died: {[p for p in pids if not is_gone(p)]}"
        with deadline(30, "the workers' stderr"):
            err = proc.stderr.read()
    if strategy == "file_system":
        assert named > 0, "no named segment was live at the kill: the test proves nothing"
    assert gone_after < MAIN_KILL_BOUND_S
    # nothing left in /dev/shm: named segments unlinked by the workers on their way out
    # (only this script's names count: /dev/shm is shared with other sessions)
    _assert_no_shm_of(proc.pid, timeout=1)
    assert err == "", err
