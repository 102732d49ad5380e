"""torchrun with 2 ranks on gloo: fastloader with DistributedSampler gives each
rank a disjoint share covering the dataset, and training loses exactly what it
loses with torch's DataLoader."""
import json
import os
import subprocess
import sys

import pytest
import torch

import fastloader
from tests.helpers import clone_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(which, out_dir, start_method):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore::UserWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
           "-m", "tests.ddp_train", which, str(out_dir), start_method]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = []
    for r in range(2):
        with open(os.path.join(out_dir, f"{which}-{r}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_two_ranks_disjoint_cover_and_same_losses(tmp_path, start_method):
    fl = torchrun("fastloader", tmp_path, start_method)
    th = torchrun("torch", tmp_path, start_method)
    for epoch_batches in (slice(0, 6), slice(6, 12)):   # 96 / 2 ranks / batch 8 = 6
        ranks = [sorted(i for b in r["seen"][epoch_batches] for i in b) for r in fl]
        assert not set(ranks[0]) & set(ranks[1]), "ranks saw the same samples"
        assert sorted(ranks[0] + ranks[1]) == list(range(96)), "ranks do not cover the data"
    for r in range(2):
        assert fl[r]["seen"] == th[r]["seen"], f"rank {r}: different batches than torch"
        assert fl[r]["losses"] == th[r]["losses"], f"rank {r}: different losses than torch"


def test_shard_helper_splits_by_rank_and_worker():
    from tests.ddp_datasets_iterable import Stream

    seen = []
    for rank in range(2):
        loader = fastloader.DataLoader(Stream(50, rank, 2), batch_size=None, num_workers=2)
        seen.append([int(x) for x in loader])
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(50))


def test_worker_error_names_the_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    from tests.ddp_datasets_iterable import Exploding

    with pytest.raises(ValueError, match="rank 1 of 2"):
        for _ in fastloader.DataLoader(Exploding(), batch_size=2, num_workers=1):
            pass
