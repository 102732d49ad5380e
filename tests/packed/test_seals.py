"""The final seals of a memfd (packed arrays, the spawn payload) fail with EBUSY now
and then right after the file was written, on a busy machine (its pages still held
in another CPU's batch for the LRU lists; seen once in `make test-asan`, where
PackedStringArray.share() raised `OSError: [Errno 16] Device or resource busy`).
The seal is tried again; a pin that stays still fails."""
import errno
import fcntl
import os

import pytest

from fastloader import seals
from fastloader.packed import PackedStringArray


def _busy_for(monkeypatch, n):
    """fcntl.fcntl raises EBUSY for the first `n` F_ADD_SEALS calls."""
    real, left = fcntl.fcntl, [n]

    def fake(fd, cmd, arg=0):
        if cmd == fcntl.F_ADD_SEALS and left[0] > 0:
            left[0] -= 1
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", fake)
    return left


def test_a_packed_array_is_made_though_its_seal_is_refused_for_a_moment(monkeypatch):
    left = _busy_for(monkeypatch, 3)
    a = PackedStringArray(["a", "bb", "ccc"], sharing_strategy="file_descriptor")
    assert left == [0] and list(a) == ["a", "bb", "ccc"]
    seals_now = fcntl.fcntl(a._storage.fd, fcntl.F_GET_SEALS)
    assert seals_now & seals.IMMUTABLE == seals.IMMUTABLE


def test_a_seal_refused_for_good_still_fails(monkeypatch):
    _busy_for(monkeypatch, 1000)
    monkeypatch.setattr(seals.time, "sleep", lambda s: None)
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with pytest.raises(OSError) as err:
            seals.seal_immutable(fd)
        assert err.value.errno == errno.EBUSY
    finally:
        os.close(fd)
