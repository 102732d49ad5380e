"""PyTorch Lightning with `max_steps`: it saves the loader's state in every
checkpoint and loads it from every one, also from a checkpoint taken when the
epoch's last batch was trained but the loader had not yet been asked for another
(so it has not ended). Usage: LOADER OUT RESUME_BATCH_SIZE. Trains 4 steps (one
epoch of 16 samples in batches of 4), a checkpoint at step 4; resumes from it to
step 6 with RESUME_BATCH_SIZE; and trains 6 steps uninterrupted. Saves the steps
of both runs."""
import os

import torch
from torch.utils.data import TensorDataset

from tests.clients.client_common import parse_argv, save

DataLoader, OUT, (RESUME_BATCH_SIZE,) = parse_argv()
ROOT = OUT + ".lightning"   # this run's checkpoints, apart from the other loader's

import lightning as L  # noqa: E402  (after the loader's import, as a user's script)
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402


class Model(L.LightningModule):
    def __init__(self, batch_size=4):
        super().__init__()
        self.batch_size = batch_size
        self.lin = torch.nn.Linear(1, 1)
        self.steps = []

    def training_step(self, batch, index):
        self.steps.append((self.current_epoch, index, batch[0].tolist()))
        return self.lin(batch[0].float().unsqueeze(1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(16)), batch_size=self.batch_size,
                          shuffle=True, num_workers=2)


def fit(model, max_steps, root, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    every = ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_top_k=-1,
                            filename="{step}")
    L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=root,
              callbacks=[every]).fit(model, ckpt_path=ckpt_path)
    return model.steps


full = fit(Model(), 6, ROOT + ".full")
fit(Model(), 4, ROOT)
resumed = fit(Model(int(RESUME_BATCH_SIZE)), 6, ROOT, os.path.join(ROOT, "step=4.ckpt"))
save(OUT, full_steps=full, resumed_steps=resumed)
