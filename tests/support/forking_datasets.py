"""A batch with objects that travel pickled (tests/conformance/test_forking_pickler.py):
torch's queue pickles them with multiprocessing's ForkingPickler, so its protocol
and its registered reducers apply. Importable by spawned workers."""
from multiprocessing.reduction import ForkingPickler

import numpy as np
from torch.utils.data import Dataset


class Handle:
    """A class that registers its own reducer with ForkingPickler."""

    def __init__(self, v):
        self.v = v


def _rebuild_handle(v):
    return Handle(("rebuilt by the registered reducer", v))


def _reduce_handle(h):
    return _rebuild_handle, (h.v,)


ForkingPickler.register(Handle, _reduce_handle)


class ProtocolAware:
    """Records the pickle protocol it was pickled with."""

    def __init__(self, protocol=None):
        self.protocol = protocol

    def __reduce_ex__(self, protocol):
        return ProtocolAware, (protocol,)


def _read_only(a):
    a.flags.writeable = False
    return a


class Indices(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return i


def pickled_parts(indices):
    """A collate_fn whose batch holds objects the codec pickles."""
    return {
        "handle": Handle(sum(indices)),
        "protocol": ProtocolAware(),
        "big_endian": np.arange(3, dtype=">f4") + sum(indices),
        "read_only_str": _read_only(np.array(["ab", "c"], dtype="<U5")),
        "read_only_struct": _read_only(np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")])),
    }
