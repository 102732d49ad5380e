"""Datasets for test_payload.py, importable by spawn/forkserver workers.

``CountedDataset`` counts, in the process that pickles it, how often it was
pickled: one pickle for all workers is what "send the dataset once" means."""
import os

import torch
from torch.utils.data import Dataset

PICKLES = {"count": 0}


class CountedDataset(Dataset):
    """Items derived from a list big enough (~200 KiB pickled) to be sent once."""

    def __init__(self, n=64, pad=20_000, tensor=None):
        self.n = n
        self.table = [f"item-{i:08d}" for i in range(pad)]
        self.tensor = tensor   # a tensor inside: each worker must get its own pickle

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        extra = 0 if self.tensor is None else int(self.tensor[index % len(self.tensor)])
        return torch.tensor([index, len(self.table[index]), extra, os.getpid()])

    def __getstate__(self):
        PICKLES["count"] += 1
        return self.__dict__


class UnpicklableInWorker(CountedDataset):
    """Pickles fine, fails to unpickle: the worker dies before serving."""

    def __setstate__(self, state):
        raise RuntimeError("this dataset refuses to be unpickled")
