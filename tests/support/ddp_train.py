"""Run by tests/distributed/test_distributed.py under `torchrun --nproc_per_node=2`: trains a
tiny model with DistributedDataParallel (gloo, CPU) for two epochs, with
fastloader's or torch's DataLoader, and writes each rank's sample ids and losses."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from tests.support.ddp_datasets import Regression


def main(which, out_dir, start_method):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if which == "fastloader":
        from fastloader import DataLoader
    else:
        from torch.utils.data import DataLoader
    ds = Regression(96)
    sampler = DistributedSampler(ds, shuffle=True, seed=11)
    loader = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2,
                        multiprocessing_context=start_method)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen, losses = [], []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()
            opt.step()
            seen.append(batch["i"].tolist())
            losses.append(loss.item())
    with open(os.path.join(out_dir, f"{which}-{rank}.json"), "w") as f:
        json.dump({"seen": seen, "losses": losses}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
