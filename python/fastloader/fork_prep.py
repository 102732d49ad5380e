"""Work done once in the main process so that forked workers do not each redo it.

A forked worker inherits the main process's memory, so whatever the main process
already loaded costs a worker nothing, whereas the same work done in the worker is
paid again by every worker of every epoch (non-persistent workers start afresh
each epoch). Measured on a 2-core box, fork, 2 workers, per worker and epoch:

- torch's seeding (which a worker must reproduce) imports ``numpy.random`` on
  first use: ~20 ms;
- ``torch.manual_seed`` queues CUDA's lazy seeding with ``traceback.format_stack()``,
  which reads every source file on the worker's stack through ``linecache``:
  ~7 ms. With those files in the inherited cache it formats the same text in
  well under a millisecond. (seeding.py skips that call altogether where no
  device could take the seed; this is for the builds where one could.)
- seeding.py's checks of whether a device could take the seed read a dozen
  modules and functions: ~80 copy-on-write faults in each worker, none when the
  main process makes the checks that cannot change before the worker seeds.
"""
from __future__ import annotations

import linecache
import sys

from . import seeding

_numpy_random_loaded = False

# modules whose source lines a worker's seeding stack shows (see seeding.py
# and torch.cuda._lazy_call): the worker's own frames, below the main process's
_WORKER_STACK_MODULES = ("multiprocessing.process", "fastloader.worker", "fastloader.seeding",
                         "torch.random", "torch.cuda", "torch.cuda.random", "torch.xpu", "torch.xpu.random",
                         "torch.mtia")


def _load_numpy_random() -> None:
    global _numpy_random_loaded
    if _numpy_random_loaded:
        return
    try:
        # Another thread starting its own loader's workers may be inside this
        # import: then this waits for its module lock. Marked loaded only once
        # the import is done: a thread that forked while another held that lock
        # gave workers a lock nobody would release, and their seeding's import
        # of numpy.random waited on it for ever.
        import numpy.random  # noqa: F401
    except ImportError:   # numpy is optional for torch: workers then skip it too
        pass
    _numpy_random_loaded = True


def _warm_linecache() -> None:
    files = set()
    for name in _WORKER_STACK_MODULES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            files.add(path)
    frame = sys._getframe(1)
    while frame is not None:   # the stack a forked child starts with
        files.add(frame.f_code.co_filename)
        frame = frame.f_back
    cache = linecache.cache
    for path in files:
        if path not in cache and not path.startswith("<"):
            linecache.getlines(path)


def prepare_for_fork() -> None:
    """Call right before forking workers (cheap after the first call)."""
    _load_numpy_random()
    _warm_linecache()
    seeding.check_before_fork()
