"""Runs the accelerate / transformers client scripts in fresh interpreters:
``python SCRIPT MODE OUT`` where MODE picks the loader and whether
fastloader.install() is called, and OUT is a directory for the script's
``result.pt`` and its workers' marker files (see _dropin_common.py)."""
import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import torch

from tests.clients._dropin_common import read_markers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


def run_script(script, mode, out_dir, *args, timeout=300):
    """Run SCRIPT in MODE; return (its saved observations, its marker list).

    A run that outlives `timeout` (50x its usual time on this box) fails the test
    with every process's Python stacks. Only the reference, MODE ``torch``, is run
    once more after a hang: that run is torch's own DataLoader under the client
    library, which fastloader cannot fix (CI saw one 2-rank gloo run of
    accelerate's notebook_launcher hang once in ~30 runs), while a hang with
    fastloader must fail."""
    attempts = 2 if mode == "torch" else 1
    for attempt in range(1, attempts + 1):
        out = os.path.join(out_dir, f"{os.path.splitext(script)[0]}-{mode}"
                                    + ("" if attempt == 1 else f"-{attempt}"))
        os.makedirs(os.path.join(out, "markers"))
        cmd = [sys.executable, os.path.join(HERE, script), mode, out, *map(str, args)]
        started = time.monotonic()
        returncode, stdout, stderr, hung = _run(cmd, out, timeout)
        report = (f"{' '.join(cmd)} {'hung' if hung else 'exited'} "
                  f"{'' if hung else returncode} after "
                  f"{time.monotonic() - started:.1f} s\n--- stdout\n{stdout[-6000:]}\n"
                  f"--- stderr (after a hang: each process's stacks)\n{stderr[-20000:]}")
        if not hung:
            break
        if attempt < attempts:
            # (printed, not warned: this suite turns warnings into errors)
            print(f"the reference run hung; running it again. {report}", file=sys.stderr)
    assert not hung and returncode == 0, report
    result = torch.load(os.path.join(out, "result.pt"), weights_only=False)
    return result, read_markers(os.path.join(out, "markers"))


def _run(cmd, cwd, timeout):
    """(returncode, stdout, stderr, hung). The script, its ranks and their workers
    run in a session of their own, so that a hang leaves no process behind: each
    one is asked for its stacks (SIGUSR1, see dump_stacks_on_sigusr1), then all are
    killed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in sys.path if p])
    env.pop("PYTHONWARNINGS", None)
    env.pop("FASTLOADER_INSTALL", None)
    # nothing is downloaded: models are built from configs
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               HF_HOME=os.path.join(os.path.dirname(cwd), "hf_home"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, cwd=cwd, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr, False
    except subprocess.TimeoutExpired:
        tree = _tree(proc.pid)
        _ask_for_stacks(tree)
        # the group, and the processes that left it (a launcher may start its
        # ranks in sessions of their own)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        # SIGKILL is only delivered: a process that left the group can still be
        # tearing down (its pipes already closed) when communicate() returns
        _wait_until_dead(tree, deadline=time.monotonic() + 60)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:   # a process we could not see holds the pipes
            proc.kill()
            stdout, stderr = "", "(no output: a process outside the tree holds the pipes)"
        return proc.returncode, stdout, stderr, True


def _wait_until_dead(tree, deadline):
    """Until every process in `tree` has exited (a zombie has: only its parent's
    wait is left) or the deadline passes."""
    for p in tree:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)


def _tree(pid):
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _ask_for_stacks(tree):
    """Each process that has a SIGUSR1 handler (the others would die of it), one at
    a time, so that their stacks do not interleave on stderr."""
    for p in tree:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                caught = next(int(line.split()[1], 16) for line in f
                              if line.startswith("SigCgt:"))
            if caught & (1 << (signal.SIGUSR1 - 1)):
                p.send_signal(signal.SIGUSR1)
                time.sleep(0.5)
        except (OSError, StopIteration, psutil.NoSuchProcess):
            continue


def assert_workers_were(markers, kind, parents, per_parent):
    """Every sample was served by `per_parent` worker processes of each parent pid in
    `parents`, all of `kind` ('fast': fastloader's pool, 'torch': torch's)."""
    assert markers, "no process served a sample"
    assert {m[3] for m in markers} == {kind}, markers
    assert all(m[2] != "main" for m in markers), f"served in the main process: {markers}"
    by_parent = {}
    for pid, ppid, _wid, _kind in markers:
        by_parent.setdefault(ppid, set()).add(pid)
    assert set(by_parent) == set(parents), (by_parent, parents)
    assert all(len(p) == per_parent for p in by_parent.values()), by_parent
