"""PyTorch Lightning checkpoints taken while training on the loader. Lightning saves
the state of a loader that has state_dict()/load_state_dict() (fastloader's) in
every checkpoint, and it and torch.load default to weights_only=True. Usage:
LOADER OUT. Trains one epoch (the default ModelCheckpoint saves at its end), then
loads that checkpoint three ways with Lightning's and torch's defaults, and saves
what each gave."""
import glob
import os

import torch
from torch.utils.data import TensorDataset

from tests.clients.client_common import parse_argv, save

DataLoader, OUT, _ = parse_argv()
ROOT = OUT + ".lightning"   # this run's checkpoints, apart from the other loader's

import lightning as L  # noqa: E402  (after the loader's import, as a user's script)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.steps = []

    def training_step(self, batch, index):
        self.steps.append((self.current_epoch, index, batch[0].tolist()))
        return self.lin(batch[0].float().unsqueeze(1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(16)), batch_size=4, shuffle=True,
                          num_workers=2)


def trainer(epochs):
    return L.Trainer(accelerator="cpu", max_epochs=epochs, logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=ROOT)


L.seed_everything(0)
trainer(1).fit(Model())
(ckpt,) = glob.glob(os.path.join(ROOT, "**", "*.ckpt"), recursive=True)
raw = torch.load(ckpt)   # torch's default: weights_only=True
Model.load_from_checkpoint(ckpt)
resumed = Model()
trainer(2).fit(resumed, ckpt_path=ckpt)
save(OUT, loader_state="combined_loader" in raw["loops"]["fit_loop"]["state_dict"],
     resumed_steps=resumed.steps)
