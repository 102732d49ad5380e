"""PyTorch Lightning checkpoints taken while training on the loader. Lightning saves
the state of a loader that has state_dict()/load_state_dict() (fastloader's) in
every checkpoint, and it and torch.load default to weights_only=True. Usage:
LOADER OUT RESUME_WORKERS. Trains two epochs of 4 batches with 2 workers, a
checkpoint every 3 steps; loads the one taken mid-epoch (step 3) with Lightning's
and torch's defaults, then trains on from it with RESUME_WORKERS workers, and
saves the steps of both runs."""
import os

import torch

from tests.clients.client_common import parse_argv, save

DataLoader, OUT, (RESUME_WORKERS,) = parse_argv()
ROOT = OUT + ".lightning"   # this run's checkpoints, apart from the other loader's

import lightning as L  # noqa: E402  (after the loader's import, as a user's script)
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from tests.clients.lightning_steps import StepRecorder  # noqa: E402


StepRecorder.loader_class = DataLoader


def fit(model, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    every = ModelCheckpoint(dirpath=ROOT, every_n_train_steps=3, save_top_k=-1,
                            filename="{step}")
    L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=ROOT,
              callbacks=[every]).fit(model, ckpt_path=ckpt_path)
    return model.steps


full = fit(StepRecorder())
ckpt = os.path.join(ROOT, "step=3.ckpt")
raw = torch.load(ckpt)   # torch's default: weights_only=True
StepRecorder.load_from_checkpoint(ckpt)
resumed = fit(StepRecorder(int(RESUME_WORKERS)), ckpt)
save(OUT, loader_state="combined_loader" in raw["loops"]["fit_loop"]["state_dict"],
     full_steps=full, resumed_steps=resumed)
