"""fastloader: torch's DataLoader with a C core.

    from fastloader import DataLoader   # was: from torch.utils.data import DataLoader
"""
from . import _codec_hooks  # noqa: F401  (registers the codec with the C core)
from ._core import FastLoaderError, WorkerError
from .dataloader import DataLoader

__version__ = "0.1.0"
__all__ = ["DataLoader", "FastLoaderError", "WorkerError", "__version__"]
