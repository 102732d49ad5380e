"""Datasets for tests/conformance/test_dropin.py, importable by spawned workers."""
import os

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, get_worker_info


class WhoLoads(Dataset):
    """Each sample: its index, a random draw from the worker's seeded torch RNG, the
    worker id, and whether the worker is one of fastloader's (its worker module is
    loaded in the process that served the sample)."""

    def __init__(self, n=40):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        return {"index": i, "draw": torch.rand(()), "worker": info.id,
                "pid": os.getpid(), "fast": _in_fastloader_worker()}


def _in_fastloader_worker():
    """Whether this process was started by fastloader's pool (its target is
    fastloader's worker_main)."""
    import multiprocessing

    proc = multiprocessing.current_process()
    target = getattr(proc, "_target", None)
    return getattr(target, "__module__", "") == "fastloader.worker"


class IterOverridingLoader(TorchDataLoader):
    """A torch DataLoader subclass that overrides __iter__ (as accelerate's
    DataLoaderShard does) and calls torch's."""

    def __iter__(self):
        for batch in super().__iter__():
            yield batch


class OwnIteratorLoader(TorchDataLoader):
    """A subclass with its own _get_iterator (as torchdata's StatefulDataLoader):
    install() must leave it alone."""

    def _get_iterator(self):
        from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

        return _MultiProcessingDataLoaderIter(self)


class PathsFrame(Dataset):
    """A file-name table in a pandas DataFrame (object dtype), read in batches."""

    def __init__(self, frame):
        self.df = frame

    def __len__(self):
        return len(self.df)

    def __getitems__(self, indices):
        values = self.df["path"].to_numpy()   # the column's own object array, no copy
        return [len(s) for s in values[np.asarray(indices)]]

    def __getitem__(self, i):
        return self.__getitems__([i])[0]


class PackedPaths(Dataset):
    def __init__(self, packed):
        self.paths = packed

    def __len__(self):
        return len(self.paths)

    def __getitems__(self, indices):
        return [len(s) for s in self.paths.take(indices)]

    def __getitem__(self, i):
        return len(self.paths[i])


def sum_collate(lengths):
    return torch.tensor(sum(lengths))
