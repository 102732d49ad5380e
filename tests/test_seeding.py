"""seeding.py: a worker's seeding leaves random, torch and numpy exactly as torch's
worker leaves them, and skips torch.manual_seed's device part only where no device
could take the seed."""
import os
import random
import resource
import types

import numpy as np
import pytest
import torch
from torch.utils.data._utils import worker as _tw

from fastloader import seeding


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


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(seeding, "_cpu_only", None)


@pytest.mark.parametrize("base_seed,worker_id", [(0, 0), (12345, 1), (2**63 - 7, 3),
                                                 (987654321987, 7)])
def test_worker_seeding_leaves_every_generator_as_torchs_does(base_seed, worker_id,
                                                              fresh_cache):
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


requires_cpu_build = pytest.mark.skipif(
    torch._C._has_cuda or getattr(torch._C, "_has_xpu", False) or torch._C._has_mps,
    reason="this torch has a device that takes seeds")


@requires_cpu_build
def test_a_cpu_build_seeds_the_cpu_generator_alone(monkeypatch, fresh_cache):
    def refuse(seed):
        raise AssertionError("torch.manual_seed was called")
    monkeypatch.setattr(torch, "manual_seed", refuse)
    seeding.seed_torch(77)
    assert torch.initial_seed() == 77


@requires_cpu_build
def test_a_custom_backend_or_unknown_seeding_code_takes_torchs_own_call(monkeypatch,
                                                                         fresh_cache):
    calls = []
    monkeypatch.setattr(torch, "manual_seed", lambda seed: calls.append(seed))
    name = torch._C._get_privateuse1_backend_name()
    monkeypatch.setattr(torch, name, types.SimpleNamespace(), raising=False)
    seeding.seed_torch(5)
    assert calls == [5]

    monkeypatch.delattr(torch, name)
    monkeypatch.setattr(seeding, "_cpu_only", None)
    monkeypatch.setattr(seeding, "_KNOWN_NAMES", seeding._KNOWN_NAMES - {"mtia"})
    seeding.seed_torch(6)
    assert calls == [5, 6]


@requires_cpu_build
def test_a_forked_workers_seeding_writes_few_shared_pages(fresh_cache):
    """The reason for the fast path: torch.manual_seed formats the stack, and in a
    forked child every page that touches is a copy-on-write fault (~400 here)."""
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

    seeding.seed_torch(1)   # the checks run once per process: not what is measured
    ours = min(faults_in_child(lambda: seeding.seed_torch(3)) for _ in range(3))
    theirs = min(faults_in_child(lambda: torch.manual_seed(3)) for _ in range(3))
    assert ours * 4 < theirs, (ours, theirs)
