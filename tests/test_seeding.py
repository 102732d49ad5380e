"""seeding.py: a worker's seeding leaves random, torch and numpy exactly as torch's
worker leaves them, and skips torch.manual_seed's device part only where no device
could take the seed."""
import functools
import os
import random
import resource
import types

import numpy as np
import pytest
import torch
from torch.utils.data._utils import worker as _tw

from fastloader import fork_prep, seeding


def _torch_worker_seeding(base_seed, worker_id):
    # what torch's _worker_loop does
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_tw._generate_state(base_seed, worker_id))


def _states():
    np_state = np.random.get_state()
    return (random.getstate(), torch.get_rng_state().tolist(), torch.initial_seed(),
            np_state[0], np_state[1].tolist(), *np_state[2:],
            np.random.mtrand._rand._bit_generator._seed_seq)


@pytest.mark.parametrize("base_seed,worker_id", [(0, 0), (12345, 1), (2**63 - 7, 3),
                                                 (987654321987, 7)])
def test_worker_seeding_leaves_every_generator_as_torchs_does(base_seed, worker_id):
    random.seed(1)
    torch.manual_seed(1)
    np.random.seed(1)
    _torch_worker_seeding(base_seed, worker_id)
    theirs = _states()
    random.seed(2)
    torch.manual_seed(2)
    np.random.seed(2)
    assert seeding.seed_worker(base_seed, worker_id) == base_seed + worker_id
    assert _states() == theirs
    # and the generators go on alike
    ours_next = (random.random(), torch.rand(3).tolist(), np.random.rand())
    _torch_worker_seeding(base_seed, worker_id)
    assert (random.random(), torch.rand(3).tolist(), np.random.rand()) == ours_next


@pytest.fixture(autouse=True)
def no_checks_from_a_fork(monkeypatch):
    # a loader that forked in this process left the main process's answer here
    monkeypatch.setattr(seeding, "_checked_at_fork", None)


requires_cpu_build = pytest.mark.skipif(
    torch._C._has_cuda or getattr(torch._C, "_has_xpu", False) or torch._C._has_mps,
    reason="this torch has a device that takes seeds")


@pytest.fixture
def device_seeding_calls(monkeypatch):
    """Each seeding torch.manual_seed queues for CUDA (which a CPU build never
    runs): the part seed_torch skips. The spy sits below torch.cuda.manual_seed_all,
    so that function is still torch's own."""
    import torch.cuda.random as cuda_random
    calls = []
    monkeypatch.setattr(cuda_random, "_lazy_call", lambda fn, **kw: calls.append(kw))
    return calls


@requires_cpu_build
def test_a_cpu_build_seeds_the_cpu_generator_alone(device_seeding_calls):
    torch.manual_seed(78)
    assert device_seeding_calls == [{"seed_all": True}]   # the spy sees torch's call
    seeding.seed_torch(77)
    assert torch.initial_seed() == 77
    assert device_seeding_calls == [{"seed_all": True}]


@requires_cpu_build
def test_torchs_own_wrapper_of_manual_seed_keeps_the_cpu_only_seeding(device_seeding_calls):
    # importing torch._dynamo (torch.compile, many libraries) wraps torch.manual_seed
    import torch._dynamo  # noqa: F401
    assert torch.manual_seed is not torch.random.manual_seed
    seeding.seed_torch(79)
    assert torch.initial_seed() == 79 and device_seeding_calls == []


def _custom_backend(monkeypatch, calls):
    backend = types.SimpleNamespace(_is_in_bad_fork=lambda: False, manual_seed_all=calls.append)
    monkeypatch.setattr(torch, torch._C._get_privateuse1_backend_name(), backend,
                        raising=False)


def _unknown_seeding_code(monkeypatch, calls):
    # as if torch's manual_seed named a device this module does not know; torch's
    # call is seen where it queues CUDA's seeding (below torch's own functions)
    import torch.cuda.random as cuda_random
    monkeypatch.setattr(seeding, "_KNOWN_NAMES", seeding._KNOWN_NAMES - {"mtia"})
    monkeypatch.setattr(cuda_random, "_lazy_call", lambda fn, **kw: calls.append(5))


def _replaced_cuda_seeding(monkeypatch, calls):
    # e.g. a library that maps CUDA's seeding onto its own device
    monkeypatch.setattr(torch.cuda, "manual_seed_all", calls.append)


def _wrapped_manual_seed(monkeypatch, calls):
    real = torch.manual_seed

    @functools.wraps(real)   # (as torch's own wrappers are; this one is not torch's)
    def wrapper(seed):
        calls.append(seed)
        return real(seed)
    monkeypatch.setattr(torch, "manual_seed", wrapper)


@requires_cpu_build
@pytest.mark.parametrize("change", [_custom_backend, _unknown_seeding_code,
                                    _replaced_cuda_seeding, _wrapped_manual_seed])
def test_anything_unknown_takes_torchs_own_call(change, monkeypatch):
    calls = []
    change(monkeypatch, calls)
    seeding.seed_torch(5)
    assert calls == [5]
    assert torch.initial_seed() == 5


@requires_cpu_build
def test_a_forked_workers_seeding_writes_few_shared_pages():
    """The reason for it: torch.manual_seed formats the stack, and in a forked
    child every page that touches is a copy-on-write fault (~250-400 here)."""
    def faults_in_child(seed_fn):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                seed_fn()
                after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                os.write(w, str(after - before).encode())
            finally:
                os._exit(0)
        os.close(w)
        got = os.read(r, 64)
        os.close(r)
        os.waitpid(pid, 0)
        return int(got)

    # as the pool forks a worker: fork_prep first, then what is left of the checks
    # and the seeding in the child
    fork_prep.prepare_for_fork()
    ours = min(faults_in_child(lambda: seeding.seed_torch(3)) for _ in range(3))
    theirs = min(faults_in_child(lambda: torch.manual_seed(3)) for _ in range(3))
    assert ours * 4 < theirs, (ours, theirs)


@requires_cpu_build
def test_a_worker_forked_after_the_checks_uses_them_and_a_spawned_one_makes_its_own(
        monkeypatch):
    calls = []
    fork_prep.prepare_for_fork()      # the main process checks: nothing takes seeds
    assert seeding._checked_at_fork is True
    _replaced_cuda_seeding(monkeypatch, calls)   # (no user code runs before seeding)
    seeding.seed_torch(3)
    assert calls == []
    monkeypatch.setattr(seeding, "_checked_at_fork", None)   # a spawned worker
    seeding.seed_torch(4)
    assert calls == [4]
