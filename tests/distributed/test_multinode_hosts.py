"""Two "hosts" on this machine, one torchrun job across them.

Each host is a network namespace (joined to the other by a veth pair, addresses
in a private subnet that exists only inside the two namespaces) with its own UTS
namespace (hostname), PID namespace and /proc. On them runs
`torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d` (gloo), and the
test checks, on all 4 ranks: per-step losses equal torch's DataLoader, the
ranks' samples are disjoint and cover the dataset, share_on_node builds one
index per host, and after one rank is SIGKILLed mid-epoch and torchrun restarts
the group (--max-restarts=1), resuming from loader.state_dict() yields exactly
the batches of the uninterrupted run. Needs root and iproute2's `ip`; skips,
saying why, where namespaces cannot be made."""
import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUBNET = "10.213.77"   # private, and only ever configured inside the two namespaces
IFNAME = "mnet0"
RDZV_PORT = 29477
STEPS_PER_EPOCH, EPOCHS, WORLD = 4, 2, 4   # tests/support/multinode_train.py
KILL_AFTER = 5


def sh(*cmd, check=True):
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


NS_PREFIX = "fl-mn-"


def _kill_processes_in(ns):
    """SIGKILL every process in network namespace `ns` (a killed run's torchrun
    trees would otherwise outlive the deleted namespace)."""
    for _ in range(20):
        pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()
                if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _delete_namespace(ns):
    _kill_processes_in(ns)
    sh("ip", "netns", "del", ns, check=False)


@contextlib.contextmanager
def _dead_run_cleanup_lock():
    """Held around each removal of dead runs' namespaces, and by the test that plants
    one and removes it: under pytest -n each test process runs the `jobs` fixture's
    removal, which could take the planted namespace before its process entered it."""
    with open("/tmp/fastloader-tests-netns-cleanup.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_namespaces_of_dead_runs():
    """A run killed outright (SIGKILL) could not delete its namespaces: they carry
    its pid, so a later run removes those whose process is gone, after killing
    whatever still runs in them."""
    listing = sh("ip", "netns", "list", check=False).stdout.split()
    for name in listing:
        parts = name.split("-")
        if name.startswith(NS_PREFIX) and len(parts) == 4 and parts[2].isdigit():
            pid = int(parts[2])
            if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
                _delete_namespace(name)


_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)


def _die_with_parent(parent):
    """preexec_fn: SIGKILL this child when the test process dies (even by SIGKILL),
    so no torchrun tree outlives it. unshare --kill-child passes it on to the PID
    namespace's init, whose death ends every process of the host."""
    if _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)   # cannot be tied to us, or already orphaned


def start_tree(cmd, **kwargs):
    """Popen in a new session that dies with this process."""
    parent = os.getpid()
    return subprocess.Popen(cmd, start_new_session=True,
                            preexec_fn=lambda: _die_with_parent(parent), **kwargs)


