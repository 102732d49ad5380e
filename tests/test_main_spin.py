"""The main process spins for its next batch only where a CPU is spare beside the
workers of every loader it runs (and the other ranks' on this node): then the
workers never pay for waking it. Where the workers use every CPU, a cgroup quota
says fewer, another loader runs, or FASTLOADER_MAIN_SPIN=0, it sleeps as before."""
import gc
import glob
import os
import subprocess
import sys
import time
import uuid

import pytest

import fastloader
from fastloader import cgroup_cpus, main_spin, pool, reaper
from fastloader.worker_process import WorkerProcess
from tests.support import datasets as ds
from tests.support.helpers import deadline, in_forked_child, settle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPUS = sorted(os.sched_getaffinity(0))
SPIN = main_spin.MAIN_SPIN_NS
# what launchers set: a test's child must not inherit the runner's
RANK_VARIABLES = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                  "MPI_LOCALNRANKS", "WORLD_SIZE", "RANK", "FASTLOADER_MAIN_SPIN")
CGROUP_PREFIX = "fastloader-test-"

two_cpus_no_quota = pytest.mark.skipif(
    len(CPUS) < 2 or cgroup_cpus.cpu_quota() is not None,
    reason="needs two usable CPUs and no cgroup CPU quota")


def main_wakeups(it):
    return sum(w["main_wakeups"] for w in it.stats(memory=False)["workers"])


def slow_loader():
    """One worker, each batch 0.15 s of its time."""
    return fastloader.DataLoader(ds.SlowDataset(n=8, delay=0.15), batch_size=1,
                                 num_workers=1, persistent_workers=True)


def wakeups_over_three_slow_batches(*loaders):
    """The workers' wake-ups of the main process while it waits for batches 2-4
    (the first includes the workers' start), the loaders iterated side by side."""
    its = [iter(loader) for loader in loaders]
    with deadline(60):
        for it in its:
            next(it)
        before = sum(main_wakeups(it) for it in its)
        for _ in range(3):
            for it in its:
                next(it)
        return sum(main_wakeups(it) for it in its) - before


@pytest.fixture
def long_spin(monkeypatch):
    """A spin that outlasts a 0.15 s batch, so that a loaded box cannot end it
    early; a plain environment (no launcher variables, the spin not turned off),
    and no other test's workers still counted."""
    settle()
    for name in RANK_VARIABLES + main_spin._LAUNCHER_PARENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(main_spin, "MAIN_SPIN_NS", 5_000_000_000)
    if main_spin.MainSpin().ns(pool.live_workers() + 1) == 0:
        pytest.skip("no CPU to spare beside one worker here")


def test_a_loader_with_a_cpu_to_spare_is_not_woken_for_its_batches(long_spin, monkeypatch):
    assert wakeups_over_three_slow_batches(slow_loader()) == 0
    monkeypatch.setenv("FASTLOADER_MAIN_SPIN", "0")
    assert wakeups_over_three_slow_batches(slow_loader()) >= 2   # asleep for (nearly) each


@two_cpus_no_quota
def test_a_second_loaders_workers_take_the_spare_cpu(long_spin, monkeypatch):
    """Two 1-worker loaders side by side on 2 CPUs (zip, a combined loader): their
    workers use both CPUs, so no main-process wait spins. (A spinning main process
    is woken 0 times; a sleeping one at least once per round, for the later of the
    two batches.)"""
    monkeypatch.setattr(main_spin, "_affinity", lambda pid=0: 2)   # as on 2 CPUs, wherever run
    assert wakeups_over_three_slow_batches(slow_loader(), slow_loader()) >= 2


def alive(pid):
    try:
        os.kill(pid, 0)   # a zombie, exited but not reaped, still counts
    except ProcessLookupError:
        return False
    return True


