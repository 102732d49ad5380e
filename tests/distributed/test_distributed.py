"""torchrun with 2 ranks on gloo: fastloader with DistributedSampler gives each
rank a disjoint share covering the dataset, and training loses exactly what it
loses with torch's DataLoader."""
import json
import os
import subprocess
import sys

import pytest

import fastloader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun(module, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore::UserWarning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
           "-m", module, *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def results(out_dir, name):
    out = []
    for r in range(2):
        with open(os.path.join(out_dir, f"{name}-{r}.json")) as f:
            out.append(json.load(f))
    return out


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_two_ranks_disjoint_cover_and_same_losses(tmp_path, start_method):
    torchrun("tests.support.ddp_train", "fastloader", tmp_path, start_method)
    torchrun("tests.support.ddp_train", "torch", tmp_path, start_method)
    fl, th = results(tmp_path, "fastloader"), results(tmp_path, "torch")
    for epoch_batches in (slice(0, 6), slice(6, 12)):   # 96 / 2 ranks / batch 8 = 6
        ranks = [sorted(i for b in r["seen"][epoch_batches] for i in b) for r in fl]
        assert not set(ranks[0]) & set(ranks[1]), "ranks saw the same samples"
        assert sorted(ranks[0] + ranks[1]) == list(range(96)), "ranks do not cover the data"
    for r in range(2):
        assert fl[r]["seen"] == th[r]["seen"], f"rank {r}: different batches than torch"
        assert fl[r]["losses"] == th[r]["losses"], f"rank {r}: different losses than torch"


def test_shard_helper_splits_by_rank_and_worker():
    from tests.support.ddp_datasets_iterable import Stream

    seen = []
    for rank in range(2):
        loader = fastloader.DataLoader(Stream(50, rank, 2), batch_size=None, num_workers=2)
        seen.append([int(x) for x in loader])
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(50))


def test_worker_error_names_the_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    from tests.support.ddp_datasets_iterable import Exploding

    with pytest.raises(ValueError, match="rank 1 of 2"):
        for _ in fastloader.DataLoader(Exploding(), batch_size=2, num_workers=1):
            pass


def test_node_holds_one_copy_of_shared_metadata(tmp_path):
    """2 ranks on one node: with share_on_node the array's pages are counted once
    across the node (the ranks' PSS of the mapping adds up to one copy); built by
    each rank, to two."""
    torchrun("tests.support.ddp_share", "shared", tmp_path)
    torchrun("tests.support.ddp_share", "per_rank", tmp_path)
    shared, per_rank = results(tmp_path, "shared"), results(tmp_path, "per_rank")
    copy_kib = shared[0]["nbytes"] / 1024
    shared_total = sum(r["pss_kib"] for r in shared)
    per_rank_total = sum(r["pss_kib"] for r in per_rank)
    assert shared_total <= 1.1 * copy_kib, (shared_total, copy_kib)
    assert per_rank_total >= 1.8 * copy_kib, (per_rank_total, copy_kib)
