"""What every client script shares: the one import line that differs between the torch
run and the fastloader run, and how a script reports what it observed.

A client script is run as ``python SCRIPT LOADER OUT [ARGS...]`` (see conftest.py)."""
import os
import sys

import torch

from tests.support.helpers import clone_batch


def parse_argv():
    """(DataLoader class, output path, extra args) from the command line."""
    loader, out, *rest = sys.argv[1:]
    if loader == "torch":
        from torch.utils.data import DataLoader
    elif loader == "fastloader":
        from fastloader import DataLoader
    else:
        raise SystemExit(f"unknown loader {loader!r}: torch or fastloader")
    return DataLoader, out, rest


def loader_facts(loader):
    """Which loader really ran and with what: its class, fastloader's kwargs and the
    stats of its last epoch (None under torch)."""
    stats = loader.stats(memory=False) if hasattr(loader, "stats") else None
    return {
        "class": f"{type(loader).__module__}.{type(loader).__qualname__}",
        "sharing_strategy": getattr(loader, "sharing_strategy", None),
        "num_workers": loader.num_workers,
        "persistent_workers": loader.persistent_workers,
        "multiprocessing_context": _context_name(loader.multiprocessing_context),
        "sampler": type(loader.sampler).__name__,
        "stats": stats,
        "main_pid": os.getpid(),
    }


def _context_name(ctx):
    if ctx is None:
        return None
    return ctx if isinstance(ctx, str) else ctx.get_start_method()


def collect(loader, epochs=1):
    """Every batch of `epochs` epochs, cloned out of shared memory."""
    batches = []
    for epoch in range(epochs):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        batches.extend(clone_batch(b) for b in loader)
    return batches


def save(out, **observations):
    torch.save(observations, out)