def test_live_workers_count_a_pool_until_it_is_reaped():
    settle()
    base = pool.live_workers()
    loader = fastloader.DataLoader(ds.TensorLabelDataset(16), batch_size=4, num_workers=2)
    it = iter(loader)
    assert pool.live_workers() == base + 2
    with deadline(60):
        list(it)
    # the epoch's end retires the pool: the reaper thread reaps it shortly
    give_up = time.monotonic() + 60
    while pool.live_workers() != base and time.monotonic() < give_up:
        time.sleep(0.05)
    assert pool.live_workers() == base

    it = iter(fastloader.DataLoader(ds.TensorLabelDataset(16), batch_size=4, num_workers=1,
                                    persistent_workers=True))
    next(it)
    assert pool.live_workers() == base + 1
    it._shutdown_workers()
    assert pool.live_workers() == base
    del it
    gc.collect()
    assert pool.live_workers() == base   # counted off once, not again when collected

    # an iterator collected in a reference cycle hands its pool to the reaper: its
    # workers count until reaped, not from the collection on
    it = iter(fastloader.DataLoader(ds.TensorLabelDataset(16), batch_size=4, num_workers=2,
                                    persistent_workers=True))
    next(it)
    pids = it._pool.pids
    it.cycle = it
    del it
    gc.collect()
    counted = pool.live_workers()
    running = [pid for pid in pids if alive(pid)]   # looked at after the count
    assert counted >= base + len(running), (counted, base, running)
    settle()
    assert pool.live_workers() == base


def started_pool_iterator(monkeypatch, num_workers=2):
    settle()
    assert reaper.wait_idle(30)
    base = pool.live_workers()
    it = iter(fastloader.DataLoader(ds.TensorLabelDataset(16), batch_size=4,
                                    num_workers=num_workers, persistent_workers=True))
    next(it)
    assert pool.live_workers() == base + num_workers
    return it, base


