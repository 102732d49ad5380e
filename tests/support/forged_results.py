"""A main channel whose worker end is played by the test: result descriptors and
fd messages written by hand, as a process that can write the channel's control
block (or send on its socket) could write them. The layout is csrc/ring.h's
fl_ctl and fl_result and csrc/shm.h's fl_fdmsg; the magic and version are checked
first, so a change of layout fails here and not as a wrong result."""
import contextlib
import fcntl
import mmap
import os
import socket
import struct
import uuid

from fastloader import _core
from fastloader.sharing import NAME_ROOT

CTL_MAGIC, CTL_VERSION = 0x464C4354, 1
# fl_result: seq, kind, where, gen, slot, seg, nbytes, slot_size, nslots, pad, token, dev, ino
RESULT = struct.Struct("<qIIIIQQQIIQQQ")
RES_HEAD_OFF = 192            # fl_ctl.res_head: the third 64-byte line
SLOT_GRAIN = 64 << 10         # csrc/ring.h's FL_SLOT_GRAIN
SEG_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class ForgedWorker:
    """The worker end of `main` (file_descriptor strategy)."""

    def __init__(self, main):
        self.main = main
        h = main.handle()
        self.ctl = mmap.mmap(h["ctl_fd"], h["ctl_size"])
        magic, version = struct.unpack_from("<II", self.ctl, 0)
        assert (magic, version) == (CTL_MAGIC, CTL_VERSION), "fl_ctl's layout changed"
        self.res_cap, = struct.unpack_from("<I", self.ctl, 24)
        self.res_off, = struct.unpack_from("<Q", self.ctl, 32)
        assert RESULT.size == 80
        self.sock = socket.socket(fileno=os.dup(h["sock"]))

    def close(self):
        self.sock.close()
        self.ctl.close()

    def push(self, seq, kind, where, gen=0, slot=0, seg=0, nbytes=0, slot_size=0,
             nslots=0):
        """Publish one result descriptor."""
        head, = struct.unpack_from("<Q", self.ctl, RES_HEAD_OFF)
        at = self.res_off + (head & (self.res_cap - 1)) * RESULT.size
        RESULT.pack_into(self.ctl, at, seq, kind, where, gen, slot, seg, nbytes,
                         slot_size, nslots, 0, 0, 0, 0)
        struct.pack_into("<Q", self.ctl, RES_HEAD_OFF, head + 1)

    def send_segment(self, seg, size, fds):
        """Announce segment `seg` of `size` bytes with `fds` (fl_fdmsg)."""
        socket.send_fds(self.sock, [struct.pack("<QQ", seg, size)], fds)

    def recv(self, timeout=10.0):
        """(worker_id, seq, kind, payload, where) of the next result."""
        return _core.recv((self.main,), 0, timeout)


def sealed_segment(size, content=b""):
    """A memfd as a worker makes one: `content` at its start, sealed against
    shrinking and growing."""
    fd = os.memfd_create("forged", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    os.pwrite(fd, content, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEG_SEALS)
    return fd


@contextlib.contextmanager
def forged_channel(tag):
    """A file_descriptor main channel under a fresh prefix of ours, and its
    ForgedWorker; both closed on exit."""
    prefix = f"{NAME_ROOT}-{os.getpid()}-{uuid.uuid4().hex[:10]}-{tag}"
    main = _core.MainChannel(0, _core.STRATEGY_FD, prefix, 1 << 16, 16)
    worker = ForgedWorker(main)
    try:
        yield worker
    finally:
        worker.close()
        main.close()
