"""Datasets for the distributed tests (importable by workers and ranks)."""
import torch
from torch.utils.data import Dataset


class Regression(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"i": i, "x": self.x[i], "y": self.y[i]}
