"""HF accelerate client: ``python _accelerate_script.py MODE OUT SCENARIO``.

SCENARIO: ``prepare`` (one process: Accelerator(cpu=True).prepare), ``skip`` (one
process: the loader not prepared, given to skip_first_batches(), as the HF Trainer
does on resuming when get_train_dataloader() was overridden) or ``launcher``
(notebook_launcher with 2 CPU processes, gloo). MODE: ``torch`` (torch's DataLoader,
the reference), ``fastloader`` (fastloader.install(), then fastloader's DataLoader),
``install-torch-loader`` (fastloader.install(), torch's DataLoader: what a framework
builds) or ``fastloader-no-install`` (fastloader's DataLoader, no install()).
Trains a linear model 2 epochs and saves every batch and loss."""
import os
import sys
import warnings

import torch

from tests.clients._dropin_common import (Regression, dump_stacks_on_sigusr1, loader_class,
                                          setup_determinism)

EPOCHS = 2
SKIPPED = 3   # batches, in the skip scenario


def train(mode, out, scenario="prepare"):
    from accelerate import Accelerator, skip_first_batches
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    setup_determinism(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    DataLoader = loader_class("torch" if mode in ("torch", "install-torch-loader")
                              else "fastloader")
    loader = DataLoader(Regression(96, os.path.join(out, "markers")), batch_size=8,
                        shuffle=True, num_workers=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if scenario == "skip":
            model, opt = accelerator.prepare(model, opt)
            prepared = skip_first_batches(loader, SKIPPED)
        else:
            model, opt, prepared = accelerator.prepare(model, opt, loader)
    batches, losses = [], []
    for _ in range(EPOCHS):
        for batch in prepared:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            batches.append({k: v.clone() for k, v in batch.items()})
            losses.append(loss.detach().clone())
    import fastloader as fl

    result = {
        "batches": batches, "losses": losses,
        "weights": [p.detach().clone() for p in model.parameters()],
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught
                     if issubclass(w.category, fl.FastLoaderWarning)],
        "prepared_base": type(getattr(prepared, "base_dataloader", prepared)).__qualname__,
        "rank": accelerator.process_index, "world": accelerator.num_processes,
        "pid": os.getpid(),
    }
    torch.save(result, os.path.join(out, f"rank{accelerator.process_index}.pt"))


def main():
    mode, out, scenario = sys.argv[1:4]
    dump_stacks_on_sigusr1()
    if mode in ("fastloader", "install-torch-loader"):
        import fastloader

        fastloader.install()   # forked ranks inherit it
    if scenario in ("prepare", "skip"):
        train(mode, out, scenario)
        ranks = [torch.load(os.path.join(out, "rank0.pt"), weights_only=False)]
    else:
        from accelerate import notebook_launcher

        from tests.support.ports import unclaimed_port

        # not the default 29500: another job on the box (a second test run) may hold
        # that one ("EADDRINUSE")
        notebook_launcher(train, args=(mode, out), num_processes=2,
                          use_port=str(unclaimed_port()))
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False)
                 for r in range(2)]
    torch.save({"ranks": ranks, "main_pid": os.getpid()}, os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main()
