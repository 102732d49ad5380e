"""Under fork, batch 0's task reaches worker 0 while the main process forks the
other workers (early_task.py), when torch's own unshuffled sampler gives it; any
other sampler is drawn where torch draws it, after every worker started."""
import os
import subprocess
import sys

import torch
import torch.utils.data
from torch.utils.data import Dataset, Sampler

import fastloader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs in a fresh interpreter: a fork hook stays registered for the process's life.
_SECOND_FORK_WAITS_FOR_BATCH_0 = r"""
import os, select, sys
import torch, torch.utils.data as tud
import fastloader

started, seen = os.pipe()

class Numbers(tud.Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        if i == 0:
            os.write(seen, b"0")   # worker 0 is building batch 0
        return torch.tensor([i])

forks = []

def before_fork():
    forks.append(None)
    if len(forks) == 2:   # the second worker is about to be forked
        ready, _, _ = select.select([started], [], [], 60)
        print("batch 0 under way before the second fork:", bool(ready), flush=True)

os.register_at_fork(before=before_fork)
loader = fastloader.DataLoader(Numbers(), batch_size=16, num_workers=2,
                               multiprocessing_context="fork")
batches = [b.flatten().tolist() for b in loader]
print("batches:", batches == [list(range(s, s + 16)) for s in range(0, 96, 16)], flush=True)
print("forks:", len(forks), flush=True)
"""


def test_worker_0_builds_batch_0_while_the_second_worker_is_forked(subprocess_env):
    """The fork hook holds the second worker's fork until worker 0 has started on
    batch 0 (60 s at most): before the early task, worker 0 got no task until every
    worker was forked, so it waited the 60 s out and said False."""
    proc = subprocess.run([sys.executable, "-c", _SECOND_FORK_WAITS_FOR_BATCH_0],
                          env=subprocess_env, cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "batch 0 under way before the second fork: True", "batches: True", "forks: 2"], \
        proc.stdout + proc.stderr


class DrawnMark(Dataset):
    """Each sample says whether its worker's copy of the dataset had been marked by
    the sampler's first draw."""

    def __init__(self):
        self.drawn = False

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([i, int(self.drawn)])


class MarkingSampler(Sampler):
    """A sampler whose first draw changes state that a worker forked after it would
    inherit: torch draws it once every worker runs, so no worker sees the mark."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __iter__(self):
        self.dataset.drawn = True
        yield from range(len(self.dataset))


def _marks(loader_class):
    dataset = DrawnMark()
    loader = loader_class(dataset, batch_size=2, sampler=MarkingSampler(dataset),
                          num_workers=2, multiprocessing_context="fork")
    return [batch.tolist() for batch in loader]


def test_a_users_sampler_is_drawn_after_every_worker_started_as_in_torch():
    expected = _marks(torch.utils.data.DataLoader)
    assert [[i, 0] for i in range(8)] == [row for batch in expected for row in batch]
    assert _marks(fastloader.DataLoader) == expected
