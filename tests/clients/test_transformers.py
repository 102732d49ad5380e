"""HF transformers' Trainer with fastloader (issue 13, item 5): the Trainer builds
torch's DataLoader itself (and accelerate rebuilds it), so fastloader's workers run
there only through fastloader.install(). A tiny GPT-2 built from a config (nothing
downloaded) is trained with dataloader_num_workers=2 in fresh interpreters, with and
without install(); batches, losses and final weights must match bit for bit, and the
marker files show that fastloader's workers served every sample."""
import pytest

from tests.clients._dropin_harness import assert_workers_were, run_script
from tests.support.helpers import assert_same_batches

pytest.importorskip("transformers")

SCRIPT = "_transformers_script.py"
WORKERS, EPOCHS = 2, 2   # 8 steps over 6 batches per epoch: a second epoch starts


def test_trainer_with_install_uses_fastloader_workers_and_trains_identically(tmp_path):
    ref, ref_markers = run_script(SCRIPT, "torch", str(tmp_path))
    got, markers = run_script(SCRIPT, "fastloader", str(tmp_path))
    assert len(ref["batches"]) == 8 and len(ref["logged"]) == 8
    for key in ("batches", "losses", "weights", "logged"):
        assert_same_batches(got[key], ref[key], f"Trainer {key}", exact=(float,))
    assert_workers_were(ref_markers, "torch", {ref["main_pid"]}, WORKERS * EPOCHS)
    assert_workers_were(markers, "fast", {got["main_pid"]}, WORKERS * EPOCHS)
