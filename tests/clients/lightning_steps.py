"""The LightningModule of the checkpoint clients (lightning_checkpoint_client.py,
lightning_max_steps_client.py): it records each training step's (epoch, index,
samples) and trains on 16 shuffled samples from the client's loader class."""
import lightning as L
import torch
from torch.utils.data import TensorDataset


class StepRecorder(L.LightningModule):
    loader_class = None   # the client's DataLoader (torch's or fastloader's)

    def __init__(self, workers=2, batch_size=4):
        super().__init__()
        self.workers, self.batch_size = workers, batch_size
        self.lin = torch.nn.Linear(1, 1)
        self.steps = []

    def training_step(self, batch, index):
        self.steps.append((self.current_epoch, index, batch[0].tolist()))
        return self.lin(batch[0].float().unsqueeze(1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return self.loader_class(TensorDataset(torch.arange(16)), batch_size=self.batch_size,
                                 shuffle=True, num_workers=self.workers)
