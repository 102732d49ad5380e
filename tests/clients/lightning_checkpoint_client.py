"""PyTorch Lightning checkpoints taken while training on the loader. Lightning saves
the state of a loader that has state_dict()/load_state_dict() (fastloader's) in
every checkpoint, and it and torch.load default to weights_only=True. Usage:
LOADER OUT RESUME_WORKERS. Trains two epochs of 4 batches with 2 workers, a
checkpoint every 3 steps; loads the one taken mid-epoch (step 3) with Lightning's
and torch's defaults, then trains on from it with RESUME_WORKERS workers, and
saves the steps of both runs."""
import os

import torch
from torch.utils.data import TensorDataset

from tests.clients.client_common import parse_argv, save

DataLoader, OUT, (RESUME_WORKERS,) = parse_argv()
ROOT = OUT + ".lightning"   # this run's checkpoints, apart from the other loader's

import lightning as L  # noqa: E402  (after the loader's import, as a user's script)
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402


class Model(L.LightningModule):
    def __init__(self, workers=2):
        super().__init__()
        self.workers = workers
        self.lin = torch.nn.Linear(1, 1)
        self.steps = []

    def training_step(self, batch, index):
        self.steps.append((self.current_epoch, index, batch[0].tolist()))
        return self.lin(batch[0].float().unsqueeze(1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(16)), batch_size=4, shuffle=True,
                          num_workers=self.workers)


def fit(model, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    every = ModelCheckpoint(dirpath=ROOT, every_n_train_steps=3, save_top_k=-1,
                            filename="{step}")
    L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=ROOT,
              callbacks=[every]).fit(model, ckpt_path=ckpt_path)
    return model.steps


full = fit(Model())
ckpt = os.path.join(ROOT, "step=3.ckpt")
raw = torch.load(ckpt)   # torch's default: weights_only=True
Model.load_from_checkpoint(ckpt)
resumed = fit(Model(int(RESUME_WORKERS)), ckpt)
save(OUT, loader_state="combined_loader" in raw["loops"]["fit_loop"]["state_dict"],
     full_steps=full, resumed_steps=resumed)
