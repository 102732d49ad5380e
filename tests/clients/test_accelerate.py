"""HF accelerate with fastloader (issue 13, item 5): Accelerator.prepare() rebuilds
every loader as its own torch DataLoader, so fastloader's workers run there only
through fastloader.install(). Each case runs _accelerate_script.py in fresh
interpreters with torch's DataLoader and with fastloader, and compares every batch,
loss and final weight bit for bit; marker files left by the processes that served
samples show whose workers ran."""
import pytest

from tests.clients._dropin_harness import assert_workers_were, run_script
from tests.support.helpers import assert_same_batches

pytest.importorskip("accelerate")

SCRIPT = "_accelerate_script.py"
WORKERS, EPOCHS = 2, 2


def assert_same_training(ref, got, what):
    assert len(ref["ranks"]) == len(got["ranks"])
    for r, (a, b) in enumerate(zip(ref["ranks"], got["ranks"])):
        assert a["batches"], f"{what}: rank {r} trained on nothing"
        for key in ("batches", "losses", "weights"):
            assert_same_batches(b[key], a[key], f"{what} rank {r} {key}")


@pytest.fixture(scope="module")
def reference_prepare(tmp_path_factory):
    return run_script(SCRIPT, "torch", str(tmp_path_factory.mktemp("acc")), "prepare")


@pytest.mark.parametrize("mode", ["fastloader", "install-torch-loader"])
def test_prepare_with_install_runs_fastloader_workers_and_trains_identically(
        reference_prepare, mode, tmp_path):
    (ref, ref_markers) = reference_prepare
    got, markers = run_script(SCRIPT, mode, str(tmp_path), "prepare")
    assert_same_training(ref, got, f"prepare/{mode}")
    rank = got["ranks"][0]
    assert rank["prepared_base"] == "DataLoader" and rank["warnings"] == []
    # one fresh pair of workers per epoch (not persistent), children of the script
    assert_workers_were(ref_markers, "torch", {ref["main_pid"]}, WORKERS * EPOCHS)
    assert_workers_were(markers, "fast", {got["main_pid"]}, WORKERS * EPOCHS)


def test_prepare_without_install_warns_that_fastloader_was_replaced(reference_prepare,
                                                                   tmp_path):
    (ref, _) = reference_prepare
    got, markers = run_script(SCRIPT, "fastloader-no-install", str(tmp_path), "prepare")
    assert_same_training(ref, got, "prepare/no-install")
    (warning,) = got["ranks"][0]["warnings"]
    assert warning.startswith("FastLoaderWarning") and "accelerate" in warning
    assert "fastloader.install()" in warning
    assert_workers_were(markers, "torch", {got["main_pid"]}, WORKERS * EPOCHS)


@pytest.fixture(scope="module")
def reference_skip(tmp_path_factory):
    return run_script(SCRIPT, "torch", str(tmp_path_factory.mktemp("acc")), "skip")


def test_skip_first_batches_without_install_warns_that_fastloader_was_replaced(
        reference_skip, tmp_path):
    """skip_first_batches() of a loader not prepared (the HF Trainer's, resuming,
    when get_train_dataloader() is overridden) rebuilds it as a plain torch
    DataLoader: torch's workers served the epoch and nothing said so."""
    (ref, _) = reference_skip
    got, markers = run_script(SCRIPT, "fastloader-no-install", str(tmp_path), "skip")
    assert_same_training(ref, got, "skip/no-install")
    assert len(got["ranks"][0]["batches"]) == EPOCHS * (96 // 8 - 3)
    (warning,) = got["ranks"][0]["warnings"]
    assert warning.startswith("FastLoaderWarning") and "skip_first_batches()" in warning
    assert "fastloader.install()" in warning
    assert_workers_were(markers, "torch", {got["main_pid"]}, WORKERS * EPOCHS)


def test_skip_first_batches_with_install_runs_fastloader_workers(reference_skip, tmp_path):
    (ref, _) = reference_skip
    got, markers = run_script(SCRIPT, "fastloader", str(tmp_path), "skip")
    assert_same_training(ref, got, "skip/install")
    assert got["ranks"][0]["warnings"] == []
    assert_workers_were(markers, "fast", {got["main_pid"]}, WORKERS * EPOCHS)


def test_notebook_launcher_two_cpu_processes(tmp_path):
    ref, ref_markers = run_script(SCRIPT, "torch", str(tmp_path), "launcher")
    got, markers = run_script(SCRIPT, "fastloader", str(tmp_path), "launcher")
    assert [r["world"] for r in got["ranks"]] == [2, 2]
    assert_same_training(ref, got, "notebook_launcher")
    # the two ranks saw different shards
    assert_same_batches(got["ranks"][0]["batches"][0], ref["ranks"][0]["batches"][0])
    with pytest.raises(AssertionError):
        assert_same_batches(got["ranks"][0]["batches"][0], got["ranks"][1]["batches"][0])
    for run, kind, mk in ((ref, "torch", ref_markers), (got, "fast", markers)):
        assert_workers_were(mk, kind, {r["pid"] for r in run["ranks"]}, WORKERS * EPOCHS)
        assert run["main_pid"] not in {r["pid"] for r in run["ranks"]}
