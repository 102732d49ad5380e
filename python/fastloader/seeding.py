"""A worker's seeding: exactly torch's (random, torch, numpy), done cheaply.

torch's worker calls ``torch.manual_seed(seed)``, which seeds the CPU generator
and, for every accelerator torch knows (CUDA, MPS, XPU, MTIA, a custom backend),
queues or runs that device's seeding. Queuing one formats the worker's stack
(``traceback.format_stack()``): in a forked worker that writes to some 250-400
pages of memory it shares with the main process, each a copy-on-write fault,
1-3 ms of every worker's start in every epoch (measured in a forked child:
240-430 faults, against ~40 for the CPU generator alone and what is left of the
checks below once the main process made the rest before forking). Where no
device could take the seed (no CUDA/XPU/MPS in this build of torch, or the device
is unusable in this forked process; no MTIA or custom backend) and every function
torch's seeding calls is still torch's own, only the CPU generator is seeded: the
same observable state. Anything else takes torch's own call.

One difference remains, by design: an MTIA extension loaded only after the
worker's seeding (in ``worker_init_fn``) finds its generator unseeded, where
torch's worker had queued the seed for it."""
from __future__ import annotations

import os
import random
import sys

import torch
from torch.utils.data._utils import worker as _tw

# Names torch's manual_seed may use; another (a device added by a later torch)
# sends every seeding through torch.manual_seed itself.
_DEVICES = ("cuda", "mps", "xpu", "mtia")
_KNOWN_NAMES = frozenset({
    "int", "torch", *_DEVICES, *(f"torch.{d}" for d in _DEVICES), "_is_in_bad_fork",
    "manual_seed_all", "manual_seed", "_seed_custom_device", "default_generator",
})

# What torch.manual_seed calls, by module. A replacement (a library that maps
# CUDA's seeding onto its own device, a wrapper of torch.manual_seed) may seed
# where torch's own function would not.
_SEEDING_FUNCTIONS = (("torch.cuda", "manual_seed_all"), ("torch.mps", "manual_seed"),
                      ("torch.xpu", "manual_seed_all"), ("torch.mtia", "manual_seed_all"),
                      ("torch.random", "_seed_custom_device"))


def _known_seeding_code() -> bool:
    impl = getattr(torch.random, "_manual_seed_impl", torch.random.manual_seed)
    code = getattr(impl, "__code__", None)
    return code is not None and set(code.co_names) <= _KNOWN_NAMES


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _torchs_own(fn):
    """The function a chain of torch's own wrappers ends in (torch wraps some
    seeding functions itself, e.g. torch._dynamo's disabling wrapper of
    torch.manual_seed), or None where any link is code from outside torch."""
    for _ in range(8):
        code = getattr(fn, "__code__", None)
        if code is None or not code.co_filename.startswith(_TORCH_DIR):
            return None
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            return fn
        fn = inner
    return None


def _seeding_functions_are_torchs() -> bool:
    if _torchs_own(torch.manual_seed) is not torch.random.manual_seed:
        return False
    for module_name, name in _SEEDING_FUNCTIONS:
        module = sys.modules.get(module_name)   # not imported yet: torch's own, when it is
        fn = getattr(module, name, None) if module is not None else None
        if fn is not None and _torchs_own(fn) is None:
            return False
    return True


def _static_device_could_take_seed() -> bool:
    """What cannot change between a fork and the worker's seeding (no code of the
    user's runs in between): MPS, MTIA or a custom backend present."""
    c = torch._C
    if getattr(c, "_has_mps", True):
        return True
    if hasattr(torch, "mtia"):
        built = getattr(c, "_mtia_isBuilt", None)
        if built is None or built():
            return True
    backend = getattr(c, "_get_privateuse1_backend_name", None)
    return backend is None or hasattr(torch, backend())


def _cuda_or_xpu_could_take_seed() -> bool:
    # built in, and usable in this process (not after a fork of one that used it)
    c = torch._C
    return ((getattr(c, "_has_cuda", True) and not torch.cuda._is_in_bad_fork())
            or (getattr(c, "_has_xpu", True) and not torch.xpu._is_in_bad_fork()))


def _static_checks_pass() -> bool:
    try:
        return (_known_seeding_code() and _seeding_functions_are_torchs()
                and not _static_device_could_take_seed())
    except Exception:   # an unexpected torch: its own call is always right
        return False


# The static checks as the main process found them right before forking its
# workers (fork_prep.py): a forked worker inherits the answer instead of touching,
# and so copying, the pages of every module and function they read. None: not
# made (a spawned worker, or code not started by a fork), checked at the call.
_checked_at_fork = None


def check_before_fork() -> None:
    """Called in the main process right before it forks workers."""
    global _checked_at_fork
    _checked_at_fork = _static_checks_pass()


def only_cpu_generator_takes_seeds() -> bool:
    """Whether torch.manual_seed would seed nothing but the CPU generator here and
    now."""
    static_ok = _checked_at_fork if _checked_at_fork is not None else _static_checks_pass()
    if not static_ok:
        return False
    try:
        return not _cuda_or_xpu_could_take_seed()
    except Exception:
        return False


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)``, without the device part where it is a no-op."""
    if only_cpu_generator_takes_seeds():
        torch.default_generator.manual_seed(int(seed))
    else:
        torch.manual_seed(seed)


def seed_worker(base_seed: int, worker_id: int) -> int:
    """Exactly torch's per-worker seeding of random, torch and numpy."""
    seed = base_seed + worker_id
    random.seed(seed)
    seed_torch(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return seed
    np.random.seed(_tw._generate_state(base_seed, worker_id))
    return seed