def _why_not():
    if os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs as root)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 util-linux)"
    name = f"flprobe{os.getpid()}"
    probe = sh("ip", "netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    try:
        inner = sh("ip", "netns", "exec", name, "unshare", "--uts", "--pid", "--fork",
                   "--mount", "--mount-proc", "--kill-child", "sh", "-c",
                   "hostname flprobe && mount --bind /etc/hosts /etc/hosts", check=False)
        if inner.returncode != 0:
            return f"cannot create UTS/PID namespaces here: {inner.stderr.strip()}"
    finally:
        sh("ip", "netns", "del", name, check=False)
    return None


class TwoHosts:
    """Two network namespaces joined by a veth pair; removed on every exit path."""

    def __init__(self, work_dir):
        tag = os.getpid()
        self.work_dir = work_dir
        self.ns = [f"{NS_PREFIX}{tag}-a", f"{NS_PREFIX}{tag}-b"]
        self.addr = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.hostname = [f"flhost-{tag}-a", f"flhost-{tag}-b"]
        self._veth = [f"fma{tag}"[:15], f"fmb{tag}"[:15]]

    def __enter__(self):
        try:
            for ns in self.ns:
                sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", self._veth[0], "netns", self.ns[0], "type", "veth",
               "peer", "name", self._veth[1], "netns", self.ns[1])
            for ns, veth, addr in zip(self.ns, self._veth, self.addr):
                sh("ip", "-n", ns, "link", "set", veth, "name", IFNAME)
                sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
                sh("ip", "-n", ns, "link", "set", IFNAME, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        # torchrun resolves its own hostname: each host sees both names in its
        # own /etc/hosts (bind-mounted in its mount namespace only)
        self.hosts_file = os.path.join(self.work_dir, "hosts")
        with open(self.hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n")
            for addr, name in zip(self.addr, self.hostname):
                f.write(f"{addr} {name}\n")
        return self

    def __exit__(self, *exc):
        for ns in self.ns:   # deleting a namespace deletes its end of the veth pair
            _delete_namespace(ns)

    def torchrun(self, host, args, env):
        """Start torchrun on `host` in its own UTS + PID namespace (so every
        process of the host dies with torchrun, pid 1 there)."""
        inner = (f"hostname {self.hostname[host]} && mount --bind {self.hosts_file} /etc/hosts"
                 f" && exec {sys.executable} -m "
                 f"torch.distributed.run {args}")
        cmd = ["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "--pid", "--fork",
               "--mount", "--mount-proc", "--kill-child", "sh", "-c", inner]
        return start_tree(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def run_job(hosts, mode, out_dir, timeout=240):
    """torchrun on both hosts; returns (exit codes, logs, seconds)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFNAME,
               PYTHONWARNINGS="ignore::UserWarning",
               # torch 2.13: a restarted round could otherwise get the previous
               # round's gloo addresses ("connectFullMesh: connection refused")
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    procs = []
    t0 = time.monotonic()
    try:
        for host in range(2):
            args = (f"--nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d "
                    f"--rdzv-endpoint={hosts.addr[0]}:{RDZV_PORT} --rdzv-id=fl{os.getpid()}{mode} "
                    f"--local-addr={hosts.addr[host]} --max-restarts=1 --monitor-interval=0.5 "
                    f"-m tests.support.multinode_train {mode} {out_dir}")
            procs.append(hosts.torchrun(host, args, env))
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs], logs, time.monotonic() - t0


def read(out_dir, mode):
    ranks = []
    for rank in range(WORLD):
        with open(os.path.join(out_dir, f"{mode}-{rank}.jsonl")) as f:
            ranks.append([json.loads(line) for line in f])
    return ranks


def one_index_per_host(starts, hosts):
    """The rank records of one attempt: every rank on its host's hostname and
    node, one builder per host, the host's other rank attached."""
    by_host = {}
    for s in starts:
        by_host.setdefault(s["host"], []).append(s)
    assert sorted(by_host) == sorted(hosts.hostname), by_host
    for host, ranks in by_host.items():
        assert len(ranks) == 2, ranks
        assert len({s["node"] for s in ranks}) == 1, f"{host}: ranks on two nodes"
        assert sum(s["built"] for s in ranks) == 1, f"{host}: {ranks}"
    assert len({s["node"] for s in starts}) == 2, "the two hosts were taken for one node"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    why_not = _why_not()
    if why_not:
        pytest.skip(why_not)
    with _dead_run_cleanup_lock():
        _remove_namespaces_of_dead_runs()
    out_dir = tmp_path_factory.mktemp("multinode")
    runs = {}
    with TwoHosts(str(out_dir)) as hosts:
        runs["routes"] = [sh("ip", "-n", ns, "route", "show").stdout for ns in hosts.ns]
        for mode in ("reference", "elastic"):
            codes, logs, seconds = run_job(hosts, mode, out_dir)
            assert codes == [0, 0], f"{mode}: torchrun exited {codes}\n" + \
                "\n----\n".join(log[-6000:] for log in logs)
            runs[mode] = read(out_dir, mode)
            print(f"{mode} job: {seconds:.1f} s")
    return hosts, runs


def test_two_hosts_reach_nothing_outside_their_subnet(jobs):
    """The job's traffic can only go between the two namespaces: each has one
    route, to the private subnet on the veth pair, and no default route."""
    _, runs = jobs
    for routes in runs["routes"]:
        lines = [line for line in routes.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"{SUBNET}.0/24 dev {IFNAME}"), routes


def steps(lines, loader):
    return [line for line in lines if line.get("loader") == loader]


def test_two_hosts_same_losses_and_batches_as_torch(jobs):
    _, runs = jobs
    for rank, lines in enumerate(runs["reference"]):
        th, fl = steps(lines, "torch"), steps(lines, "fastloader")
        assert len(th) == STEPS_PER_EPOCH * EPOCHS
        assert [s["seen"] for s in fl] == [s["seen"] for s in th], f"rank {rank}: batches"
        assert [s["loss"] for s in fl] == [s["loss"] for s in th], f"rank {rank}: losses"


def test_two_hosts_ranks_disjoint_and_cover(jobs):
    _, runs = jobs
    for epoch in range(EPOCHS):
        per_rank = [sorted(i for s in steps(lines, "fastloader") if s["epoch"] == epoch
                           for i in s["seen"]) for lines in runs["reference"]]
        everything = sorted(i for r in per_rank for i in r)
        assert everything == list(range(16 * WORLD)), f"epoch {epoch}: not a cover"
        assert len(set(everything)) == len(everything), f"epoch {epoch}: ranks overlap"


def test_two_hosts_one_index_per_host(jobs):
    hosts, runs = jobs
    one_index_per_host([lines[0] for lines in runs["reference"]], hosts)


def test_elastic_restart_resumes_exactly(jobs):
    hosts, runs = jobs
    reference = runs["reference"]
    for rank, lines in enumerate(runs["elastic"]):
        starts = [line for line in lines if "host" in line]
        assert len(starts) == 2, f"rank {rank}: expected 2 attempts, got {starts}"
        done = steps(lines, "fastloader")
        before = [s for s in done if not s["resumed"]]
        after = [s for s in done if s["resumed"]]
        assert len(before) == KILL_AFTER
        assert [s["step"] for s in after] == list(range(KILL_AFTER, STEPS_PER_EPOCH * EPOCHS))
        uninterrupted = steps(reference[rank], "fastloader")
        got = [s["seen"] for s in before[:KILL_AFTER] + after]
        assert got == [s["seen"] for s in uninterrupted], f"rank {rank}: batches after resume"
        for s, ref in zip(before[:KILL_AFTER] + after, uninterrupted):
            assert s["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-9), \
                f"rank {rank} step {s['step']}"
    starts_by_attempt = [[], []]
    for lines in runs["elastic"]:
        for i, s in enumerate(line for line in lines if "host" in line):
            starts_by_attempt[i].append(s)
    for attempt in starts_by_attempt:   # a restarted host builds its index again
        one_index_per_host(attempt, hosts)


# ---- no process outlives the test (review of branch lead) ---------------------------------------

def test_started_tree_dies_with_the_test_process():
    """A tree started like torchrun's (own session) is SIGKILLed when the process
    that started it is SIGKILLed (pytest killed by CI's timeout)."""
    code = ("import sys; from tests.distributed.test_multinode_hosts import start_tree; "
            "import subprocess as s; p = start_tree(['sleep', '600'], stdout=s.DEVNULL); "
            "print(p.pid, flush=True); sys.stdin.read()")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT]))
    stand_in = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(stand_in.stdout.readline())
        stand_in.kill()
        stand_in.wait(30)
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
            with open(f"/proc/{child}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break   # dead, waiting for init to reap it
            time.sleep(0.05)
        else:
            assert not os.path.exists(f"/proc/{child}"), "the tree outlived its starter"
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if stand_in.poll() is None:
            stand_in.kill()
        stand_in.communicate(timeout=30)   # reaps it, closes its pipes


def test_namespace_of_a_dead_run_is_removed_with_its_processes():
    why_not = _why_not()
    if why_not:
        pytest.skip(why_not)
    dead = next(p for p in range(4_000_000, 300, -1) if not os.path.exists(f"/proc/{p}"))
    ns = f"{NS_PREFIX}{dead}-z"
    with _dead_run_cleanup_lock():
        sh("ip", "netns", "add", ns)
        # what a run killed outright leaves: its namespace, and a process still in it
        orphan = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"],
                                  start_new_session=True)
        try:
            deadline = time.monotonic() + 20
            while not sh("ip", "netns", "pids", ns, check=False).stdout.split():
                assert time.monotonic() < deadline, "sleep never entered the namespace"
                time.sleep(0.05)
            _remove_namespaces_of_dead_runs()
            assert ns not in sh("ip", "netns", "list", check=False).stdout.split()
            assert orphan.wait(timeout=20) == -signal.SIGKILL
        finally:
            if orphan.poll() is None:
                orphan.kill()
                orphan.wait()
            sh("ip", "netns", "del", ns, check=False)