def test_an_interrupted_shutdown_leaves_the_reaping_and_the_count_to_the_reaper(monkeypatch):
    it, base = started_pool_iterator(monkeypatch)
    real_join = WorkerProcess.join
    calls = []

    def join_interrupted_once(self, timeout=None):
        if not calls:
            calls.append(self.pid)
            raise KeyboardInterrupt   # a second Ctrl-C while the first one's shutdown waits
        return real_join(self, timeout)

    monkeypatch.setattr(WorkerProcess, "join", join_interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        it._pool.shutdown()
    monkeypatch.setattr(WorkerProcess, "join", real_join)
    settle()   # the reaper reaps the workers (no zombie: see conftest) and counts them off
    assert pool.live_workers() == base


def test_a_pool_the_reaper_gives_up_on_is_counted_off(monkeypatch):
    it, base = started_pool_iterator(monkeypatch, num_workers=1)
    procs = list(it._pool.procs)

    def step_fails(self, now):
        raise RuntimeError("a step that keeps failing")

    monkeypatch.setattr(pool.WorkerPool, "step", step_fails)
    channels = list(it._pool.channels)
    fds = {fd for ch in channels for fd in ch.main_fds() if fd >= 0}
    assert fds and fds <= pool.main_fds()
    it._pool.retire(timeout=5.0)
    assert reaper.wait_idle(30)
    assert pool.live_workers() == base
    # its channels are released: no number of theirs is left for a later worker
    # to close (by then it may be a dataset's file)
    assert all(ch.closed for ch in channels) and not fds & pool.main_fds()
    monkeypatch.undo()
    for proc in procs:   # nobody reaps it now: do it here (no zombie)
        proc.join(30)


class InterruptedChannel:
    """A channel whose `method` is interrupted by a Ctrl-C (once)."""

    def __init__(self, channel, method):
        self.__dict__.update(_channel=channel, _method=method)

    def __getattr__(self, name):
        if name == self._method:
            def interrupted(*args):
                self.__dict__["_method"] = None
                raise KeyboardInterrupt
            return interrupted
        return getattr(self._channel, name)

    def __setattr__(self, name, value):
        setattr(self._channel, name, value)


@pytest.mark.parametrize("how", ["shutdown", "retire"])
def test_a_ctrl_c_while_the_workers_are_told_to_stop_leaves_them_to_the_reaper(
        monkeypatch, how):
    it, base = started_pool_iterator(monkeypatch)
    workers = it._pool
    real = workers.channels[1]
    workers.channels[1] = InterruptedChannel(real, "put_task")
    with pytest.raises(KeyboardInterrupt):
        workers.shutdown() if how == "shutdown" else workers.retire(timeout=5.0)
    workers.channels[1] = real
    # the untold worker gets SIGTERM from the reaper at once; both are reaped
    # (no zombie: see conftest) and counted off
    settle()
    assert reaper.wait_idle(30)
    assert pool.live_workers() == base
    assert all(proc.has_exited() for proc in workers.procs)


def test_an_interrupted_teardown_of_an_iterator_still_stops_its_workers(monkeypatch):
    it, base = started_pool_iterator(monkeypatch)

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(it, "_leave_state_with_loader", interrupted)
    with pytest.raises(KeyboardInterrupt):
        it._shutdown_workers()
    settle()
    assert pool.live_workers() == base


def test_an_interrupted_release_of_the_channels_is_finished_by_the_next(monkeypatch):
    it, base = started_pool_iterator(monkeypatch)
    workers = it._pool
    channels = list(workers.channels)
    workers.channels[1] = InterruptedChannel(channels[1], "close")
    with pytest.raises(KeyboardInterrupt):
        workers._release_channels()
    assert channels[0].closed and not channels[1].closed
    workers.channels[1] = channels[1]
    it._shutdown_workers()
    assert all(ch.closed for ch in channels)
    assert not {fd for ch in channels for fd in ch.main_fds()} & pool.main_fds() - {-1}
    assert pool.live_workers() == base


def test_a_worker_process_whose_close_was_interrupted_counts_as_closed():
    """A Ctrl-C between multiprocessing's close() and fastloader's leaves the
    multiprocessing object closed: the reaper then finishes it instead of
    failing on it until it gives up."""
    it = iter(fastloader.DataLoader(ds.TensorLabelDataset(8), batch_size=4, num_workers=1,
                                    persistent_workers=True))
    next(it)
    proc = it._pool.procs[0]
    it._shutdown_workers()   # joined and closed: undo our half of the close
    assert proc.reap_and_close()
    code = proc.exitcode
    proc._closed = False
    assert proc.has_exited() and proc.reap_and_close()
    assert proc.exitcode == code and not proc.is_alive()
    proc.close()


def test_a_worker_process_interrupted_inside_multiprocessings_close_counts_as_closed():
    it = iter(fastloader.DataLoader(ds.TensorLabelDataset(8), batch_size=4, num_workers=1,
                                    persistent_workers=True))
    next(it)
    proc = it._pool.procs[0]
    it._shutdown_workers()
    code = proc.exitcode
    # where CPython's close() had dropped its Popen but not yet marked itself closed
    proc._closed = False
    proc._proc._closed = False
    assert proc.has_exited() and proc.reap_and_close()
    assert proc.exitcode == code and proc.exit_fd() is None


def spin_in_child(cpus, env=None, workers=(1, 2), pin_memory=False, cgroup_procs=None):
    """main_spin_ns(w) for each w, in a fresh interpreter on `cpus` (and in a
    cgroup, where `cgroup_procs` names its cgroup.procs file). The child places
    itself: no preexec_fn in a process with threads."""
    code = ("import os, sys\n"
            "cpus, procs, pin = sys.argv[1], sys.argv[2], sys.argv[3] == '1'\n"
            "os.sched_setaffinity(0, [int(c) for c in cpus.split(',')])\n"
            "if procs:\n"
            "    with open(procs, 'w') as f: f.write(str(os.getpid()))\n"
            "from fastloader.main_spin import main_spin_ns\n"
            "print(*[main_spin_ns(int(w), pin) for w in sys.argv[4:]])\n")
    child_env = {k: v for k, v in os.environ.items()
                 if k not in RANK_VARIABLES + main_spin._LAUNCHER_PARENT_VARIABLES}
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), ROOT])
    args = [",".join(map(str, cpus)), cgroup_procs or "", "1" if pin_memory else "0",
            *map(str, workers)]
    out = subprocess.run([sys.executable, "-c", code, *args], env=child_env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [int(v) for v in out.stdout.split()]


def test_one_usable_cpu_never_spins():
    assert spin_in_child(CPUS[:1]) == [0, 0]


@two_cpus_no_quota
def test_two_cpus_spin_beside_one_worker_only():
    assert spin_in_child(CPUS[:2]) == [SPIN, 0]


@two_cpus_no_quota
def test_a_pin_thread_takes_the_spare_cpu():
    assert spin_in_child(CPUS[:2], pin_memory=True) == [0, 0]


@two_cpus_no_quota
@pytest.mark.parametrize("env", [{"LOCAL_WORLD_SIZE": "2"}, {"SLURM_NTASKS_PER_NODE": "2"},
                                 {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
                                 {"WORLD_SIZE": "2", "RANK": "1"},
                                 {"FASTLOADER_MAIN_SPIN": "0"}],
                         ids=["torchrun", "slurm", "openmpi", "no-local-size", "turned-off"])
def test_other_ranks_on_the_node_or_the_switch_stop_the_spin(env):
    assert spin_in_child(CPUS[:2], env) == [0, 0]


@two_cpus_no_quota
def test_one_rank_per_node_of_a_bigger_job_still_spins():
    assert spin_in_child(CPUS[:2], {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "8",
                                    "RANK": "3"}) == [SPIN, 0]


FAKE_PARENT = 424242


def rule_on(monkeypatch, own, parents, ranks, quota=None, launcher="TORCHELASTIC_RUN_ID",
            parent_has=(), parent_pid=FAKE_PARENT, first_parent=None, container=False,
            proc_ours=True, asked=None):
    """main_spin_ns for 1, 2, 4 and 8 workers, where this process may use `own`
    CPUs and its parent `parents`, with `ranks` ranks on the node, a cgroup quota
    of `quota` CPUs, `launcher` the variable(s) its launcher set (None: none),
    and `parent_has` the variables in the parent's own environment. The parent is
    `parent_pid` (at import: `first_parent`, by default the same), in a PID
    namespace of its own where `container`, /proc numbering processes as we do
    where `proc_ours`; `asked` collects the pids whose environment or CPUs were
    read."""
    asked = [] if asked is None else asked
    monkeypatch.setattr(main_spin, "_parent_pid", lambda: parent_pid)
    monkeypatch.setattr(main_spin, "_first_parent",
                        parent_pid if first_parent is None else first_parent)
    monkeypatch.setattr(main_spin, "_in_child_pid_namespace", lambda: container)
    monkeypatch.setattr(main_spin, "_proc_is_ours", lambda: proc_ours)
    monkeypatch.setattr(main_spin, "_environ_names",
                        lambda pid: asked.append(pid) or set(parent_has))
    monkeypatch.setattr(main_spin, "_affinity",
                        lambda pid=0: own if pid == 0 else asked.append(pid) or (
                            parents if pid == parent_pid else None))
    monkeypatch.setattr(main_spin, "cpu_quota", lambda: quota)
    for name in RANK_VARIABLES + main_spin._LAUNCHER_PARENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    for name in (launcher,) if isinstance(launcher, str) else launcher or ():
        monkeypatch.setenv(name, "1")
    return [main_spin.main_spin_ns(w) for w in (1, 2, 4, 8)]


@pytest.mark.parametrize("launcher", ["TORCHELASTIC_RUN_ID", "SLURM_STEP_ID"])
def test_ranks_bound_to_cpus_of_their_own_are_not_divided_again(monkeypatch, launcher):
    # srun --cpu-bind: 8 ranks, each on 8 of the launcher's 64 CPUs: 7 workers fit
    assert rule_on(monkeypatch, own=8, parents=64, ranks=8,
                   launcher=launcher) == [SPIN, SPIN, SPIN, 0]


def test_ranks_sharing_their_cpus_divide_them(monkeypatch):
    # torchrun under taskset -c 0-7 on a bigger box: 2 ranks share the same 8 CPUs
    assert rule_on(monkeypatch, own=8, parents=8, ranks=2) == [SPIN, SPIN, 0, 0]


def test_without_a_launcher_that_is_every_ranks_parent_the_parent_is_not_asked(monkeypatch):
    # Lightning's launcher, from a shell taskset to 8 of 64 CPUs: rank 0's parent is
    # the shell, which may use all 64; the 4 ranks share rank 0's 8
    assert rule_on(monkeypatch, own=8, parents=64, ranks=4, launcher=None) == [SPIN, 0, 0, 0]


def test_a_launcher_that_cannot_be_asked_counts_as_our_own_cpus(monkeypatch):
    assert rule_on(monkeypatch, own=8, parents=None, ranks=2) == [SPIN, SPIN, 0, 0]


def test_a_launcher_variable_the_parent_carries_too_was_inherited_not_set_for_us(monkeypatch):
    # srun --pty bash, then taskset -c 0-7 and 4 ranks: bash is no launcher
    assert rule_on(monkeypatch, own=8, parents=32, ranks=4, launcher="SLURM_STEP_ID",
                   parent_has=["SLURM_STEP_ID"]) == [SPIN, 0, 0, 0]


def test_a_processs_environment_names_are_read_from_proc():
    names = main_spin._environ_names(os.getpid())
    assert names is not None and "PATH" in names
    assert main_spin._environ_names(2 ** 22 + 12345) is None   # no such process


@pytest.mark.skipif(os.geteuid() != 0, reason="plays a second user with setuid (root only)")
def test_another_users_process_shows_no_environment_names():
    """slurmstepd runs as root: a rank cannot read its environment, and that
    makes it no shell of the rank's user (so a launcher)."""
    me = os.getpid()

    def as_nobody():
        os.setuid(65534)
        return main_spin._environ_names(me)

    got = in_forked_child(as_nobody)
    assert got == set(), got


def test_a_launcher_started_inside_another_counts(monkeypatch):
    # srun torchrun: the agent carries SLURM_STEP_ID, not TORCHELASTIC_RUN_ID
    assert rule_on(monkeypatch, own=8, parents=64, ranks=8,
                   launcher=("TORCHELASTIC_RUN_ID", "SLURM_STEP_ID"),
                   parent_has=["SLURM_STEP_ID"]) == [SPIN, SPIN, SPIN, 0]


def test_a_launcher_that_is_a_containers_first_process_counts(monkeypatch):
    # docker run ... torchrun: the agent is PID 1 in the container's namespace
    assert rule_on(monkeypatch, own=8, parents=64, ranks=8, parent_pid=1,
                   container=True) == [SPIN, SPIN, SPIN, 0]


def test_init_that_took_over_from_a_dead_launcher_is_no_launcher(monkeypatch):
    """torchrun killed, its ranks re-parented to init: init lacks the launcher's
    variables like a launcher, but its CPUs are the whole machine's. 8 ranks share
    8 CPUs: none spins."""
    asked = []
    # the machine's own init (the first PID namespace)
    assert rule_on(monkeypatch, own=8, parents=64, ranks=8, parent_pid=1,
                   asked=asked) == [0, 0, 0, 0]
    # a container's init (tini) that took over: PID 1 was not our parent at first
    assert rule_on(monkeypatch, own=8, parents=64, ranks=8, parent_pid=1,
                   first_parent=FAKE_PARENT, container=True, asked=asked) == [0, 0, 0, 0]
    # a subreaper (systemd --user, tini -s) that took over
    assert rule_on(monkeypatch, own=8, parents=64, ranks=8, first_parent=FAKE_PARENT + 1,
                   asked=asked) == [0, 0, 0, 0]
    # a parent outside our PID namespace (getppid() 0): nothing to ask
    assert rule_on(monkeypatch, own=8, parents=64, ranks=8, parent_pid=0,
                   asked=asked) == [0, 0, 0, 0]
    assert asked == []


def test_a_proc_of_another_pid_namespace_is_not_asked(monkeypatch):
    """unshare --pid without --mount-proc: /proc/<our ppid> is another process
    (its /proc/1 the machine's init), so the parent's CPUs cannot be read there."""
    asked = []
    assert rule_on(monkeypatch, own=8, parents=64, ranks=8, proc_ours=False,
                   asked=asked) == [0, 0, 0, 0]
    assert rule_on(monkeypatch, own=8, parents=64, ranks=8, parent_pid=1, container=True,
                   proc_ours=False, asked=asked) == [0, 0, 0, 0]
    assert asked == []


def test_this_processs_pid_namespace_is_read_right():
    initial = os.readlink("/proc/self/ns/pid") == "pid:[4026531836]"   # PROC_PID_INIT_INO
    assert main_spin._in_child_pid_namespace() == (not initial)


def test_the_parent_at_import_is_remembered_per_process():
    """A forked child (a rank started by a launcher that forks) remembers its own
    parent, not the parent of the process it was forked from."""
    assert in_forked_child(lambda: main_spin._first_parent) == os.getpid()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/unshare"),
                    reason="needs root and unshare to make a PID namespace")
def test_a_pid_namespace_of_its_own_and_its_proc_are_told_apart():
    """In a PID namespace of its own with a /proc of its own (a container) PID 1
    may be the launcher; with the outer /proc (unshare --pid alone) /proc/<ppid>
    is another process, and the parent is not asked."""
    probe = [sys.executable, "-c",
             "import sys; sys.path[:0] = ['python', '.']; from fastloader import main_spin; "
             "print(main_spin._in_child_pid_namespace(), main_spin._proc_is_ours())"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["python", "."]))

    def run(*unshare):
        return subprocess.run([*unshare, *probe], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)

    own_proc = run("unshare", "--pid", "--fork", "--mount-proc")
    if own_proc.returncode != 0 and "unshare" in own_proc.stderr:
        pytest.skip(f"no PID namespace here: {own_proc.stderr.strip()}")
    assert own_proc.stdout.split() == ["True", "True"], own_proc.stderr
    outer_proc = run("unshare", "--pid", "--fork")
    assert outer_proc.stdout.split() == ["True", "False"], outer_proc.stderr
    if os.readlink("/proc/self/ns/pid") == "pid:[4026531836]":   # PROC_PID_INIT_INO
        here = run()
        assert here.stdout.split() == ["False", "True"], here.stderr


