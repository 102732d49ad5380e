"""PyTorch Lightning: Trainer(accelerator="cpu") on one device and on two ddp_spawn
processes trains on torch's batches with torch's per-step losses, and the loader that
Lightning rebuilds for DDP is still fastloader's, with its kwargs."""
import pytest
import torch

from tests.clients.conftest import assert_fastloader_ran, run_both, run_client

pytest.importorskip("lightning", reason="lightning is not installed "
                    "(make test installs requirements-clients.txt)")


@pytest.mark.parametrize("devices,where", [(1, "hook"), (2, "hook"), (2, "fit")])
def test_trainer_trains_as_with_torch(out_dir, devices, where):
    ref, got = run_both("lightning_client.py", out_dir, devices, where)
    assert len(ref["losses"]) == devices
    # 64 samples, batch 8, 2 epochs: the ranks share them
    assert [len(r) for r in ref["losses"]] == [16 // devices] * devices
    for rank in range(devices):
        for a, b in zip(got["weights"][rank], ref["weights"][rank]):
            assert torch.equal(a, b), f"rank {rank}: final weights differ"
        facts = got["loaders"][rank]
        assert_fastloader_ran(facts, workers=2)
        assert facts["sharing_strategy"] == "file_system", facts
        expected = "DistributedSampler" if devices > 1 else "RandomSampler"
        assert facts["sampler"] == expected, facts
        assert ref["loaders"][rank]["sampler"] == expected
        # the other kwargs survived Lightning's rebuild too
        if where == "fit":
            assert facts["multiprocessing_context"] == "fork", facts
        assert facts["persistent_workers"] == (devices > 1 and where == "hook"), facts
    if devices > 1:
        assert ref["strategy"] == got["strategy"] == "DDPStrategy"
        # the two ranks saw different samples (the injected sampler shards)
        assert not torch.equal(ref["batches"][0][0][1], ref["batches"][1][0][1])


@pytest.mark.parametrize("resume_workers", [2, 1])
def test_a_mid_epoch_checkpoint_loads_with_the_defaults_and_resumes(out_dir, resume_workers):
    """Lightning stores fastloader's loader state in each checkpoint (torch's
    loader has none): the checkpoint must load with torch.load's and Lightning's
    defaults (weights_only=True), which refused the numpy RNG state the workers'
    snapshots held, and training must resume from it, also with another number
    of workers (which made fastloader's resume raise). fastloader's loader
    resumes mid-epoch, as Lightning does torchdata's StatefulDataLoader; torch's
    restarts the interrupted epoch (its fourth step draws a new first batch)."""
    ref = run_client("lightning_checkpoint_client.py", "torch", out_dir, resume_workers)
    got = run_client("lightning_checkpoint_client.py", "fastloader", out_dir, resume_workers)
    assert not ref["loader_state"] and got["loader_state"]
    for run in (ref, got):
        # 2 epochs of 16 samples, batch 4; resumed after the step-3 checkpoint
        assert [(e, i) for e, i, _ in run["full_steps"]] == [(e, i) for e in (0, 1) for i in range(4)]
        assert [(e, i) for e, i, _ in run["resumed_steps"]] == [(0, 3)] + [(1, i) for i in range(4)]
    assert got["full_steps"] == ref["full_steps"]
    # the interrupted epoch's last batch, exactly as the uninterrupted run had it
    assert got["resumed_steps"][0] == got["full_steps"][3]
    if resume_workers == 2:   # the same workers: the next epoch too
        assert got["resumed_steps"][1:] == got["full_steps"][4:]


@pytest.mark.parametrize("resume_batch_size", [4, 8])
def test_a_max_steps_checkpoint_at_an_epochs_last_batch_resumes_the_next_epoch(
        out_dir, resume_batch_size):
    """With `max_steps` Lightning loads the loader's state from every checkpoint.
    One taken once the epoch's last batch was trained, the loader not yet asked
    again, used to resume an empty epoch (Lightning's epoch count one ahead of the
    uninterrupted run's) and to refuse another batch size; it now resumes the next
    epoch, as torch's loader does, exactly as the uninterrupted run with the same
    batch size."""
    ref = run_client("lightning_max_steps_client.py", "torch", out_dir, resume_batch_size)
    got = run_client("lightning_max_steps_client.py", "fastloader", out_dir, resume_batch_size)
    for run in (ref, got):
        assert [(e, i) for e, i, _ in run["full_steps"]] == \
            [(0, i) for i in range(4)] + [(1, 0), (1, 1)]
        assert [(e, i) for e, i, _ in run["resumed_steps"]] == [(1, 0), (1, 1)]
    assert got["full_steps"] == ref["full_steps"]
    if resume_batch_size == 4:
        assert got["resumed_steps"] == got["full_steps"][4:]
    else:   # the same shuffle, in batches of 8
        samples = [s for _, _, batch in got["resumed_steps"] for s in batch]
        assert sorted(samples) == list(range(16))
        assert samples[:8] == [s for _, _, batch in got["full_steps"][4:] for s in batch]
