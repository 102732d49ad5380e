"""Iterable datasets for the distributed tests."""
from torch.utils.data import Dataset, IterableDataset

import fastloader.distributed as fld


class Stream(IterableDataset):
    def __init__(self, n, rank, world):
        self.n, self.rank, self.world = n, rank, world

    def __iter__(self):
        return fld.shard(range(self.n), rank=self.rank, world_size=self.world)


class Exploding(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise ValueError("bad sample")
