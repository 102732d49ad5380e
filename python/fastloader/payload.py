"""Sending the dataset to the workers once.

Under spawn and forkserver, a worker's arguments are pickled when it starts:
torch's DataLoader pickles the dataset once per worker, in the main process, one
worker after the other (0.4 s per worker for a list of 2M file names). fastloader
pickles the heavy part of the workers' arguments (dataset, collate_fn,
worker_init_fn) once, into an anonymous memfd that every worker maps and
unpickles from: the main process's cost no longer grows with num_workers.

That is valid only when one pickle suits every child, and a few reductions make
pickles that do not: an fd handed over with ``DupFd`` reaches one child only,
and torch's shared-memory tensors take a reference per pickle. Both are noticed
while pickling, and the loader then pickles per worker, exactly as torch does
(a dataset of tensors costs little that way: the tensors' bytes are shared, not
pickled).
"""
from __future__ import annotations

import io
import mmap
import os
from multiprocessing import context as _mp_context
from multiprocessing.reduction import ForkingPickler
from typing import Optional

from .seals import seal_immutable

# Below this a pickle per worker costs microseconds: not worth a memfd.
MIN_BYTES = 1 << 16


class _NotShareable(Exception):
    """The pickle would differ per child (or must not be repeated)."""


class _ProbePopen:
    """Stands in for the Popen of a child being started, so the reductions that
    need one (they ask it to pass an fd) run, and tell us they did."""

    def duplicate_for_child(self, fd):
        raise _NotShareable(f"fd {fd} would go to one child only")

    DupFd = duplicate_for_child


def _refuse(obj):
    raise _NotShareable(f"{type(obj).__name__} is shared by reference per pickle")


class _OncePickler(ForkingPickler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # torch's multiprocessing reductions (tensors, storages, CUDA events)
        # count a reference in shared memory per pickle: one pickle for many
        # children would count too few.
        table = dict(self.dispatch_table)
        for cls, reducer in table.items():
            if getattr(reducer, "__module__", "").startswith("torch.multiprocessing"):
                table[cls] = _refuse
        self.dispatch_table = table


def pickle_once(obj) -> Optional[bytes]:
    """``obj`` pickled as the workers' start would pickle it, if every worker can
    unpickle that same pickle; None if not (or if it does not pickle at all: the
    per-worker start then raises the error the user would get from torch)."""
    buf = io.BytesIO()
    previous = _mp_context.get_spawning_popen()
    _mp_context.set_spawning_popen(_ProbePopen())
    try:
        _OncePickler(buf).dump(obj)
    except Exception:
        return None
    finally:
        _mp_context.set_spawning_popen(previous)
    return buf.getvalue()


class SharedPickle:
    """One pickle in an anonymous memfd, handed to each worker by fd."""

    def __init__(self, blob: bytes):
        self.size = len(blob)
        self.fd = os.memfd_create("fastloader-payload",
                                  os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            # Reserve the pages first: running out of memory is then a MemoryError
            # here, naming the size, not an OSError half-way or a SIGBUS later.
            try:
                if self.size:
                    os.posix_fallocate(self.fd, 0, self.size)
            except OSError as exc:
                raise MemoryError(
                    f"fastloader: creating a {self.size}-byte payload segment: "
                    f"{exc.strerror} (shared memory is exhausted: /dev/shm, memfd pages "
                    f"or a memory limit; see `python -m fastloader doctor`)") from exc
            view = memoryview(blob)
            while view:
                view = view[os.write(self.fd, view):]
            # final: no holder of the fd can resize or rewrite it under a worker's map
            seal_immutable(self.fd)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def load(fd: int, size: int):
    """In a worker: unpickle straight from the shared pages, then let them go."""
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
            return ForkingPickler.loads(mapped)
    finally:
        os.close(fd)
