"""The sharing policy module: one list of strategies, one validator, one segment
name format with its parser, one start-method resolver (used by the loader, the
pool, the forkserver warm-up, the metadata warning, the sweep and the doctor)."""
import multiprocessing
import os

import pytest

from fastloader import DataLoader, _core, doctor, packed, sharing
from fastloader.install import install
from fastloader.metadata_warning import (
    HeavyMetadataWarning, _reset_once_registry, warn_if_heavy_metadata,
)
from torch.utils.data import Dataset

from tests.support import packed_datasets as pds


def test_strategy_names_default_and_one_validator():
    assert sharing.STRATEGIES == ("file_descriptor", "file_system")
    assert sharing.DEFAULT_STRATEGY == "file_descriptor"
    assert sharing.core_strategy("file_descriptor", _core) == _core.STRATEGY_FD
    assert sharing.core_strategy("file_system", _core) == _core.STRATEGY_FS
    for bad in ("file_descriptors", None, 0, ""):
        with pytest.raises(ValueError, match="sharing_strategy should be one of"):
            sharing.check_strategy(bad)
    # every entry point validates the same way
    with pytest.raises(ValueError, match="'file_descriptor', 'file_system'"):
        DataLoader(list(range(4)), sharing_strategy="shm")
    with pytest.raises(ValueError, match="'file_descriptor', 'file_system'"):
        packed.PackedStringArray(["a"], sharing_strategy="shm")
    with pytest.raises(ValueError, match="'file_descriptor', 'file_system'"):
        install("shm")


def test_loader_prefix_and_packed_names_parse_back():
    prefix = sharing.loader_prefix(4242)
    channel = f"{prefix}-w3-s0-0123456789abcdef"   # what the C core appends
    here = sharing.pid_namespace()
    assert here is not None and len(here) == 8
    assert sharing.parse_segment_name(channel) == ("fastloader", 4242, True, here)
    assert sharing.parse_segment_name(f"{prefix}-x") == ("fastloader", 4242, False, here)
    assert sharing.loader_prefix(4242) != prefix   # unpredictable
    name = sharing.packed_segment_name()
    assert sharing.parse_segment_name(name) == ("fastloader-pack", os.getpid(), False, here)
    # names made before the namespace was part of them parse, with no namespace
    assert sharing.parse_segment_name("fastloader-4242-0123456789-w0-s0-0123456789abcdef") \
        == ("fastloader", 4242, False, None)
    for foreign in ("torch_12_34", "fastloader-test-errors-1-w0", "other", "fastloader-"):
        assert sharing.parse_segment_name(foreign) is None
    # the doctor reads ours through the same parser and still knows torch's
    assert doctor._segment_kind(channel) == ("fastloader", 4242)
    assert doctor._segment_kind(name) == ("fastloader-pack", os.getpid())
    assert doctor._segment_kind("torch_77_1") == ("torch", 77)


@pytest.fixture
def platform_default_forkserver(monkeypatch):
    """Python 3.14 on Linux: nothing chosen yet, and 'forkserver' listed first."""
    monkeypatch.setattr(multiprocessing, "get_start_method",
                        lambda allow_none=False: None if allow_none else "forkserver")
    monkeypatch.setattr(multiprocessing, "get_all_start_methods",
                        lambda: ["forkserver", "fork", "spawn"])


def test_start_method_resolution(platform_default_forkserver):
    assert sharing.resolve_start_method(None) == "forkserver"
    assert sharing.default_start_method() == "forkserver"
    assert sharing.resolve_start_method("spawn") == "spawn"
    assert sharing.resolve_start_method(multiprocessing.get_context("fork")) == "fork"
    assert doctor.collect_start_methods()["default"] == "forkserver"


def test_metadata_warning_names_the_platform_default_method(platform_default_forkserver):
    # It used to fall back to 'fork' when no method was set, which is wrong where
    # the default is forkserver (Python 3.14): the warning then blamed copy-on-read.
    class Holder(Dataset):
        def __init__(self):
            self.names = pds.make_names(150_000)

        def __len__(self):
            return 1

        def __getitem__(self, i):
            return i

    _reset_once_registry()
    try:
        with pytest.warns(HeavyMetadataWarning) as record:
            warn_if_heavy_metadata(Holder(), 2, None)
    finally:
        _reset_once_registry()
    message = str(record[0].message)
    assert "('forkserver')" in message and "unpickles its own copy" in message

