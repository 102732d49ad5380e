"""Every dtype this torch has, in a batch: a tensor arrives with its dtype and bytes,
as torch's DataLoader delivers it (dtypes added to torch after fastloader's own list
was written, such as float4_e2m1fn_x2, included), and also where torch's transport
cannot rebuild it (the bits dtypes, the one-byte shells uint1-7 and int1-7: the README
says so)."""
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from fastloader import DataLoader
from tests.support.helpers import collect

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)
TORCH_CANNOT = {f"torch.{kind}{n}" for kind in ("uint", "int") for n in range(1, 8)} | {
    f"torch.bits{n}" for n in ("8", "16", "1x8", "2x4", "4x2")}


class OfDtype(Dataset):
    """Sample i: 3 elements of `dtype` made from known bytes."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __len__(self):
        return 4

    def raw(self, i):
        return torch.arange(3, dtype=_RAW[self.dtype.itemsize]) + 5 * i + 1

    def __getitem__(self, i):
        return self.raw(i).view(self.dtype)


def _outcome(cls, dataset):
    loader = cls(dataset, batch_size=2, num_workers=1, multiprocessing_context="fork",
                 timeout=60)
    try:
        batches = collect(loader, seconds=120)
    except Exception as exc:   # compared below
        return "error", type(exc).__name__
    raw = _RAW[dataset.dtype.itemsize]
    return "ok", [(b.dtype, tuple(b.shape), b.view(raw).tolist()) for b in batches]


# torch's collate makes a complex32 (and, from torch 2.15, a bcomplex32) batch with
# torch.empty or torch.stack, which warn (an error under this suite's filterwarnings,
# raised in the worker)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:BComplex32 support is experimental")   # torch 2.15's
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_arrives_with_its_bytes(dtype):
    if dtype.itemsize not in _RAW:
        pytest.skip(f"{dtype}: no integer of its width to build it from")
    if str(dtype).startswith("torch.q"):
        pytest.skip(f"{dtype}: a quantized tensor is made with its scales, not from bytes")
    dataset = OfDtype(dtype)
    try:
        dataset[0]
    except (RuntimeError, TypeError) as exc:
        pytest.skip(f"{dtype}: no tensor of it here ({exc})")
    expected = ("ok", [(dtype, (2, 3), torch.stack([dataset.raw(i), dataset.raw(i + 1)]).tolist())
                       for i in (0, 2)])
    assert _outcome(DataLoader, dataset) == expected
    theirs = _outcome(TorchDataLoader, dataset)
    if str(dtype) in TORCH_CANNOT:
        assert theirs[0] == "error", theirs   # its pickle cannot rebuild these
    else:
        assert theirs == expected
