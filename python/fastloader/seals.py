"""Making a memfd immutable (its final seals), for segments handed to other processes.

F_SEAL_WRITE fails with EBUSY while any page of the file holds a reference beyond
its mappings: the kernel waits a little for such pins, then gives up. Right after
this process wrote the file, its pages can still sit in another CPU's batch of pages
waiting to join the LRU lists (a reference the kernel's own wait does not drain), so
on a busy machine the seal fails now and then though nothing pins the file (seen
once in `make test-asan`). Those references go within milliseconds: the seal is
tried again; a real pin (direct I/O in flight) still fails, after about a second."""
from __future__ import annotations

import errno
import fcntl
import time

IMMUTABLE = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_TRIES = 12   # sleeps of 1, 2, 4 ... 64 ms then 100 ms: ~1 s in all


def seal_immutable(fd: int) -> None:
    for attempt in range(_TRIES):
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, IMMUTABLE)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or attempt == _TRIES - 1:
                raise
        time.sleep(min(0.001 * (1 << attempt), 0.1))
