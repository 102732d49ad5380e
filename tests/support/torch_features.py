"""What the installed torch has, for the tests of a feature or a behaviour that only
some torch releases have.

fastloader supports torch >= 2.1 and behaves as the installed torch's DataLoader.
CI runs the suite on torch 2.13 (and the conformance suite on 2.14); `make
test-oldtorch` runs the conformance directory on torch 2.1.2, the oldest release in
range, where the tests of what that torch lacks, or of what its own DataLoader gets
wrong (nothing to match), are skipped with these marks.
"""
import inspect

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

# torch 2.6: DataLoader(in_order=...), torch.accelerator
HAS_IN_ORDER = "in_order" in inspect.signature(DataLoader.__init__).parameters
HAS_ACCELERATOR_API = hasattr(torch, "accelerator")
# torch 2.3: uint16/32/64 tensors, and so torch.as_tensor of NumPy arrays of them
HAS_WIDE_UNSIGNED = hasattr(torch, "uint16")

# Where torch's __next__ warns that an IterableDataset yielded more than its len():
# at the caller's loop (stacklevel=2) in 2.13, at its own line in 2.9 and older
ITERABLE_LENGTH_WARNING_AT_CALLER = "stacklevel=2" in inspect.getsource(
    _BaseDataLoaderIter.__next__)

needs_in_order = pytest.mark.skipif(
    not HAS_IN_ORDER, reason=f"torch {torch.__version__}'s DataLoader has no in_order (2.6)")
needs_accelerator_api = pytest.mark.skipif(
    not HAS_ACCELERATOR_API, reason=f"torch {torch.__version__} has no torch.accelerator (2.6)")
needs_wide_unsigned = pytest.mark.skipif(
    not HAS_WIDE_UNSIGNED, reason=f"torch {torch.__version__} has no uint16/32/64 (2.3)")


def torch_before(version, why):
    """Skip where the installed torch is older than `version` and its own DataLoader
    cannot do what the test compares against (`why`): nothing to match there."""
    return pytest.mark.skipif(VERSION < version,
                              reason=f"torch {torch.__version__}: {why}")
