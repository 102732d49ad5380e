"""Synthetic map-style datasets for the throughput benchmark.

They live in their own module, not in ``benchmarks.throughput``, because spawn
and forkserver workers unpickle the dataset by its class's module path, and a
class defined in the module run with ``python -m`` is pickled as ``__main__``.

Every dataset is deterministic (fixed seeds, values derived from the index) so
the harness can compare checksums of what each loader delivered: a loader that
is fast because it returns the wrong bytes must not go unnoticed.
"""

import random

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from fastloader import CollatedSamples   # TinyBatchedDataset's batch (torch reads it too)

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


class TokenDataset(Dataset):
    """Variable-length int64 token sequences, as a tokenized text corpus yields.

    Sample ``i`` is a 1-D LongTensor whose length (16 to 512 tokens) and
    contents follow from ``i`` alone, so every loader, worker count and start
    method sees the same sequences. The tokens are slices of one precomputed
    pool: ``__getitem__`` costs a microsecond, and what gets measured is the
    custom collate (``pad_tokens``) and moving its dict of three tensors.
    """

    MIN_LENGTH = 16
    MAX_LENGTH = 512
    VOCABULARY = 32_000
    POOL_TOKENS = 1 << 16

    def __init__(self, length):
        generator = torch.Generator().manual_seed(_SEED)
        self.length = length
        self.pool = torch.randint(1, self.VOCABULARY, (self.POOL_TOKENS,), generator=generator)

    def __len__(self):
        return self.length

    @classmethod
    def sequence_length(cls, index):
        # Knuth's multiplicative hash spreads consecutive indices over the whole
        # range, so every batch mixes short and long sequences as a shuffled
        # corpus does (and pays for padding to its longest one).
        spread = (index * 2654435761) & 0xFFFFFFFF
        return cls.MIN_LENGTH + spread % (cls.MAX_LENGTH - cls.MIN_LENGTH + 1)

    def __getitem__(self, index):
        if not 0 <= index < self.length:
            raise IndexError(index)
        start = (index * 7919) % (self.POOL_TOKENS - self.MAX_LENGTH)
        return self.pool[start:start + self.sequence_length(index)]


def pad_tokens(sequences):
    """Collate variable-length token sequences into a padded dict batch.

    Module-level (not a lambda or a method) so spawn/forkserver workers can
    unpickle it. Returns what a tokenizer's padding collator hands a model:
    ``input_ids`` and ``attention_mask`` (int64, ``[B, Lmax]``, padding 0) and
    the true ``lengths`` (int64, ``[B]``).
    """
    lengths = torch.tensor([len(sequence) for sequence in sequences], dtype=torch.int64)
    # pad_sequence (one C++ call) rather than a Python loop of row copies: a
    # loop costs ~4x more per batch and would make this a collate benchmark.
    input_ids = pad_sequence(sequences, batch_first=True, padding_value=0)
    positions = torch.arange(input_ids.shape[1])
    attention_mask = (positions.unsqueeze(0) < lengths.unsqueeze(1)).to(torch.int64)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "lengths": lengths}


class TinyBatchedDataset(TinyDataset):
    """TinyDataset that also offers batched access: ``__getitems__`` gathers the
    whole batch with two tensor indexing calls and returns it collated, wrapped
    in ``fastloader.CollatedSamples``, so no Python runs per sample. Same samples
    (and checksums) as TinyDataset; torch's DataLoader collates the same batch from
    it sample by sample."""

    def __init__(self, length):
        super().__init__(length)
        self.labels = torch.arange(length) % 10

    def __getitems__(self, indices):
        # through NumPy: torch.as_tensor(list) parses the list item by item, ~4x slower
        index = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        return CollatedSamples((self.features.index_select(0, index),
                                 self.labels.index_select(0, index)))


class JpegDataset(Dataset):
    """JPEG decode + random crop + to tensor: what an image-classification loader does.

    The benchmark makes its own images (``make_jpegs``: seeded, sizes from 256x256
    to 512x384) and holds their encoded bytes in memory, so the measurement is the
    decode and the crop, not the disk. Sample ``i`` decodes image ``i % len(jpegs)``
    with Pillow, takes a 224x224 crop whose corner is drawn from a generator seeded
    by ``i`` (a "random" crop every loader reproduces exactly, so the checksums of
    their batches can be compared) and returns it as a uint8 3x224x224 tensor.
    """

    CROP = 224

    def __init__(self, length, jpegs=None):
        self.length = length
        self.jpegs = list(jpegs if jpegs is not None else make_jpegs())

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        from io import BytesIO

        import numpy as np
        from PIL import Image

        if not 0 <= index < self.length:
            raise IndexError(index)
        with Image.open(BytesIO(self.jpegs[index % len(self.jpegs)])) as image:
            image = image.convert("RGB")
            rng = random.Random(index)
            left = rng.randrange(image.width - self.CROP + 1)
            top = rng.randrange(image.height - self.CROP + 1)
            crop = image.crop((left, top, left + self.CROP, top + self.CROP))
            pixels = torch.from_numpy(np.asarray(crop).copy())
        return pixels.permute(2, 0, 1), index % 1000


_JPEG_CACHE = {}


def make_jpegs(count=256, quality=90):
    """``count`` JPEG images (bytes) of seeded sizes and content.

    Smooth colour fields with some noise rather than pure noise: closer to what a
    photo costs to decode (pure noise makes the entropy decoder dominate). Made
    once per process and count (a second call returns the same list).
    """
    key = (count, quality)
    if key in _JPEG_CACHE:
        return _JPEG_CACHE[key]
    from io import BytesIO

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(_SEED)
    sizes = [(256, 256), (320, 240), (384, 288), (400, 300), (448, 336), (512, 384)]
    images = []
    for _ in range(count):
        width, height = sizes[int(rng.integers(len(sizes)))]
        coarse = rng.integers(0, 256, (height // 16 + 1, width // 16 + 1, 3), dtype=np.uint8)
        field = Image.fromarray(coarse).resize((width, height), Image.BILINEAR)
        noisy = np.asarray(field).astype(np.int16) + rng.integers(-12, 13, (height, width, 3))
        out = BytesIO()
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(out, "JPEG", quality=quality)
        images.append(out.getvalue())
    _JPEG_CACHE[key] = images
    return images
