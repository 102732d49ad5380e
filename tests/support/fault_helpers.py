"""Helpers shared by the failure-contract tests in tests/faults/: the strategies and start
methods they sweep, reaping and /dev/shm checks scoped to one process, and child
interpreters run as scripts (plain, or in their own session like a terminal's job).
"""
import contextlib
import glob
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.support.helpers import deadline, is_reaped, settle, wait_until

# torch's check_worker_number_rationality (which the loader calls) warns when num_workers
# exceeds the cores of a small box; these tests choose their worker counts on purpose
QUIET_WORKER_COUNT_WARNING = pytest.mark.filterwarnings(
    "ignore:This DataLoader will create:UserWarning")

STRATEGIES = ("file_descriptor", "file_system")
CONTEXTS = ("fork", "spawn")
# The looser bound for a death or a Ctrl-C noticed while iterating; the tight contract
# bounds (a loader blocked in next()) are in test_worker_death.py and test_interrupts.py.
LOOSE_BOUND_S = 5.0


def _strategy_for(ctx, salt=0):
    """Spread the two sharing strategies over the start methods without doubling the
    number of (slow) spawn loaders."""
    return STRATEGIES[(CONTEXTS.index(ctx) + salt) % 2]


def _my_shm(pid=None):
    """This process's named segments (/dev/shm is shared with other sessions, whose
    test leftovers are not ours to judge)."""
    return set(glob.glob(f"/dev/shm/fastloader-{pid or os.getpid()}-*"))


def _assert_no_shm_of(pid=None, timeout=5):
    wait_until(lambda: not _my_shm(pid), timeout)
    left = _my_shm(pid)
    assert not left, f"left in /dev/shm: {sorted(left)}"


def _reaped_later(pids, timeout=5):
    settle()
    assert wait_until(lambda: all(is_reaped(p) for p in pids), timeout), \
        f"workers left behind: {[p for p in pids if not is_reaped(p)]}"


def run_script(code, env, timeout=90):
    return subprocess.run([sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
                          env=env, capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def _script(code, env, *args):
    """A child interpreter in its own session (so a signal to its process group reaches
    it and its workers, as a terminal's would); on the way out, whatever of the group
    still runs is killed and the pipes are closed."""
    proc = subprocess.Popen(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code), *map(str, args)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    with proc:
        try:
            yield proc
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


def _read_line(proc, prefix, seconds=60):
    with deadline(seconds, f"subprocess line {prefix!r}"):
        while True:
            line = proc.stdout.readline()
            if not line:
                proc.wait(timeout=10)
                pytest.fail(f"subprocess exited before {prefix!r}: rc={proc.returncode}\n"
                            f"{proc.stderr.read()}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()


@contextlib.contextmanager
def workers_cannot_start(monkeypatch):
    """Inside the block, no worker pool can start, as where no fds are left."""
    from fastloader import iterator

    real = iterator.WorkerPool

    def out_of_fds(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(iterator, "WorkerPool", out_of_fds)
    try:
        yield
    finally:
        monkeypatch.setattr(iterator, "WorkerPool", real)
