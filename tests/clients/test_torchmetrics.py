"""torchmetrics: epoch-wide metrics (BinaryAUROC, BinaryAveragePrecision) keep every
batch's scores and targets until compute(); with fastloader they must hold what they
hold with torch, not every batch's ring slot (before the decoder copied a big batch's
small tensors out of the slot: 60 MiB for 40 batches of 1.5 MiB, torch 0.3 MiB)."""
import torch

from tests.clients.conftest import assert_fastloader_ran, run_both


def test_metrics_that_keep_every_batchs_targets_hold_no_batch(out_dir):
    ref, got = run_both("torchmetrics_client.py", out_dir)
    assert_fastloader_ran(got["loader"], workers=2)
    for key in ("auroc", "ap"):
        assert torch.equal(got[key], ref[key]), (key, got[key], ref[key])
    assert got["kept_bytes"] == ref["kept_bytes"]
    assert ref["held"] > 0, "torch's kept tensors map no shared memory: nothing measured"
    assert got["held"] <= ref["held"] + (1 << 20), (
        f"fastloader's kept metric states hold {got['held'] / 2**20:.1f} MiB of shared "
        f"memory, torch's {ref['held'] / 2**20:.1f} MiB")
