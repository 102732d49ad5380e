"""At the user's process limit (RLIMIT_NPROC, which counts threads too).

The kernel refuses a worker's fork (EAGAIN): iter() raises that OSError, with a
note naming the worker and the cause, and leaves nothing behind: no fd
(multiprocessing's fork start leaked the four pipe fds it had made for the child,
for torch's DataLoader too), no process; the loader works once the limit is lifted.

The forks get through but no thread can be started, in the workers or in the main
process: epochs run all the same (torch's DataLoader fails there: "can't start new
thread"), the workers without their watchdog thread and the main process reaping
them itself."""
import ctypes
import errno
import gc
import os
import resource
import select
import signal
import sys
import threading
import time
import traceback
import types

import psutil
import pytest
import torch
from torch.utils.data import TensorDataset

import fastloader
from fastloader import pool, reaper, refused_fork
from tests.support.helpers import in_forked_child, loopback_channels

root_only = pytest.mark.skipif(os.geteuid() != 0,
                               reason="plays a user of its own with setuid (root only)")


def _fd_table():
    table = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            table[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:   # the listing's own fd, closed by now
            pass
    return table


def _loader_as_a_user_of_its_own(num_workers, dataset=None, **kwargs):
    """A loader that has run one epoch, in this (forked) process turned into a
    user that runs nothing else; how many tasks the user runs (this process's
    threads)."""
    # A uid of its own: RLIMIT_NPROC counts every task of the real uid on the
    # machine, and other tests play uid 65534 at the same time.
    uid = 1_900_000_000 + os.getpid()
    dataset = TensorDataset(torch.arange(20.0)) if dataset is None else dataset
    loader = fastloader.DataLoader(dataset, batch_size=5, num_workers=num_workers,
                                   multiprocessing_context="fork", **kwargs)
    list(loader)   # imports what an epoch needs while root: the new user may not read /root
    # the reaper thread, reaping that epoch's workers, is a task of this process
    # too: once it has exited, this process is all that the new uid runs
    assert reaper.wait_idle(30), "the warm-up epoch's workers were not reaped"
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    return loader, len(os.listdir("/proc/self/task"))


def _refused_then_lifted(extra):
    loader, tasks = _loader_as_a_user_of_its_own(2)
    before = _fd_table()
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    real_fork, forks = os.fork, []

    def counted_fork():
        forks.append(1)
        return real_fork()

    os.fork = counted_fork   # this forked child's own os module
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks + extra, hard))
    try:
        iter(loader)
        raised = None
    except OSError as exc:
        raised = exc
    finally:
        resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard))
        os.fork = real_fork
    me = psutil.Process()

    def new_fds():   # (the warm-up epoch's fds may be released meanwhile)
        return {fd: what for fd, what in _fd_table().items() if before.get(fd) != what}

    deadline = time.monotonic() + 30
    while (me.children() or new_fds()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    batches = [b.tolist() for (b,) in loader]
    assert reaper.wait_idle(30)   # no worker outlives this child's os._exit
    return {
        "raised": None if raised is None else (type(raised).__name__, raised.errno,
                                               getattr(raised, "__notes__", [])),
        "left_open": new_fds(),
        "forks": len(forks),
        "children": [p.pid for p in me.children()],
        "batches": batches,
    }


@root_only
@pytest.mark.parametrize("refused", [0, 1], ids=["first_fork", "second_fork"])
def test_a_refused_fork_raises_with_a_note_and_leaves_nothing(refused):
    got = in_forked_child(lambda: _refused_then_lifted(refused))
    assert got["raised"] is not None, "iter() started both workers under the limit"
    name, code, notes = got["raised"]
    assert (name, code) == ("BlockingIOError", errno.EAGAIN), got["raised"]
    if sys.version_info >= (3, 11):   # exception notes
        assert any(f"DataLoader worker {refused} of 2 could not be started: the process "
                   "limit was reached" in note for note in notes), notes
    # no fork after the refused one: the pool would only stop that worker again
    assert got["forks"] == refused + 1, got["forks"]
    assert got["left_open"] == {}, f"fds left open by the failed iter(): {got['left_open']}"
    assert got["children"] == [], "a worker outlived the failed iter()"
    assert got["batches"] == [[float(i) for i in range(k, k + 5)] for k in range(0, 20, 5)]


def _tasks_of(uid):
    """How many tasks (threads, zombies included) `uid` runs on the machine."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:   # gone meanwhile
                pass
    return count


def _epochs_with_no_thread_to_be_had(num_workers):
    loader, tasks = _loader_as_a_user_of_its_own(num_workers)
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    real_fork = os.fork

    def fork_at_the_limit():
        # room for this fork and not one task more: the worker starts at the limit
        # (its own copy of it), whatever its siblings do meanwhile
        resource.setrlimit(resource.RLIMIT_NPROC, (_tasks_of(os.getuid()) + 1, hard))
        return real_fork()

    os.fork = fork_at_the_limit   # this forked child's own os module
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks, hard))   # no thread either
    try:
        epochs, errors = [], []
        for _ in range(2):   # the second epoch forks again: the first's were reaped
            try:
                epochs.append([b.tolist() for (b,) in loader])
            except Exception as exc:   # noqa: BLE001 - reported to the test
                errors.append(f"{type(exc).__name__}: {exc}")
        children = [p.pid for p in psutil.Process().children()]
        threads = len(os.listdir("/proc/self/task"))
    finally:
        resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard))
        os.fork = real_fork
    assert reaper.wait_idle(30)
    return {"epochs": epochs, "errors": errors, "children": children,
            "threads": threads, "tasks": tasks}


@root_only
@pytest.mark.parametrize("num_workers", [1, 2])
def test_epochs_run_where_no_thread_can_be_started(num_workers):
    got = in_forked_child(lambda: _epochs_with_no_thread_to_be_had(num_workers))
    assert got["errors"] == [], got["errors"]
    expected = [[float(i) for i in range(k, k + 5)] for k in range(0, 20, 5)]
    assert got["epochs"] == [expected, expected]
    # each epoch's workers were reaped before iter() returned the last batch's
    # StopIteration: none left, and no thread was started on the way
    assert got["children"] == [], "workers left unreaped"
    assert got["threads"] == got["tasks"]


class _SleepsOnceTold(torch.utils.data.Dataset):
    """A worker that stays in the dataset's code (`sleep` set before iter())."""

    sleep = False
    report = False

    def __len__(self):
        return 20

    def __getitem__(self, index):
        if self.sleep:
            time.sleep(120)
        return index


def _report_and_forget_the_parent(fd):
    def init(worker_id):
        if _SleepsOnceTold.report:
            # The parent-death signal cleared (PR_SET_PDEATHSIG 0), as for a worker
            # whose parent is not the main process (forkserver): only the worker's
            # own watch is left to see the main process die.
            assert ctypes.CDLL(None, use_errno=True).prctl(1, 0, 0, 0, 0) == 0
            os.write(fd, f"{os.getpid()}\n".encode())
    return init


def _worker_gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE   # (our pid 1's to reap)
    except psutil.NoSuchProcess:
        return True


def _main_at_the_limit(reports, sleep_in_dataset):
    """Fork the main process of a loader with one worker, forked at the limit so
    that it has no room for its watchdog thread; the worker's pid and the main
    process's. With `sleep_in_dataset`, the worker stays in the dataset's code;
    otherwise it waits for tasks (the main process sleeps after its first batch)."""
    r, w = os.pipe()
    told_r, told_w = os.pipe()   # the test to the main process: lift the limit
    main = os.fork()
    if main == 0:
        code = 1
        try:
            os.close(r)
            os.close(told_w)
            # this process has served a channel's worker end itself (as the
            # suite's loopback tests do in their process, or a worker that runs a
            # loader of its own): a worker forked from it must still arm its own
            # watch (it inherited "armed" and ran with none: seen under
            # make test-asan, whose one process had run those tests)
            with loopback_channels("armed") as (served, _):
                prefix = served.handle()["prefix"]
            loader, tasks = _loader_as_a_user_of_its_own(
                1, _SleepsOnceTold(), worker_init_fn=_report_and_forget_the_parent(w))
            # a name under that prefix, the user's: the worker's cleanup after the
            # main process's death must not take it (its prefix is not inherited)
            bystander = f"/dev/shm/{prefix}-bystander"
            open(bystander, "w").close()
            os.write(w, f"{bystander}\n".encode())
            _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
            resource.setrlimit(resource.RLIMIT_NPROC, (tasks + 1, hard))   # the fork only
            _SleepsOnceTold.sleep = sleep_in_dataset
            _SleepsOnceTold.report = True
            # the worker's watch signal blocked here, as a user's process may have
            # it (a fork keeps the mask; seen in this suite's own process)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN + 3})
            it = iter(loader)
            next(it)
            if os.read(told_r, 1) == b"L":
                # (raising another process's soft limit to its hard one takes
                # the same user, not a capability)
                for child in psutil.Process().children():
                    resource.prlimit(child.pid, resource.RLIMIT_NPROC, (hard, hard))
            time.sleep(120)
            code = 0
        except BaseException:   # the test reports it
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    os.close(told_r)
    reports.append(main)
    reports.append(told_w)
    with os.fdopen(r) as pipe:
        ready, _, _ = select.select([pipe], [], [], 120)
        assert ready, "the worker did not start"
        bystander = pipe.readline().strip()
        if bystander:
            reports.append(bystander)
        line = pipe.readline()
    assert bystander and line, "the loader's process ended before its worker reported"
    reports.insert(2, int(line))
    # the case under test: the worker runs without its watchdog thread
    assert len(os.listdir(f"/proc/{int(line)}/task")) == 1


def _kill_and_wait_for(pids, deadline_s=20):
    main, _, worker, bystander = pids
    os.kill(main, signal.SIGKILL)
    os.waitpid(main, 0)
    deadline = time.monotonic() + deadline_s
    while not _worker_gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = _worker_gone(worker)
    assert os.path.exists(bystander), "the worker's cleanup took a name of its parent's prefix"
    return gone


def _clean_up(pids):
    if pids:
        try:
            os.kill(pids[0], signal.SIGKILL)
            os.waitpid(pids[0], 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    if len(pids) > 1:
        os.close(pids[1])
    if len(pids) > 2 and isinstance(pids[-1], str) and os.path.exists(pids[-1]):
        os.unlink(pids[-1])
    if len(pids) > 2 and isinstance(pids[2], int) and not _worker_gone(pids[2]):
        os.kill(pids[2], signal.SIGKILL)


@root_only
def test_a_worker_with_no_watchdog_thread_exits_when_the_main_process_dies():
    """A worker that could start no watchdog thread still sees the main process
    die while it runs the dataset's code, and exits, within a second or so."""
    pids = []
    try:
        _main_at_the_limit(pids, sleep_in_dataset=True)
        assert _kill_and_wait_for(pids), _outlived(pids[2])
    finally:
        _clean_up(pids)


def _outlived(pid):
    """What the test says of a worker that outlived the main process: its state,
    signal masks and where it waits."""
    seen = []
    for name in ("status", "wchan", "syscall"):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                text = f.read()
        except OSError as exc:
            text = str(exc)
        if name == "status":
            text = " ".join(line for line in text.splitlines()
                            if line.split(":")[0] in ("State", "Threads", "SigQ", "SigPnd",
                                                      "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
        seen.append(f"{name}: {text.strip()}")
    return "the worker outlived the main process: " + "; ".join(seen)


@root_only
def test_a_worker_starts_its_watchdog_thread_once_it_can():
    """The limit lifted, a waiting worker starts its watchdog thread (and stops
    its timer), which sees the main process die."""
    pids = []
    try:
        _main_at_the_limit(pids, sleep_in_dataset=False)
        worker = pids[2]
        time.sleep(1.5)   # its timer has fired and it has tried for a thread, in vain
        assert len(os.listdir(f"/proc/{worker}/task")) == 1
        os.write(pids[1], b"L")
        deadline = time.monotonic() + 20
        while len(os.listdir(f"/proc/{worker}/task")) == 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(os.listdir(f"/proc/{worker}/task")) == 2, "no watchdog thread started"
        assert _kill_and_wait_for(pids), _outlived(worker)
    finally:
        _clean_up(pids)


class _NoThreadToBeHad(threading.Thread):
    def start(self):
        raise RuntimeError("can't start new thread")   # as threading says it


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_start_where_no_thread_can_start_them(monkeypatch, method):
    """Under forkserver and spawn the pool starts the workers from threads, at
    once; where no thread can be started, it starts each such worker itself."""
    monkeypatch.setattr(pool, "threading", types.SimpleNamespace(
        Thread=_NoThreadToBeHad, RLock=threading.RLock))
    loader = fastloader.DataLoader(TensorDataset(torch.arange(20.0)), batch_size=5,
                                   num_workers=2, multiprocessing_context=method)
    assert [b.tolist() for (b,) in loader] == [
        [float(i) for i in range(k, k + 5)] for k in range(0, 20, 5)]


def test_no_fd_is_closed_where_the_fork_was_not_the_failure():
    """Only the frame of multiprocessing's fork start is looked at, and only
    before its fork returned: another error closes nothing."""
    r, w = os.pipe()
    try:
        try:
            raise OSError(errno.EAGAIN, "not from a fork")
        except OSError as exc:
            assert refused_fork.close_pipes_of_refused_fork(exc) == []
        os.fstat(r)
        os.fstat(w)
    finally:
        os.close(r)
        os.close(w)


def _fork_start_that_fails_after_the_fork():
    """multiprocessing's fork start with util.Finalize raising in the parent,
    after os.fork() returned: the pipes are then the Popen's, not leaked."""
    from multiprocessing import get_context, util
    proc = get_context("fork").Process(target=os._exit, args=(0,))
    real = util.Finalize

    def failing(*args, **kwargs):
        raise OSError(errno.EAGAIN, "raised after the fork")

    util.Finalize = failing
    try:
        proc.start()
    except OSError as exc:
        error = exc
    finally:
        util.Finalize = real
    frame = error.__traceback__
    while frame.tb_next is not None and frame.tb_frame.f_code.co_name != "_launch":
        frame = frame.tb_next
    local = frame.tb_frame.f_locals
    closed = refused_fork.close_pipes_of_refused_fork(error)
    still_open = []
    for name in ("parent_r", "parent_w"):
        os.fstat(local[name])   # raises if it was closed
        still_open.append(name)
        os.close(local[name])
    os.waitpid(local["self"].pid, 0)
    return closed, still_open


def test_no_fd_is_closed_once_the_fork_returned():
    closed, still_open = in_forked_child(_fork_start_that_fails_after_the_fork)
    assert closed == [] and still_open == ["parent_r", "parent_w"], (closed, still_open)
