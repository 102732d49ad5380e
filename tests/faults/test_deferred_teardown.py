"""An epoch's end does not wait for its workers to exit (reaper.py does, off the
training loop's path), yet nothing is left behind: every worker is reaped (no
zombie), fds, mappings, threads and /dev/shm come back to where they were, a worker
that does not stop is terminated, interpreter exit right after an epoch waits for
the exiting workers, and errors are raised as before.

Deferred means: the StopIteration (or the `del`) returns while the workers are
still running their exit; these tests make that exit slow (a finalizer that
sleeps) so that this is a state to observe, not a timing to assert."""
import functools
import os
import signal

import psutil
import pytest

from fastloader import DataLoader, reaper
from tests.support import datasets as ds
from tests.support import reliability_datasets as rd
from tests.support.fault_helpers import (
    QUIET_WORKER_COUNT_WARNING, STRATEGIES, _my_shm, run_script,
)
from tests.support.helpers import (
    assert_no_shm_left, deadline, is_gone, is_reaped, loader_children, num_fds, num_maps,
    settle, shm_names, wait_until,
)

pytestmark = [QUIET_WORKER_COUNT_WARNING]


def _running(pid):
    return not is_gone(pid)


@pytest.mark.parametrize("how", ["exhaust", "del"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_epoch_end_returns_while_workers_still_exit(how, strategy):
    shm0 = shm_names()
    loader = DataLoader(rd.SmallDataset(n=16), batch_size=4, num_workers=2,
                        multiprocessing_context="fork", sharing_strategy=strategy,
                        worker_init_fn=functools.partial(rd.slow_exit_init, 3.0))
    with deadline(60):
        it = iter(loader)
        pids = list(it.worker_pids)
        if how == "exhaust":
            assert len(list(it)) == 4
        else:
            next(it)
        del it
        # the loop is free again, and the workers are still in their (3 s) exit
        assert all(_running(p) for p in pids), "teardown waited for the workers"
        assert reaper.pending() == 1
        settle()   # waits for the reaper
    assert all(is_reaped(p) for p in pids), [p for p in pids if not is_reaped(p)]
    assert reaper.pending() == 0
    assert_no_shm_left(shm0)


def _zombie_children():
    """How many of our children are zombies now. The reaper thread may reap a child
    between listing it and reading its status: a child gone by then is no zombie."""
    count = 0
    for child in psutil.Process().children():
        try:
            count += child.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass
    return count


def test_many_short_epochs_leave_nothing_behind():
    """200 ten-batch epochs, back to back (the next one starts while the last
    one's workers exit), both strategies: no zombie, fd, mapping, thread or
    segment more than before."""
    loaders = [DataLoader(rd.SmallDataset(n=40), batch_size=4, num_workers=2,
                          multiprocessing_context="fork", sharing_strategy=s)
               for s in STRATEGIES]

    def epoch(i):
        got = [int(y[0]) for _x, y in loaders[i % 2]]
        assert got == list(range(0, 40, 4)), got

    def measure():
        settle()
        return (num_fds(), num_maps(), psutil.Process().num_threads(), loader_children(),
                shm_names())

    with deadline(240, "200 short epochs"):
        for i in range(4):
            epoch(i)
        fds0, maps0, threads0, children0, shm0 = measure()
        zombies_seen = 0
        for i in range(200):
            epoch(i)
            # never more than the epochs whose workers are still exiting
            zombies_seen = max(zombies_seen, _zombie_children())
        fds1, maps1, threads1, children1, _shm1 = measure()
    assert not (children1 - children0), f"processes left: {sorted(children1 - children0)}"
    assert fds1 - fds0 <= 2, f"fds grew from {fds0} to {fds1}"
    assert maps1 - maps0 <= 8, f"mappings grew from {maps0} to {maps1}"
    assert threads1 <= threads0, f"threads grew from {threads0} to {threads1}"
    # this process's names only: another test process (pytest -n) or suite on the box
    # may hold segments of its own meanwhile, or a killed one's leftovers for a moment
    left = _my_shm() - shm0
    assert not left, sorted(left)
    # a worker unreaped would pile up (400 over the run); the reaper runs off the
    # loop's path, so on a loaded box a few epochs' workers may wait for it at once
    # (5 seen here under 2 busy loops, against a bound of 4 that was 2 epochs')
    assert zombies_seen <= 8, f"{zombies_seen} zombies at once: workers are not reaped"


def test_a_worker_that_does_not_stop_is_terminated_by_the_reaper():
    """The deferred teardown keeps shutdown's bound: terminated after 5 s."""
    loader = DataLoader(rd.SmallDataset(n=8), batch_size=4, num_workers=1,
                        multiprocessing_context="fork",
                        worker_init_fn=functools.partial(rd.slow_exit_init, 120.0))
    with deadline(60):
        it = iter(loader)
        (worker,) = it._workers
        assert len(list(it)) == 2
        assert _running(worker.pid) and reaper.pending() == 1
        assert reaper.wait_idle(20), "the reaper did not end a worker that ignored shutdown"
    assert is_reaped(worker.pid)
    assert worker.exitcode == -signal.SIGTERM
    del it


@pytest.mark.parametrize("how", ["exhaust", "break"])
def test_interpreter_exit_right_after_an_epoch(subprocess_env, how):
    """The program ends while the last epoch's workers are still exiting: exit
    waits for them (no orphan, no zombie), says nothing, leaves no segment."""
    shm_before = shm_names()
    loop_end = "pass" if how == "exhaust" else "break"
    result = run_script(f"""
        import functools, os
        from fastloader import DataLoader
        from tests.support.reliability_datasets import SmallDataset, slow_exit_init
        pids = []
        for strategy in ("file_descriptor", "file_system"):
            loader = DataLoader(SmallDataset(n=16), batch_size=4, num_workers=2,
                                multiprocessing_context="fork", sharing_strategy=strategy,
                                worker_init_fn=functools.partial(slow_exit_init, 1.0))
            it = iter(loader)
            pids += it.worker_pids
            for batch in it:
                {loop_end}
            del it, batch
        print(os.getpid(), " ".join(map(str, pids)), flush=True)
    """, subprocess_env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", f"output at exit:\n{result.stderr}"
    script, *pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 4, result.stdout
    # gone when the interpreter is: exit waited for them
    assert all(is_gone(p) for p in pids), [p for p in pids if not is_gone(p)]
    # and so are its segments, at once (its names carry its pid: another test
    # process's leftovers of a killed loader may be there for a moment)
    left = _my_shm(script) - shm_before
    assert not left, sorted(left)


@pytest.mark.parametrize("how", ["epoch ended", "break"])
def test_interpreter_exit_gives_a_slow_worker_exit_its_5_seconds(subprocess_env, tmp_path, how):
    """A worker whose exit takes 3 s (flushing a dataset's files, a finalizer),
    its epoch ended (or left by `break`, the iterator deleted) just before the
    program ends: it gets the 5 s the README promises, as torch's loop would have
    waited for it at the epoch's end, so its exit's work is done. Exit used to
    terminate it after 2 s (SIGTERM), and the work was lost."""
    marker = tmp_path / "exited"
    loop = "for batch in it: pass" if how == "epoch ended" else "next(it)\n        del it"
    result = run_script(f"""
        import functools
        from fastloader import DataLoader
        from tests.support.reliability_datasets import SmallDataset, slow_exit_init
        loader = DataLoader(SmallDataset(n=16), batch_size=4, num_workers=2,
                            multiprocessing_context="fork",
                            worker_init_fn=functools.partial(slow_exit_init, 3.0,
                                                             marker={str(marker)!r}))
        it = iter(loader)
        pids = it.worker_pids
        {loop}
        print(" ".join(map(str, pids)), flush=True)
    """, subprocess_env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", f"output at exit:\n{result.stderr}"
    pids = [int(p) for p in result.stdout.split()]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"exited.{p}" for p in pids)


def test_an_error_in_the_last_batch_is_still_raised():
    """A short epoch whose last batch fails: the error is raised where torch raises
    it; dropping the iterator then tears down off the path, leaving nothing."""
    shm0 = shm_names()
    loader = DataLoader(ds.RaisingDataset(n=20, bad_index=19), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    with deadline(60):
        it = iter(loader)
        pids = list(it.worker_pids)
        got = [next(it) for _ in range(4)]
        with pytest.raises(ValueError, match="bad sample 19"):
            next(it)
        assert [int(b[0]) for b in got] == [0, 4, 8, 12]
        del it, got
        settle()
    assert all(is_reaped(p) for p in pids)
    assert_no_shm_left(shm0)


def test_a_worker_death_is_still_reported_and_reaped():
    loader = DataLoader(rd.SmallDataset(n=400), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    with deadline(60):
        it = iter(loader)
        next(it)
        victim = it.worker_pids[0]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=f"pid {victim}.*SIGKILL"):
            for _ in it:
                pass
        pids = list(it.worker_pids)
        del it
        settle()
    assert wait_until(lambda: all(is_reaped(p) for p in pids), 5)


@pytest.mark.parametrize("reaped_by", ["SIGCHLD ignored", "os.wait elsewhere"])
def test_workers_reaped_by_someone_else_still_let_the_reaper_finish(subprocess_env, reaped_by):
    """A program whose children someone else reaps (SIGCHLD ignored, so the kernel
    reaps them; or an os.wait() of its own): multiprocessing then never learns a
    worker's exit status. The reaper thread must still finish each retired pool
    (the worker is gone; its status is lost and reads 0), not wait on its ready
    sentinel for ever, spinning a CPU (seen in `make bench`: 80% of a core)."""
    result = run_script(f"""
        import os, signal, threading, time
        import torch
        from fastloader import DataLoader, reaper
        from tests.support.reliability_datasets import SmallDataset
        if {reaped_by!r} == "SIGCHLD ignored":
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        else:   # a program's own reaper thread, already waiting when a worker exits
            def reap_children():
                while True:
                    try:
                        os.waitpid(-1, 0)
                    except ChildProcessError:
                        time.sleep(0.01)
            threading.Thread(target=reap_children, daemon=True).start()
        workers = []
        for epoch in range(3):
            loader = DataLoader(SmallDataset(n=16), batch_size=4, num_workers=2,
                                multiprocessing_context="fork")
            it = iter(loader)
            workers += it._workers
            got = [b for b in it]
            expected = list(torch.utils.data.DataLoader(SmallDataset(n=16), batch_size=4))
            assert all(torch.equal(a, b) for x, y in zip(got, expected) for a, b in zip(x, y))
            assert len(got) == len(expected) == 4
            del it, got
        assert reaper.wait_idle(30), "the reaper thread still waits for reaped workers"
        cpu = time.process_time()
        time.sleep(1.0)
        spent = time.process_time() - cpu
        assert spent < 0.3, f"{{spent:.2f}} s of CPU in 1 s while idle"
        assert [w.exitcode for w in workers] == [0] * 6, [w.exitcode for w in workers]
        assert not any(w.is_alive() for w in workers)
        print("OK", flush=True)
    """, subprocess_env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK", (result.stdout, result.stderr)


def test_a_worker_death_whose_status_someone_else_took_is_not_called_exit_code_0(
        subprocess_env):
    """SIGCHLD ignored: the kernel reaps a worker that SIGKILLed itself, and its
    status is lost. The error said "exited unexpectedly with exit code 0", a clean
    exit that never happened."""
    result = run_script("""
        import os, signal
        import torch
        from fastloader import DataLoader, WorkerError
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)

        class DiesAt5(torch.utils.data.Dataset):
            def __len__(self):
                return 16

            def __getitem__(self, i):
                if i == 5:
                    os.kill(os.getpid(), signal.SIGKILL)
                return i

        try:
            for _ in DataLoader(DiesAt5(), batch_size=2, num_workers=2,
                                multiprocessing_context="fork", timeout=60):
                pass
        except WorkerError as error:
            print(error, flush=True)
    """, subprocess_env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "exited unexpectedly; how is unknown" in result.stdout, (result.stdout, result.stderr)
    assert "exit code 0" not in result.stdout, result.stdout


def test_the_reaper_does_not_spin_on_a_job_whose_fds_stay_ready():
    """A job whose fd is ready but whose step cannot finish yet (a join elsewhere
    holds one of its processes) is looked at again after a pause, not in a loop
    that keeps a CPU busy."""
    r, w = os.pipe()
    os.close(w)   # r reads EOF: ready for ever, like an exited worker's sentinel

    class StuckForAWhile:
        def __init__(self):
            self.steps = 0
            self.until = None

        def wait_fds(self):
            return [r]

        def step(self, now):
            self.steps += 1
            self.until = self.until or now + 0.5
            return now >= self.until

    job = StuckForAWhile()
    try:
        reaper.retire(job)
        assert reaper.wait_idle(30)
    finally:
        os.close(r)
    # 0.5 s of "not yet" at one look per pause (5 ms): ~100 looks, not ~100,000
    assert 2 <= job.steps <= 400, job.steps
