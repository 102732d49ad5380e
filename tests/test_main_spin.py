"""The main process spins for its next batch only where a CPU is spare beside its
workers (and the other ranks' on this node): then the workers never pay for waking
it. Where the workers use every CPU, a cgroup quota says fewer, or
FASTLOADER_MAIN_SPIN=0, it sleeps as before."""
import os
import subprocess
import sys
import uuid

import pytest

import fastloader
from fastloader import main_spin
from tests.support import datasets as ds
from tests.support.helpers import deadline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPUS = sorted(os.sched_getaffinity(0))
SPIN = main_spin.MAIN_SPIN_NS


def main_wakeups(it):
    return sum(w["main_wakeups"] for w in it.stats(memory=False)["workers"])


def wakeups_over_three_slow_batches(loader):
    """The worker's wake-ups of the main process while it waits for batches 2-4,
    each 0.15 s of the worker's time (the first includes the worker's start)."""
    it = iter(loader)
    with deadline(60):
        next(it)
        before = main_wakeups(it)
        for _ in range(3):
            next(it)
        return main_wakeups(it) - before


@pytest.mark.skipif(len(CPUS) < 2, reason="needs a CPU to spare beside one worker")
def test_a_loader_with_a_cpu_to_spare_is_not_woken_for_its_batches(monkeypatch):
    # a spin that outlasts a 0.15 s batch, so that a loaded box cannot end it early
    monkeypatch.setattr(main_spin, "MAIN_SPIN_NS", 5_000_000_000)
    loader = fastloader.DataLoader(ds.SlowDataset(n=8, delay=0.15), batch_size=1,
                                   num_workers=1, persistent_workers=True)
    assert wakeups_over_three_slow_batches(loader) == 0

    monkeypatch.setenv("FASTLOADER_MAIN_SPIN", "0")
    loader = fastloader.DataLoader(ds.SlowDataset(n=8, delay=0.15), batch_size=1,
                                   num_workers=1, persistent_workers=True)
    assert wakeups_over_three_slow_batches(loader) >= 2   # asleep for (nearly) each


def spin_in_child(cpus, env=None, workers=(1, 2), cgroup_procs=None):
    """main_spin_ns(w) for each w, in a fresh interpreter on `cpus` (and in a
    cgroup, where `cgroup_procs` names its cgroup.procs file)."""
    def place():
        os.sched_setaffinity(0, cpus)
        if cgroup_procs is not None:
            with open(cgroup_procs, "w") as f:
                f.write(str(os.getpid()))
    code = ("import sys; from fastloader.main_spin import main_spin_ns; "
            "print(*[main_spin_ns(int(w)) for w in sys.argv[1:]])")
    child_env = {k: v for k, v in os.environ.items()
                 if k not in ("LOCAL_WORLD_SIZE", "FASTLOADER_MAIN_SPIN")}
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), ROOT])
    out = subprocess.run([sys.executable, "-c", code, *map(str, workers)], env=child_env,
                         preexec_fn=place, capture_output=True, text=True, timeout=120,
                         check=True)
    return [int(v) for v in out.stdout.split()]


def test_one_usable_cpu_never_spins():
    assert spin_in_child(CPUS[:1]) == [0, 0]


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two usable CPUs")
def test_two_cpus_spin_beside_one_worker_only():
    assert spin_in_child(CPUS[:2]) == [SPIN, 0]


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two usable CPUs")
@pytest.mark.parametrize("env", [{"LOCAL_WORLD_SIZE": "2"}, {"FASTLOADER_MAIN_SPIN": "0"}],
                         ids=["two-ranks-on-the-node", "turned-off"])
def test_other_ranks_on_the_node_or_the_switch_stop_the_spin(env):
    assert spin_in_child(CPUS[:2], env) == [0, 0]


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_the_tightest_cgroup_v2_quota_on_the_way_up_counts(tmp_path):
    write(tmp_path / "proc", "0::/job/step\n")
    write(str(tmp_path / "fs" / "job" / "cpu.max"), "150000 100000\n")
    write(str(tmp_path / "fs" / "job" / "step" / "cpu.max"), "max 100000\n")
    assert main_spin.cgroup_cpu_limit(str(tmp_path / "proc"), str(tmp_path / "fs")) == 1.5
    write(str(tmp_path / "fs" / "job" / "cpu.max"), "max 100000\n")
    assert main_spin.cgroup_cpu_limit(str(tmp_path / "proc"), str(tmp_path / "fs")) is None


def test_a_cgroup_v1_cfs_quota_counts(tmp_path):
    write(tmp_path / "proc", "4:memory:/m\n2:cpu,cpuacct:/pod/c\n0::/\n")
    base = tmp_path / "fs" / "cpu,cpuacct" / "pod"
    write(str(base / "cpu.cfs_quota_us"), "50000\n")
    write(str(base / "cpu.cfs_period_us"), "100000\n")
    write(str(base / "c" / "cpu.cfs_quota_us"), "-1\n")
    write(str(base / "c" / "cpu.cfs_period_us"), "100000\n")
    assert main_spin.cgroup_cpu_limit(str(tmp_path / "proc"), str(tmp_path / "fs")) == 0.5


def test_unreadable_or_garbled_cgroup_files_mean_no_quota(tmp_path):
    assert main_spin.cgroup_cpu_limit(str(tmp_path / "missing"), str(tmp_path)) is None
    write(tmp_path / "proc", "0::/a\n")
    write(str(tmp_path / "fs" / "a" / "cpu.max"), "lots\n")
    assert main_spin.cgroup_cpu_limit(str(tmp_path / "proc"), str(tmp_path / "fs")) is None


def _cpu_cgroup_with_one_cpu():
    """A real cgroup (v2, or v1's cpu controller) allowing one CPU, or None where
    this process may not make one. Returns (directory, its cgroup.procs)."""
    name = f"fastloader-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    for base, files in (("/sys/fs/cgroup", {"cpu.max": "100000 100000"}),
                        ("/sys/fs/cgroup/cpu", {"cpu.cfs_period_us": "100000",
                                                "cpu.cfs_quota_us": "100000"})):
        path = os.path.join(base, name)
        if not os.path.exists(os.path.join(base, "cgroup.procs")):
            continue   # not a cgroup hierarchy (v1 mounts a tmpfs at the top)
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            for file, value in files.items():
                with open(os.path.join(path, file), "w") as f:
                    f.write(value)
            return path, os.path.join(path, "cgroup.procs")
        except OSError:
            os.rmdir(path)
    return None


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two usable CPUs")
def test_a_real_cgroup_quota_of_one_cpu_stops_the_spin():
    made = _cpu_cgroup_with_one_cpu()
    if made is None:
        pytest.skip("cannot make a cgroup here (not root, or no cpu controller)")
    path, procs = made
    try:
        assert spin_in_child(CPUS[:2], cgroup_procs=procs) == [0, 0]
    finally:
        os.rmdir(path)   # the child has exited: the cgroup is empty
