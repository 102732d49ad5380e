"""Datasets for tests/conformance/test_big_tasks.py, importable by spawned workers."""
import torch
from torch.utils.data import Dataset


class IndexSum(Dataset):
    """A map-style dataset that answers a whole batch of indices at once (what a
    loader with batch_size=None hands it) with their sum, and one index with
    itself: big batches of indices cost the test little beyond their transport."""

    def __len__(self):
        return 1 << 40

    def __getitem__(self, index):
        if isinstance(index, list):
            return torch.tensor(sum(index), dtype=torch.int64)
        return torch.tensor(index, dtype=torch.int64)

    def __getitems__(self, indices):
        # a batch_sampler's batch: one sample, the sum (collated to shape [1])
        return [torch.tensor(sum(indices), dtype=torch.int64)]


def batches_of(sizes, start=0):
    """Consecutive index batches of the given sizes (a batch_sampler with no
    batch_size: the loader cannot size its task ring from it)."""
    out = []
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out
