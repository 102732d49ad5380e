"""One rank of the two-host job of tests/distributed/test_multinode_hosts.py, started by
`torchrun --nnodes=2 --nproc_per_node=2` in each host's namespaces:

    python -m tests.support.multinode_train MODE OUT_DIR

Every rank first gets the dataset's packed name index through share_on_node
(one build per host), then trains a tiny DDP model (gloo) for EPOCHS epochs.
MODE "reference": with torch's DataLoader, then again from the same start with
fastloader's. MODE "elastic": fastloader's only, checkpointing model, optimizer
and loader.state_dict() after every step; in the first attempt rank KILL_RANK
SIGKILLs itself after step KILL_AFTER (mid-epoch) and torchrun restarts the
group; the new ranks resume from their checkpoints. Each rank appends what it
saw to OUT_DIR/<mode>-<rank>.jsonl, one line per step."""
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DistributedSampler

from fastloader import PackedStringArray
from fastloader.distributed import node_key, share_on_node

N = 64            # samples: 4 ranks x batch 4 -> 4 steps per epoch
BATCH = 4
EPOCHS = 2
KILL_RANK, KILL_AFTER = 3, 5   # after 5 steps: one batch into epoch 1
BUILT = []


def build_index():
    BUILT.append(os.getpid())
    return PackedStringArray(f"shard-{i % 7}/sample_{i:05d}.bin" for i in range(N))


class Samples(Dataset):
    """Regression samples named by the shared index (the workers read it)."""

    def __init__(self, names):
        g = torch.Generator().manual_seed(3)
        self.names = names
        self.x = torch.randn(N, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        return {"i": int(self.names[i][-9:-4]), "x": self.x[i], "y": self.y[i]}


def make(loader_cls, ds, rank):
    torch.manual_seed(0)
    sampler = DistributedSampler(ds, shuffle=True, seed=11)
    loader = loader_cls(ds, batch_size=BATCH, sampler=sampler, num_workers=2,
                        multiprocessing_context="fork")
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return sampler, loader, model, opt


def step(model, opt, batch):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    opt.step()
    return loss.item()


def record(out, **fields):
    out.write(json.dumps(fields) + "\n")
    out.flush()


def reference(ds, rank, out):
    from fastloader import DataLoader as FastDataLoader
    from torch.utils.data import DataLoader as TorchDataLoader

    for name, cls in (("torch", TorchDataLoader), ("fastloader", FastDataLoader)):
        sampler, loader, model, opt = make(cls, ds, rank)
        n = 0
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for batch in loader:
                loss = step(model, opt, batch)
                record(out, loader=name, step=n, epoch=epoch, seen=batch["i"].tolist(), loss=loss)
                n += 1


def elastic(ds, rank, out, out_dir):
    from fastloader import DataLoader

    sampler, loader, model, opt = make(DataLoader, ds, rank)
    ckpt_path = os.path.join(out_dir, f"ckpt-{rank}.pt")
    n, first_epoch, resumed = 0, 0, False
    if os.path.exists(ckpt_path):   # a restarted group: continue where it stopped
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        n, first_epoch, resumed = ckpt["step"], ckpt["epoch"], True
        loader.load_state_dict(ckpt["loader"])
    killed_marker = os.path.join(out_dir, "killed")
    for epoch in range(first_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = step(model, opt, batch)
            record(out, loader="fastloader", step=n, epoch=epoch, seen=batch["i"].tolist(),
                   loss=loss, resumed=resumed)
            n += 1
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "loader": loader.state_dict(), "epoch": epoch, "step": n}, tmp)
            os.replace(tmp, ckpt_path)
            if n == KILL_AFTER and not os.path.exists(killed_marker):
                dist.barrier()   # every rank has its checkpoint of step KILL_AFTER
                if rank == KILL_RANK:
                    with open(killed_marker, "w") as f:
                        f.write(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)
                # the others block in the next step until torchrun tears them down


def main(mode, out_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t0 = time.monotonic()
    names = share_on_node(build_index)
    index_s = time.monotonic() - t0
    assert len(names) == N and names[N - 1] == f"shard-{(N - 1) % 7}/sample_{N - 1:05d}.bin"
    with open(os.path.join(out_dir, f"{mode}-{rank}.jsonl"), "a") as out:
        record(out, rank=rank, host=socket.gethostname(), node=node_key(), built=bool(BUILT),
               pid=os.getpid(), index_s=index_s,
               restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
               group_rank=int(os.environ.get("GROUP_RANK", -1)))
        ds = Samples(names)
        if mode == "reference":
            reference(ds, rank, out)
        else:
            elastic(ds, rank, out, out_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