def test_a_quota_below_the_shared_cpus_leaves_one_cpu_of_it_and_one_above_does_not(
        monkeypatch):
    assert rule_on(monkeypatch, own=8, parents=8, ranks=1, quota=4.0) == [SPIN, SPIN, 0, 0]
    assert rule_on(monkeypatch, own=2, parents=2, ranks=1, quota=2.0) == [SPIN, 0, 0, 0]
    assert rule_on(monkeypatch, own=2, parents=2, ranks=1, quota=1.5) == [0, 0, 0, 0]
    # ranks bound to 8 CPUs each of 64, all under a 32-CPU quota: (32 - 1) / 8 each
    assert rule_on(monkeypatch, own=8, parents=64, ranks=8, quota=32.0) == [SPIN, SPIN, 0, 0]


def write(path, text, mode="w"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(text)


def mountinfo_line(mount_root, point, fstype, superoptions):
    return f"30 20 0:27 {mount_root} {point} rw,relatime - {fstype} {fstype} {superoptions}\n"


def limit(tmp_path):
    return cgroup_cpus.cpu_quota(str(tmp_path / "cgroup"), str(tmp_path / "mountinfo"))


def test_the_tightest_cgroup_v2_quota_on_the_way_up_counts(tmp_path):
    fs = tmp_path / "fs"
    write(tmp_path / "cgroup", "0::/job/step\n")
    write(tmp_path / "mountinfo", mountinfo_line("/", fs, "cgroup2", "rw"))
    write(str(fs / "job" / "cpu.max"), "150000 100000\n")
    write(str(fs / "job" / "step" / "cpu.max"), "max 100000\n")
    assert limit(tmp_path) == 1.5
    write(str(fs / "job" / "cpu.max"), "max 100000\n")
    assert limit(tmp_path) is None


@pytest.mark.parametrize("mount_dir", ["cpu,cpuacct", "cpuacct,cpu", "elsewhere"])
def test_a_cgroup_v1_cfs_quota_counts_wherever_cpu_is_mounted(tmp_path, mount_dir):
    point = tmp_path / "fs" / mount_dir
    write(tmp_path / "cgroup", "4:memory:/m\n2:cpu,cpuacct:/pod/c\n0::/\n")
    write(tmp_path / "mountinfo",
          mountinfo_line("/", tmp_path / "fs" / "memory", "cgroup", "rw,memory")
          + mountinfo_line("/", point, "cgroup", "rw,cpu,cpuacct"))
    write(str(point / "pod" / "cpu.cfs_quota_us"), "50000\n")
    write(str(point / "pod" / "cpu.cfs_period_us"), "100000\n")
    write(str(point / "pod" / "c" / "cpu.cfs_quota_us"), "-1\n")
    write(str(point / "pod" / "c" / "cpu.cfs_period_us"), "100000\n")
    assert limit(tmp_path) == 0.5


def test_a_container_without_its_own_cgroup_namespace_finds_its_quota(tmp_path):
    """/proc/self/cgroup shows the full path; the container's mount starts below."""
    point = tmp_path / "fs" / "cpu"
    write(tmp_path / "cgroup", "3:cpu:/docker/abc/inner\n")
    write(tmp_path / "mountinfo", mountinfo_line("/docker/abc", point, "cgroup", "rw,cpu"))
    write(str(point / "inner" / "cpu.cfs_quota_us"), "50000\n")
    write(str(point / "inner" / "cpu.cfs_period_us"), "100000\n")
    assert limit(tmp_path) == 0.5


def test_unreadable_odd_or_garbled_cgroup_files_mean_no_quota(tmp_path):
    assert limit(tmp_path) is None   # no such files
    fs = tmp_path / "fs"
    write(tmp_path / "mountinfo", mountinfo_line("/", fs, "cgroup2", "rw") + "garbage\n")
    write(str(tmp_path / "cgroup"), b"0::/job\xff/step\n", mode="wb")   # not UTF-8
    assert limit(tmp_path) is None
    write(tmp_path / "cgroup", "0::/a\n")
    write(str(fs / "a" / "cpu.max"), "lots\n")
    assert limit(tmp_path) is None


def test_this_processs_quota_is_found_again_only_when_stale_or_moved(tmp_path, monkeypatch):
    """Every iter() asks (main_spin.py); reading mountinfo and a file per level each
    time cost ~70 us. The answer is kept for _KEEP_S seconds, and only while this
    process stays in the same cgroup."""
    fs = tmp_path / "fs"
    write(tmp_path / "cgroup", "0::/job\n")
    write(tmp_path / "mountinfo", mountinfo_line("/", fs, "cgroup2", "rw"))
    write(str(fs / "job" / "cpu.max"), "150000 100000\n")
    write(str(fs / "other" / "cpu.max"), "300000 100000\n")
    monkeypatch.setattr(cgroup_cpus, "_SELF_CGROUP", str(tmp_path / "cgroup"))
    monkeypatch.setattr(cgroup_cpus, "_SELF_MOUNTINFO", str(tmp_path / "mountinfo"))
    monkeypatch.setattr(cgroup_cpus, "_kept", None)
    now = [1000.0]
    monkeypatch.setattr(cgroup_cpus, "_monotonic", lambda: now[0])
    searches = []
    real_mounts = cgroup_cpus._mounts
    monkeypatch.setattr(cgroup_cpus, "_mounts",
                        lambda *a: searches.append(1) or real_mounts(*a))

    assert cgroup_cpus.cpu_quota() == 1.5 and len(searches) == 1
    write(str(fs / "job" / "cpu.max"), "250000 100000\n")   # resized meanwhile
    now[0] += cgroup_cpus._KEEP_S / 2
    assert cgroup_cpus.cpu_quota() == 1.5 and len(searches) == 1     # kept
    now[0] += cgroup_cpus._KEEP_S
    assert cgroup_cpus.cpu_quota() == 2.5 and len(searches) == 2     # stale: found again
    write(tmp_path / "cgroup", "0::/other\n")                         # moved
    assert cgroup_cpus.cpu_quota() == 3.0 and len(searches) == 3
    # explicit files are never the process's own: always read
    assert limit(tmp_path) == 3.0 and len(searches) == 4


def _sweep_test_cgroups(base):
    """Test cgroups a killed run left behind (empty once its child exited)."""
    for path in glob.glob(os.path.join(base, CGROUP_PREFIX + "*")):
        try:
            os.rmdir(path)
        except OSError:
            pass


def _cpu_cgroup_with_one_cpu():
    """A real cgroup (v2, or v1's cpu controller) allowing one CPU, or None where
    this process may not make one. Returns (directory, its cgroup.procs)."""
    name = f"{CGROUP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    for base, files in (("/sys/fs/cgroup", {"cpu.max": "100000 100000"}),
                        ("/sys/fs/cgroup/cpu", {"cpu.cfs_period_us": "100000",
                                                "cpu.cfs_quota_us": "100000"})):
        if not os.path.exists(os.path.join(base, "cgroup.procs")):
            continue   # not a cgroup hierarchy (v1 mounts a tmpfs at the top)
        _sweep_test_cgroups(base)
        path = os.path.join(base, name)
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


@two_cpus_no_quota
def test_a_real_cgroup_quota_of_one_cpu_stops_the_spin():
    made = _cpu_cgroup_with_one_cpu()
    if made is None:
        pytest.skip("cannot make a cgroup here (not root, or no cpu controller)")
    path, procs = made
    try:
        assert spin_in_child(CPUS[:2], cgroup_procs=procs) == [0, 0]
    finally:
        os.rmdir(path)   # the child has exited: the cgroup is empty
