"""A /dev/shm of a test's own: a private mount namespace with a fresh tmpfs there.

The suite runs in several pytest processes at once (`make test`: pytest-xdist), and
every fastloader loader with sharing_strategy="file_system" sweeps /dev/shm of dead
loaders' segments when it starts. A test that plants such a segment (or makes one by
killing a loader) and then asserts what the doctor or the next loader does with it
would race with another test process's sweep; in a /dev/shm of its own it cannot."""
import ctypes
import ctypes.util
import os
import pickle
import select
import signal
import time
import traceback

CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18


def mount_private_dev_shm(size: str) -> None:
    """Unshare this process's mount namespace, stop mounts propagating back, and
    mount a fresh tmpfs of `size` over /dev/shm: only this process and the children
    it starts from now on see it. OSError (with the step that failed) where that
    cannot be done (not root, no CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        raise PermissionError("not root: cannot make a mount namespace")
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    if libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    for args in ((None, b"/", None, MS_REC | MS_PRIVATE, None),
                 (b"tmpfs", b"/dev/shm", b"tmpfs", 0, f"size={size},mode=1777".encode())):
        if libc.mount(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {args[1]!r}: {os.strerror(err)}")


class _Skip(Exception):
    pass


def run_with_private_dev_shm(test, *args, size="512m", timeout=300.0):
    """Run test(*args) in a forked child of this process that has a /dev/shm of its
    own (mount_private_dev_shm), and fail here with the child's traceback if it
    fails; skip where the namespace cannot be made (or the body skips). The body
    sees the pytest process's modules and fixtures' values as they were at the fork."""
    import pytest   # here: shm_limits_child imports this module without pytest's cost

    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:   # never returns into pytest
        outcome = ("error", "the child did not report")
        try:
            os.close(read_end)
            try:
                mount_private_dev_shm(size)
            except OSError as exc:
                raise _Skip(f"cannot give the test a /dev/shm of its own: {exc}") from None
            test(*args)
            outcome = ("ok", None)
        except (_Skip, pytest.skip.Exception) as exc:
            outcome = ("skip", str(exc))
        except BaseException:
            outcome = ("error", traceback.format_exc())
        finally:
            try:
                message = pickle.dumps(outcome)
                message = len(message).to_bytes(8, "little") + message
                while message:
                    message = message[os.write(write_end, message):]
            finally:
                os._exit(0)
    os.close(write_end)
    try:
        data = _read_all(read_end, child, time.monotonic() + timeout)
    finally:
        os.close(read_end)
        os.waitpid(child, 0)
    kind, detail = pickle.loads(data) if data else ("error", "the child died without a report")
    if kind == "skip":
        pytest.skip(detail)
    if kind == "error":
        raise AssertionError(f"in the child with a private /dev/shm:\n{detail}")


def _read_all(fd, child, deadline):
    """The child's length-prefixed report (b"" if it died first). Not read to EOF: a
    process the test forked may hold the pipe's write end a little longer."""
    data = b""
    while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "little"):
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the test with a private /dev/shm did not finish in time")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            data += chunk
    return data[8:]
