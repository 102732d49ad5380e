"""The LightningModules of lightning_client.py, in a module of their own: ddp_spawn's
ranks import it to unpickle the model, while the loader workers (spawned too, inside a
spawned rank) import only the client script, which imports no Lightning at its top."""
import lightning as L
import torch
from torch import nn

from tests.clients.client_common import clone_batch, loader_facts, save


class Regressor(L.LightningModule):
    """Trained on the loader given to trainer.fit(); records, per rank, the batches it
    trained on, its per-step losses and the loader Lightning really iterated."""

    def __init__(self, make_loader, out):
        super().__init__()
        self.make_loader, self.out = make_loader, out
        self.net = nn.Linear(8, 1)
        self.seen, self.losses = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.seen.append(clone_batch(batch))
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_train_end(self):
        save(f"{self.out}.rank{self.global_rank}", batches=self.seen, losses=self.losses,
             loader=loader_facts(self.trainer.train_dataloader),
             weights=[p.detach().clone() for p in self.parameters()])


class HookRegressor(Regressor):
    """Builds its loader in the hook, where Lightning records the constructor's
    arguments to rebuild it."""

    def train_dataloader(self):
        return self.make_loader()
