"""Datasets for the memory benchmark, in a module of their own so that spawn and
forkserver workers unpickle them by an importable name (see benchmarks/datasets.py).
tests/support/packed_datasets.py uses NamesDataset too."""

from torch.utils.data import Dataset


def name_of(i):
    """The i-th synthetic file name (about 40 bytes, ImageNet-like)."""
    return f"train/n{(i * 7919) % 1000:08d}/n{(i * 7919) % 1000:08d}_{i:09d}.JPEG"


def iter_names(n):
    return (name_of(i) for i in range(n))


class NamesDataset(Dataset):
    """One file name per sample, held as a Python list or a packed array.

    A sample is the name's length: every name is read (so copy-on-read happens
    where it would) while the sample costs nothing to load. ``__getitems__``
    fetches a batch in one call (torch >= 2.0 and fastloader use it), so an epoch
    over millions of names takes seconds; it still reads every name."""

    def __init__(self, names):
        self.names = names

    def __len__(self):
        return len(self.names)

    def __getitem__(self, index):
        return len(self.names[index])

    def __getitems__(self, indices):
        names = self.names
        return [len(names[i]) for i in indices]


class NoNamesDataset(Dataset):
    """The same samples without any names: the workers' memory baseline."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return 40

    def __getitems__(self, indices):
        return [40] * len(indices)
