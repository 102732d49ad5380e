"""A worker's seeding: exactly torch's (random, torch, numpy), done cheaply.

torch's worker calls ``torch.manual_seed(seed)``, which seeds the CPU generator
and, for every accelerator torch knows (CUDA, MPS, XPU, MTIA, a custom backend),
queues or runs that device's seeding. Queuing one formats the worker's stack
(``traceback.format_stack()``): in a forked worker that writes to some 400 pages
of memory it shares with the main process, each a copy-on-write fault, ~2 ms of
every worker's start in every epoch (measured: 402 faults against 21 for the CPU
generator alone). Where no device could ever take the seed (no CUDA/XPU/MPS in
this build of torch, or the device is unusable in this forked process, no MTIA or
custom backend), only the CPU generator is seeded: the same observable state.
Anything this module does not recognise takes torch's own call."""
from __future__ import annotations

import random

import torch
from torch.utils.data._utils import worker as _tw

# Names torch's manual_seed may use; another (a device added by a later torch)
# sends every seeding through torch.manual_seed itself.
_DEVICES = ("cuda", "mps", "xpu", "mtia")
_KNOWN_NAMES = frozenset({
    "int", "torch", *_DEVICES, *(f"torch.{d}" for d in _DEVICES), "_is_in_bad_fork",
    "manual_seed_all", "manual_seed", "_seed_custom_device", "default_generator",
})

_cpu_only = None   # per process: see _only_cpu_generator_takes_seeds()


def _known_seeding_code() -> bool:
    impl = getattr(torch.random, "_manual_seed_impl", torch.random.manual_seed)
    code = getattr(impl, "__code__", None)
    return code is not None and set(code.co_names) <= _KNOWN_NAMES


def _device_could_take_seed() -> bool:
    c = torch._C
    if getattr(c, "_has_cuda", True) and not torch.cuda._is_in_bad_fork():
        return True
    if getattr(c, "_has_mps", True):
        return True
    if getattr(c, "_has_xpu", True) and not torch.xpu._is_in_bad_fork():
        return True
    if hasattr(torch, "mtia"):
        built = getattr(c, "_mtia_isBuilt", None)
        if built is None or built():
            return True
    backend = getattr(c, "_get_privateuse1_backend_name", None)
    return backend is None or hasattr(torch, backend())


def _only_cpu_generator_takes_seeds() -> bool:
    global _cpu_only
    if _cpu_only is None:
        try:
            _cpu_only = _known_seeding_code() and not _device_could_take_seed()
        except Exception:   # an unexpected torch: its own call is always right
            _cpu_only = False
    return _cpu_only


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)``, without the device part where it is a no-op."""
    if _only_cpu_generator_takes_seeds():
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
