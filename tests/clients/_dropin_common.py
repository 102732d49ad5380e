"""Shared by the accelerate and transformers client scripts: a seeded map-style
dataset whose samples draw from the worker's RNG (so worker seeding is compared too)
and which leaves one marker file per process that served samples, naming its pid,
its parent and whether it was one of fastloader's workers."""
import faulthandler
import multiprocessing
import os
import signal

import torch
from torch.utils.data import Dataset, get_worker_info

_MARKED = set()


def dump_stacks_on_sigusr1():
    """On SIGUSR1, print every thread's Python stack to stderr: the harness sends it
    to all processes of a run that hung. Set before anything forks, so that ranks
    and forked workers inherit the handler."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def in_fastloader_worker():
    """This process was started by fastloader's pool (its target is fastloader's
    worker loop), not by torch's DataLoader."""
    target = getattr(multiprocessing.current_process(), "_target", None)
    return getattr(target, "__module__", "") == "fastloader.worker"


def mark(marker_dir):
    pid = os.getpid()
    if pid in _MARKED:
        return
    _MARKED.add(pid)
    info = get_worker_info()
    name = (f"{pid}-{os.getppid()}-{info.id if info else 'main'}-"
            f"{'fast' if in_fastloader_worker() else 'torch'}")
    open(os.path.join(marker_dir, name), "w").close()


def read_markers(marker_dir):
    """[(pid, parent pid, worker id or 'main', 'fast' or 'torch')] of every process
    that served samples."""
    out = []
    for name in sorted(os.listdir(marker_dir)):
        pid, ppid, wid, kind = name.split("-")
        out.append((int(pid), int(ppid), wid, kind))
    return out


class Regression(Dataset):
    """x: 8 features from a per-index generator plus noise from the worker's torch
    RNG; y: a fixed linear function of the clean features."""

    def __init__(self, n, marker_dir):
        self.n = n
        self.marker_dir = marker_dir

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        mark(self.marker_dir)
        g = torch.Generator().manual_seed(1000 + i)
        clean = torch.randn(8, generator=g)
        noise = 0.01 * torch.randn(8)          # worker-seeded: differs per seed
        y = clean.sum(dim=0, keepdim=True) * 0.5
        return {"x": clean + noise, "y": y}


class Tokens(Dataset):
    """Causal-LM samples over a vocabulary of 100: per-index tokens, one position
    re-drawn from the worker's RNG (a stand-in for random masking/augmentation)."""

    def __init__(self, n, length, marker_dir):
        self.n, self.length, self.marker_dir = n, length, marker_dir

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        mark(self.marker_dir)
        g = torch.Generator().manual_seed(5000 + i)
        ids = torch.randint(0, 100, (self.length,), generator=g)
        ids[torch.randint(0, self.length, ())] = torch.randint(0, 100, ())
        return {"input_ids": ids, "labels": ids.clone(),
                "attention_mask": torch.ones(self.length, dtype=torch.long)}


def setup_determinism(seed=0):
    torch.set_num_threads(1)
    torch.manual_seed(seed)


def loader_class(kind):
    if kind == "torch":
        from torch.utils.data import DataLoader
    else:
        from fastloader import DataLoader
    return DataLoader
