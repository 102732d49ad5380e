"""Datasets for tests/packed/test_packed.py, at module level so that spawn and forkserver
workers can unpickle them as ``tests.support.packed_datasets.<name>``."""
import os

import torch
from torch.utils.data import Dataset

# the memory benchmarks' datasets, one definition for both (a sample of
# NoNamesDataset is always 40)
from benchmarks.packed_memory_datasets import NamesDataset, NoNamesDataset  # noqa: F401


def make_names(n, start=0):
    """n distinct, realistic file names (about 40 bytes each), built fast."""
    return [f"train/n{(i * 7919) % 1000:05d}/img_{i:09d}.JPEG" for i in range(start, start + n)]


class ItemDataset(Dataset):
    """Returns the items of a packed (or plain) sequence, for equivalence checks."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


class RecordDataset(Dataset):
    """COCO-style annotation records -> (bbox tensor, category id, file name)."""

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, index):
        r = self.records[index]
        return torch.tensor(r["bbox"], dtype=torch.float32), r["category_id"], r["file_name"]


def read_size(path):
    """A PackedImageFolder loader: the file's size and first byte."""
    with open(path, "rb") as f:
        data = f.read()
    return torch.tensor([len(data), data[0] if data else -1])


def worker_info(names):
    """A multiprocessing target's work: what a child sees of a packed array."""
    return len(names), names[0], names[-1], type(names).__name__, os.getpid()


def child_main(names, queue):
    queue.put(worker_info(names))


def child_reads_all(names, queue):
    """Touch every item, then report: used to check a child attached, not copied."""
    total = 0
    for i in range(len(names)):
        total += len(names[i])
    queue.put(total)
