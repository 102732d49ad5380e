"""PyTorch Lightning: a LightningModule trained by `Trainer(accelerator="cpu")` on one
device, or on two processes (strategy="ddp_spawn", gloo), where Lightning rebuilds the
loader to inject a DistributedSampler. Usage: LOADER OUT DEVICES WHERE, WHERE being

* "hook": the loader is built in `train_dataloader()`, whose arguments Lightning
  records; with 2 devices its workers are persistent and start as the rank did (spawn:
  a ddp_spawn rank's default start method);
* "fit": the loader (multiprocessing_context="fork") is passed to `trainer.fit()`, and
  Lightning rebuilds it from its attributes.

The main process gathers each rank's record (lightning_module.Regressor) into OUT."""
import functools
import os
import sys

import torch
from torch.utils.data import Dataset

from tests.clients.client_common import parse_argv, save

SAMPLES = 64


class NoisyRegression(Dataset):
    """Fixed inputs plus noise drawn in the worker: a different worker seeding would
    give different batches."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(8), self.y[i]


def make_loader(loader_name, **kwargs):
    if loader_name == "fastloader":
        from fastloader import DataLoader
        # not the default, so that a rebuild that drops it shows
        kwargs["sharing_strategy"] = "file_system"
    else:
        from torch.utils.data import DataLoader
    return DataLoader(NoisyRegression(), batch_size=8, shuffle=True, num_workers=2, **kwargs)


def main():
    _, out, (devices, where) = parse_argv()
    devices, loader_name = int(devices), sys.argv[1]
    import lightning as L

    from tests.clients.lightning_module import HookRegressor, Regressor

    # Lightning's own worker seeding (worker_init_fn) where the workers fork: spawned
    # workers would import all of Lightning to unpickle it, 15 s each on a busy box
    L.seed_everything(42, workers=(where == "fit" or devices == 1), verbose=False)
    if where == "hook":
        extra = {"persistent_workers": True} if devices > 1 else {}
        model = HookRegressor(functools.partial(make_loader, loader_name, **extra), out)
        loaders = None
    else:
        model = Regressor(None, out)
        loaders = make_loader(loader_name, multiprocessing_context="fork")
    trainer = L.Trainer(accelerator="cpu", devices=devices,
                        strategy="ddp_spawn" if devices > 1 else "auto", max_epochs=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True,
                        default_root_dir=os.path.dirname(out))
    trainer.fit(model, train_dataloaders=loaders)
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(devices)]
    save(out, batches=[r["batches"] for r in ranks], losses=[r["losses"] for r in ranks],
         loaders=[r["loader"] for r in ranks], weights=[r["weights"] for r in ranks],
         strategy=type(trainer.strategy).__name__)


if __name__ == "__main__":
    main()
