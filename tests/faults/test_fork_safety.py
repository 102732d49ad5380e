"""Forked workers start and compute although the parent had busy threads (torch's
intra-op pool, a user thread holding a lock) at the fork.

Every wait runs under `deadline` (SIGALRM) or a subprocess timeout, and
faulthandler_timeout (pyproject) dumps stacks if all else fails.
"""
import ast
import multiprocessing
import os
import subprocess
import sys
import threading

import pytest
import torch

from fastloader import DataLoader
from tests.support import datasets as ds
from tests.support.fault_helpers import QUIET_WORKER_COUNT_WARNING, STRATEGIES
from tests.support.helpers import assert_same_batch_lists, clone_batch, collect, deadline

pytestmark = [QUIET_WORKER_COUNT_WARNING]


def test_fork_while_other_threads_run():
    """torch's intra-op pool is warm and a user thread holds a lock most of the time:
    forked workers must still start, run matmuls, and finish."""
    a = torch.randn(256, 256)
    (a @ a).sum().item()  # start the intra-op pool
    stop = threading.Event()
    lock = threading.Lock()

    def busy():
        while not stop.is_set():
            with lock:
                (a @ a).sum()

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        expected = [clone_batch(b) for b in torch.utils.data.DataLoader(
            ds.MatmulDataset(), batch_size=4)]
        for strategy in STRATEGIES:
            loader = DataLoader(ds.MatmulDataset(), batch_size=4, num_workers=2,
                                multiprocessing_context="fork", sharing_strategy=strategy)
            assert_same_batch_lists(expected, collect(loader, seconds=60), strategy)
    finally:
        stop.set()
        thread.join()


def _use_inherited_channels(channels, conn):
    """In a child forked from the main process: try to drive the parent's channels
    (they are not this process's), then close them; report what each call did."""
    from fastloader import _core

    outcome = []
    for call in (lambda: channels[0].put_index(10_000, [0]),
                 lambda: _core.recv(channels, 0, 0.1)):
        try:
            call()
            outcome.append("done")
        except ValueError as exc:
            outcome.append(str(exc))
    for ch in channels:
        ch.close()   # must leave the parent's fds, ring and named segments alone
    conn.send(outcome)
    conn.close()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_process_forked_from_the_main_process_cannot_drive_its_loader(strategy):
    """The C core asks "am I the process that made this channel?" on every call. A
    process forked while an epoch runs must be refused (not send a task to the
    parent's worker, not take its results, not unlink its segments), and the
    parent's epoch goes on unchanged. The pid it compares with is kept in memory
    and refreshed at fork, so a stale one would let the child through."""
    import multiprocessing

    expected = [clone_batch(b) for b in torch.utils.data.DataLoader(
        ds.TensorLabelDataset(n=40), batch_size=4)]
    loader = DataLoader(ds.TensorLabelDataset(n=40), batch_size=4, num_workers=2,
                        multiprocessing_context="fork", sharing_strategy=strategy)
    with deadline(60):
        it = iter(loader)
        got = [clone_batch(next(it))]
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_use_inherited_channels, args=(it._channels, child))
        proc.start()
        child.close()
        assert parent.poll(30), "the child did not answer"
        outcome = parent.recv()
        proc.join(30)
        assert proc.exitcode == 0
        refusal = (f"fastloader: this DataLoader iterator's workers serve process "
                   f"{os.getpid()}, which this process was forked from")
        assert len(outcome) == 2 and all(o.startswith(refusal) for o in outcome), outcome
        got += [clone_batch(b) for b in it]
    assert_same_batch_lists(expected, got, strategy)


_FORK_THEN_EXIT = """
import os, sys, torch
from fastloader import DataLoader

loader = DataLoader(list(range(64)), batch_size=4, num_workers=2,
                    multiprocessing_context=sys.argv[1])
it = iter(loader)
got = [next(it).tolist()]
pid = os.fork()
if pid == 0:
    sys.exit(0)   # a normal interpreter exit: atexit hooks, multiprocessing's included
os.waitpid(pid, 0)
got += [b.tolist() for b in it]
assert got == [list(range(i, i + 4)) for i in range(0, 64, 4)], got
print("ok")
"""


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_a_forked_process_that_exits_leaves_the_loaders_workers_alone(ctx):
    """os.fork() while a loader is live, and the child exits normally: the loop
    goes on in the parent. The workers were multiprocessing's children too, so the
    child's exit hook sent them SIGTERM (the loop failed with WorkerError; torch's
    loader fails the same way)."""
    run = subprocess.run([sys.executable, "-c", _FORK_THEN_EXIT, ctx], capture_output=True,
                         text=True, timeout=180)
    assert (run.returncode, run.stdout.strip()) == (0, "ok"), run.stderr[-3000:]


_PERSISTENT_IN_A_FORKED_CHILD = """
import os, sys
from fastloader import DataLoader

loader = DataLoader(list(range(16)), batch_size=4, num_workers=2, persistent_workers=True,
                    multiprocessing_context="fork")
it = iter(loader)
first = next(it).tolist()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        next(it)
        said = "next() went through"
    except ValueError as error:
        said = str(error)
    try:   # an epoch of its own, on workers of its own
        said += "|" + repr([b.tolist() for b in loader])
    except BaseException as error:
        said += "|" + repr(error)
    os.write(w, said.encode())
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
said = os.read(r, 1 << 16).decode()
rest = [b.tolist() for b in it]
print(repr([said, first, rest, [b.tolist() for b in loader]]))
"""


def test_a_forked_child_iterates_a_persistent_loader_on_workers_of_its_own():
    """A persistent loader's iter() in a process forked from the main process: it
    reused the parent's iterator, whose channels the child may not use (ValueError:
    channel is closed). It now starts workers of its own; next() on the parent's
    iterator says why it cannot; the parent's epochs go on unchanged."""
    run = subprocess.run([sys.executable, "-c", _PERSISTENT_IN_A_FORKED_CHILD],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    said, first, rest, again = ast.literal_eval(run.stdout.strip())
    refused, child_epoch = said.split("|")
    assert "a forked child cannot take their batches" in refused, refused
    batches = [list(range(i, i + 4)) for i in range(0, 16, 4)]
    assert child_epoch == repr(batches)
    assert [first] + rest == batches and again == batches


def test_multiprocessing_active_children_does_not_reap_the_workers():
    """The pool reaps its workers: multiprocessing.active_children() does not list
    them (so it cannot reap one and take its exit status from the pool)."""
    loader = DataLoader(list(range(16)), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    with deadline(60):
        it = iter(loader)
        pids = set(it.worker_pids)
        assert not pids & {p.pid for p in multiprocessing.active_children()}
        assert len(list(it)) == 4
