"""Runs the accelerate / transformers client scripts in fresh interpreters:
``python SCRIPT MODE OUT`` where MODE picks the loader and whether
fastloader.install() is called, and OUT is a directory for the script's
``result.pt`` and its workers' marker files (see _dropin_common.py)."""
import os
import subprocess
import sys
import time

import torch

from tests.clients._dropin_common import read_markers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


def run_script(script, mode, out_dir, *args, timeout=900):
    """Run SCRIPT in MODE; return (its saved observations, its marker list)."""
    out = os.path.join(out_dir, f"{os.path.splitext(script)[0]}-{mode}")
    os.makedirs(os.path.join(out, "markers"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in sys.path if p])
    env.pop("PYTHONWARNINGS", None)
    env.pop("FASTLOADER_INSTALL", None)
    # nothing is downloaded: models are built from configs
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               HF_HOME=os.path.join(out_dir, "hf_home"))
    cmd = [sys.executable, os.path.join(HERE, script), mode, out, *map(str, args)]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=out,
                          env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, (f"{' '.join(cmd)} exited {done.returncode} after "
                                  f"{time.monotonic() - started:.1f} s\n--- stdout\n"
                                  f"{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}")
    result = torch.load(os.path.join(out, "result.pt"), weights_only=False)
    return result, read_markers(os.path.join(out, "markers"))


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
