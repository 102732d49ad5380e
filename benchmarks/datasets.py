"""Synthetic map-style datasets for the throughput benchmark.

They live in their own module, not in ``benchmarks.throughput``, because spawn
and forkserver workers unpickle the dataset by its class's module path, and a
class defined in the module run with ``python -m`` is pickled as ``__main__``.

Every dataset is deterministic (fixed seeds, values derived from the index) so
the harness can compare checksums of what each loader delivered: a loader that
is fast because it returns the wrong bytes must not go unnoticed.
"""

import torch
from torch.utils.data import Dataset

_SEED = 1234


class TinyDataset(Dataset):
    """16 float32 features and an int label per sample.

    The features are rows of one precomputed tensor, so ``__getitem__`` costs
    about a microsecond and the loader's per-batch overhead is what gets measured.
    One big tensor (not a list of rows) also keeps fork's copy-on-read out of it.
    """

    FEATURES = 16

    def __init__(self, length):
        generator = torch.Generator().manual_seed(_SEED)
        self.features = torch.randn(length, self.FEATURES, generator=generator)

    def __len__(self):
        return len(self.features)

    def __getitem__(self, index):
        return self.features[index], index % 10


class ImageDataset(Dataset):
    """uint8 3x224x224 "decoded images" and an int label per sample.

    A handful of preallocated images are returned as they are: the default
    collate copies them into the batch anyway, so the dataset costs next to
    nothing and the measurement is dominated by moving ~9 MiB batches between
    processes, which is what the image budget is about.
    """

    SHAPE = (3, 224, 224)
    DISTINCT_IMAGES = 4

    def __init__(self, length):
        generator = torch.Generator().manual_seed(_SEED)
        self.length = length
        self.images = [
            torch.randint(0, 256, self.SHAPE, dtype=torch.uint8, generator=generator)
            for _ in range(self.DISTINCT_IMAGES)
        ]

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return self.images[index % self.DISTINCT_IMAGES], index % 1000


class CpuBoundDataset(Dataset):
    """Per-sample pure-Python work with a small output.

    The loop holds the worker's GIL the way real decoding/augmentation code in
    Python does. Its length is a fixed iteration count, not a calibrated time,
    so results from different machines do the same work; 10,000 iterations take
    about 1 ms on the 2-core reference machine, which makes the sample work
    dominate any loader's per-batch cost.
    """

    LOOP_ITERATIONS = 10_000
    FEATURES = 8

    def __init__(self, length, loop_iterations=LOOP_ITERATIONS):
        self.length = length
        self.loop_iterations = loop_iterations

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        state = index
        for _ in range(self.loop_iterations):
            # A linear congruential step: cheap, impossible to skip, and
            # deterministic, so both loaders must produce the same values.
            state = (state * 1103515245 + 12345) & 0x7FFFFFFF
        return torch.full((self.FEATURES,), state / 0x7FFFFFFF), index % 10
