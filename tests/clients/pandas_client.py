"""A pandas DataFrame as a map-style dataset: 1M rows with a numeric feature column,
an integer label, a pandas-default `str` column and an object-dtype column of Python
str (the copy-on-read case of issue 13 item 7). Usage: LOADER OUT START_METHOD."""
import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset, RandomSampler

from tests.clients.client_common import collect, loader_facts, parse_argv, save

ROWS = 1_000_000


class FrameDataset(Dataset):
    def __init__(self, frame):
        self.frame = frame

    def __len__(self):
        return len(self.frame)

    def __getitem__(self, i):
        row = self.frame.iloc[i]
        features = torch.tensor([row["x"], row["y"]], dtype=torch.float32)
        # per-worker RNG: seeded identically by both loaders
        noise = torch.randn(2)
        return {"features": features + noise, "label": int(row["label"]),
                "name": row["name"], "tag": row["tag"]}


def make_frame():
    rng = np.random.default_rng(0)
    ids = np.arange(ROWS)
    return pd.DataFrame({
        "x": rng.standard_normal(ROWS).astype(np.float32),
        "y": rng.standard_normal(ROWS),
        "label": rng.integers(0, 10, ROWS),
        "name": [f"item-{i:07d}" for i in ids],                          # pandas' str dtype
        "tag": pd.Series([f"t{i % 977}" for i in ids], dtype=object),   # Python objects
    })


def main():
    DataLoader, out, (method,) = parse_argv()
    frame = make_frame()
    torch.manual_seed(1234)
    generator = torch.Generator().manual_seed(42)
    # the whole frame goes to every worker; 24 random batches of it are read
    sampler = RandomSampler(FrameDataset(frame), num_samples=24 * 64, generator=generator)
    loader = DataLoader(FrameDataset(frame), batch_size=64, sampler=sampler, num_workers=2,
                        multiprocessing_context=method)
    batches = collect(loader)
    save(out, batches=batches, loader=loader_facts(loader),
         dtypes={c: str(t) for c, t in frame.dtypes.items()})


if __name__ == "__main__":
    main()
