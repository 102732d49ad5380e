"""The client suite's one helper: run a client script in a fresh interpreter, once with
torch's DataLoader and once with fastloader's, and compare what the two computed.

A client script (``*_client.py`` here) is a small training or loading program written
against a third-party library. It is run as ``python SCRIPT LOADER OUT [ARGS...]``,
where LOADER is ``torch`` or ``fastloader`` (the one import line that changes), and
writes its observations with ``torch.save`` to OUT: at least ``batches`` (and
``losses`` where it trains), plus ``loader`` facts (class, kwargs, fastloader's
``stats()``) that prove which transport really ran.
"""
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.support.helpers import assert_same_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
LOADERS = ("torch", "fastloader")


def run_client(script, loader, out_dir, *args, env=None, timeout=600, python=None):
    """Run tests/clients/SCRIPT under LOADER in a fresh `python` (default: this one) and
    return what it saved. A failing script fails the test with its output."""
    out = os.path.join(out_dir, f"{os.path.splitext(script)[0]}-{loader}.pt")
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in sys.path if p])
    child_env.pop("PYTHONWARNINGS", None)
    child_env.update(env or {})
    cmd = [python or sys.executable, os.path.join(HERE, script), loader, out,
           *map(str, args)]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          cwd=out_dir, env=child_env, stdin=subprocess.DEVNULL)
    took = time.monotonic() - started
    assert done.returncode == 0, (f"{' '.join(cmd)} exited {done.returncode} after "
                                  f"{took:.1f} s\n--- stdout\n{done.stdout[-6000:]}"
                                  f"\n--- stderr\n{done.stderr[-6000:]}")
    return torch.load(out, weights_only=False)


def run_both(script, out_dir, *args, **kwargs):
    """(torch's result, fastloader's result), their ``batches`` and ``losses``
    already compared bit for bit."""
    ref = run_client(script, "torch", out_dir, *args, **kwargs)
    got = run_client(script, "fastloader", out_dir, *args, **kwargs)
    assert_same_runs(ref, got, f"{script} {' '.join(map(str, args))}")
    return ref, got


def assert_same_runs(ref, got, what):
    """fastloader's run computed what torch's did: same batches, same losses."""
    for key in ("batches", "losses"):
        assert (key in ref) == (key in got), f"{what}: only one run recorded {key}"
        if key in ref:
            assert_same_batches(got[key], ref[key], f"{what} {key}")
    assert ref["batches"], f"{what}: the torch run yielded no batch"


def assert_fastloader_ran(facts, workers):
    """`facts` from a client's fastloader run: the loader that ran was fastloader's and
    its workers (not the main process) delivered the batches through the ring."""
    assert facts["class"] == "fastloader.dataloader.DataLoader", facts["class"]
    stats = facts["stats"]
    assert stats is not None, "fastloader's loader has no stats: its workers never ran"
    assert stats["batches"] > 0 and stats["batches"] == sum(stats["batches_per_worker"])
    pids = [w["pid"] for w in stats["workers"]]
    assert len(pids) == workers and facts["main_pid"] not in pids, (pids, facts["main_pid"])
    assert all(w["published"] > 0 for w in stats["workers"]), stats["workers"]


@pytest.fixture
def out_dir(tmp_path):
    return str(tmp_path)
