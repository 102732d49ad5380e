"""sharing_strategy="file_system" on a shared machine: /dev/shm is world-writable, so
another local user can list it and create any name not taken yet. The main process
must map only what its own workers made, names must be unpredictable and a taken
name must never fail the loader; a worker that leaves its loop by an exception
delivers what it published, then its error; segment fds never get out of step;
a SIGKILLed process group's leftovers are swept (issue 12).

The second-user tests run as root (as CI does) and drop a forked child to `nobody`
to play the attacker; elsewhere they skip, saying why."""
import functools
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import traceback
import uuid

import pytest
import torch
from torch.utils.data import Dataset, default_collate

import fastloader
from fastloader import DataLoader, WorkerError, _core
from tests.support.helpers import (
    assert_same_batches,
    collect,
    deadline,
    is_gone,
    loopback_channels,
    unused_pid,
    wait_until,
)
from tests.support.private_shm import run_with_private_dev_shm

SHM = "/dev/shm"
NOBODY = 65534
STRATEGIES = ("file_system", "file_descriptor")
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="playing another local user needs root (to setuid to nobody)")


# ---- datasets (module level: importable by workers) -------------------------------------

class WorkerAbort(BaseException):
    """Not an Exception: it leaves the worker's loop instead of becoming a RES_ERROR."""


class SizedDataset(Dataset):
    """Item i: a float tensor of sizes[i] elements (a size above a slot grows the
    arena); item `abort_at` raises WorkerAbort."""

    def __init__(self, sizes, abort_at=None):
        self.sizes = list(sizes)
        self.abort_at = abort_at

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        if i == self.abort_at:
            raise WorkerAbort(f"dataset gave up at index {i}")
        return torch.arange(self.sizes[i], dtype=torch.float32) + i


def expected_batches(dataset, indices):
    return [default_collate([dataset[i]]) for i in indices]


def set_test_hook(name, value, worker_id):
    _core.WorkerChannel._test_hook(name, value)


class MakesMarker:
    """Unpickling this creates a directory: what a planted pickle could do instead
    (run any callable)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


# ---- helpers ----------------------------------------------------------------------------

def crafted_payload(marker):
    """Bytes that decode as a batch whose unpickling creates `marker`; checked to do
    so, so that a marker that never appears means the bytes were never decoded."""
    payload = _core.encode([MakesMarker(marker)])
    probe = marker + ".probe"
    probe_payload = _core.encode([MakesMarker(probe)])
    try:
        _core.decode(probe_payload)
        assert os.path.exists(probe), "the crafted payload does not run code when decoded"
    finally:
        if os.path.exists(probe):
            os.rmdir(probe)
    return payload


def as_nobody(fn, *args):
    """Run fn(*args) in a forked child that dropped to uid/gid nobody (the attacker)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the attacker child failed"


def plant(names, payload, size=64 << 20, directory=SHM):
    """Create each name (if free) as the current user, 0600 so that a permission
    check alone would pass, large enough for any size check, payload at offset 0."""
    planted = []
    for name in names:
        try:
            fd = os.open(os.path.join(directory, name),
                         os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, payload, 0)
        finally:
            os.close(fd)
        planted.append(name)
    return planted


def remove(names):
    for name in names:
        try:
            os.unlink(os.path.join(SHM, name))
        except FileNotFoundError:
            pass


def ours(prefix):
    return sorted(n for n in os.listdir(SHM) if n.startswith(prefix))


@pytest.fixture
def fixed_prefix(monkeypatch):
    """The pool's segment prefix, known in advance (as an attacker who watched the
    control block appear knows it): fastloader-<pid>-<8 hex namespace><10 hex>."""
    prefix = fastloader.sharing.loader_prefix()
    monkeypatch.setattr(fastloader.sharing, "loader_prefix", lambda pid=None: prefix)
    return prefix


def ns_tag():
    """What follows the pid in a loader's segment names made in this PID namespace."""
    return fastloader.sharing.pid_namespace() + uuid.uuid4().hex[:10]


def predicted_names(prefix, workers=2, count=16):
    """Sequential names (the scheme before issue 12): what an attacker pre-creates."""
    names = []
    for w in range(workers):
        names.append(f"{prefix}-w{w}-ctl")
        names += [f"{prefix}-w{w}-s{i}" for i in range(count)]
    return names


# ---- a worker leaving its loop by an exception -------------------------------------------

def run_until_worker_abort(strategy, on_worker_gone=None):
    """Worker 0 publishes batches 0-2 (two arenas: a small and a large batch), then
    leaves its loop at index 3 with WorkerAbort, before the main process took any."""
    dataset = SizedDataset([16, 300_000, 16, 16, 16, 16], abort_at=3)
    loader = DataLoader(dataset, batch_size=1, num_workers=1, prefetch_factor=4,
                        multiprocessing_context="fork", sharing_strategy=strategy)
    with deadline(60):
        it = iter(loader)
        (pid,) = it.worker_pids
        assert wait_until(lambda: is_gone(pid), 30), "the worker did not leave its loop"
        if on_worker_gone is not None:
            on_worker_gone()
        got = [next(it) for _ in range(3)]
        # a BaseException kills the worker, as in torch: a WorkerError that names it
        with pytest.raises(WorkerError) as info:
            next(it)
    for i, (want, have) in enumerate(zip(expected_batches(dataset, range(3)), got)):
        assert_same_batches(want, have, f"batch {i}")
    message = str(info.value)
    assert "dataset gave up at index 3" in message, message
    assert "WorkerAbort raised" in message and "worker process 0" in message, message
    del it, got


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_worker_exception_delivers_published_batches_then_its_error(strategy):
    """Before: under file_system the worker's cleanup unlinked the names of the queued
    batches (FileNotFoundError in the main process, batches lost); under both
    strategies the error itself was lost ('exited unexpectedly')."""
    run_until_worker_abort(strategy)


@needs_root
def test_replanted_names_after_a_worker_error_are_never_decoded(tmp_path, fixed_prefix):
    """The worker leaves its loop with batches still queued; another user then
    creates every name it can predict, with bytes that decode as a pickle. The main
    process delivers the real batches and the worker's error, and never decodes the
    planted bytes."""
    marker = str(tmp_path / "marker")
    payload = crafted_payload(marker)
    names = predicted_names(fixed_prefix, workers=1)
    planted = []

    def attack():
        planted.extend(n for n in names if not os.path.lexists(os.path.join(SHM, n)))
        as_nobody(plant, names, payload)

    try:
        run_until_worker_abort("file_system", on_worker_gone=attack)
        assert not os.path.exists(marker), "planted bytes were unpickled in the main process"
    finally:
        remove(planted)


# ---- planted and pre-created names -----------------------------------------------------

@needs_root
def test_planted_predictable_names_neither_fail_nor_get_decoded(tmp_path, fixed_prefix):
    """Another user pre-creates the control blocks' and segments' predictable names
    (before: 'File exists', and the loader died) with a pickle payload."""
    marker = str(tmp_path / "marker")
    payload = crafted_payload(marker)
    names = predicted_names(fixed_prefix)
    as_nobody(plant, names, payload)
    try:
        dataset = SizedDataset([16, 16, 300_000, 16, 16, 700_000, 16, 16])
        loader = DataLoader(dataset, batch_size=1, num_workers=2,
                            multiprocessing_context="fork", sharing_strategy="file_system")
        got = collect(loader)
        want = torch.utils.data.DataLoader(dataset, batch_size=1)
        assert len(got) == len(want)
        for i, (w, g) in enumerate(zip(want, got)):
            assert_same_batches(w, g, f"batch {i}")
        assert not os.path.exists(marker), "planted bytes were unpickled"
        for name in names:   # untouched: still the attacker's, never unlinked by us
            st = os.lstat(os.path.join(SHM, name))
            assert st.st_uid == NOBODY, name
    finally:
        remove(names)


def test_name_collisions_retry_with_a_fresh_name(tmp_path, fixed_prefix):
    """Names whose random token is already taken (forced through the test seam:
    64 random bits do not collide by chance) are skipped: the control block's in the
    main process and the first arena's in the worker. Planted by `nobody` as root,
    else by ourselves (a file of ours that the loader did not make is no better)."""
    tokens = [int.from_bytes(os.urandom(8), "little") for _ in range(4)]
    names = [f"{fixed_prefix}-w0-c0-{tokens[0]:016x}", f"{fixed_prefix}-w0-c0-{tokens[1]:016x}",
             f"{fixed_prefix}-w0-s0-{tokens[2]:016x}", f"{fixed_prefix}-w0-s0-{tokens[3]:016x}"]
    marker = str(tmp_path / "marker")
    payload = crafted_payload(marker)
    if os.geteuid() == 0:
        as_nobody(plant, names, payload)
    else:
        plant(names, payload)
    try:
        _core.WorkerChannel._test_hook("name_tokens", tokens[:2])   # the control block
        dataset = SizedDataset([16] * 6)
        loader = DataLoader(dataset, batch_size=2, num_workers=1,
                            multiprocessing_context="fork", sharing_strategy="file_system",
                            worker_init_fn=functools.partial(set_test_hook, "name_tokens",
                                                             tokens[2:]))
        got = collect(loader)
        for i, (w, g) in enumerate(zip(torch.utils.data.DataLoader(dataset, batch_size=2),
                                       got)):
            assert_same_batches(w, g, f"batch {i}")
        assert len(got) == 3
        assert not os.path.exists(marker)
        for name in names:
            with open(os.path.join(SHM, name), "rb") as f:
                assert f.read(len(payload)) == payload, f"{name} was overwritten"
    finally:
        if hasattr(_core.WorkerChannel, "_test_hook"):
            _core.WorkerChannel._test_hook("name_tokens", [])
        remove(names)


# ---- the main process opens only what its worker made -------------------------------------

def _tamper(path, how, payload, victim):
    os.unlink(path)
    if how == "other_user":
        name = os.path.basename(path)
        as_nobody(plant, [name], payload)
    elif how == "symlink":
        os.symlink(victim, path)
    elif how == "fifo":
        os.mkfifo(path, 0o600)
    else:
        plant([os.path.basename(path)], payload)
        if how == "mode":
            os.chmod(path, 0o644)
        # "inode": ours, 0600, regular, big enough: only its identity differs


TAMPERINGS = ("other_user", "symlink", "fifo", "mode", "inode")


@pytest.mark.parametrize("how", TAMPERINGS)
def test_main_process_refuses_a_replaced_segment(how, tmp_path):
    """Both channel ends in this process: after the worker announced a batch, its
    segment's name is made to point at something else. The main process refuses it
    with an error naming the segment (the batch's, raised in its turn), and never
    decodes it (before: only the size was checked, and the planted pickle ran)."""
    if how == "other_user" and os.geteuid() != 0:
        pytest.skip("playing another local user needs root (to setuid to nobody)")
    marker = str(tmp_path / "marker")
    payload = crafted_payload(marker)
    victim = tmp_path / "victim"
    victim.write_bytes(payload + bytes(64 << 20))
    path = None
    with loopback_channels("loopback") as (main, worker):
        prefix = main.handle()["prefix"]
        try:
            assert main.put_index(0, [0])
            worker.get_task()
            worker.publish(_core.RES_BATCH, 0, {"x": torch.arange(1000.0)})
            (name,) = ours(prefix)   # the arena; the control block's name is gone already
            path = os.path.join(SHM, name)
            _tamper(path, how, payload, victim)
            with deadline(20):
                _wid, seq, kind, error, _where = _core.recv((main,), 0, 5.0)
            # that batch's error, for its turn (the loop goes on, see
            # tests/faults/test_receive_pressure.py)
            assert (seq, kind, type(error)) == (0, _core.RES_ERROR, RuntimeError), error
            message = str(error)
            assert path in message and "refused" in message, message
            assert not os.path.exists(marker), "the replaced segment was decoded"
            assert victim.read_bytes()[:len(payload)] == payload
        finally:
            if path is not None and os.path.lexists(path):
                os.unlink(path)
    del worker
    assert not ours(prefix)


# ---- fds travel only after the last step that can fail -----------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_failed_arena_setup_keeps_segments_in_step(strategy):
    """The first two arena set-ups fail at their last step (as when memory runs
    out). Before, the fd of such an arena had been sent already, and the main
    process paired it with the next segment: 'failed validation'. Now those batches
    go to overflow segments and every batch arrives intact."""
    dataset = SizedDataset([16, 16, 200_000, 16, 600_000, 16, 16, 16])
    loader = DataLoader(dataset, batch_size=1, num_workers=1,
                        multiprocessing_context="fork", sharing_strategy=strategy,
                        worker_init_fn=functools.partial(set_test_hook, "fail_arena_setup",
                                                         2))
    got = collect(loader)
    want = expected_batches(dataset, range(len(dataset)))
    assert len(got) == len(want)
    for i, (w, g) in enumerate(zip(want, got)):
        assert_same_batches(w, g, f"batch {i}")


# ---- leftovers of a SIGKILLed process group ----------------------------------------------

_GROUP_SCRIPT = """
    import os, sys, time
    from fastloader import DataLoader
    from tests.transport.test_security_fs import SizedDataset

    loader = DataLoader(SizedDataset([16, 16, 300_000, 300_000] * 4), batch_size=1, num_workers=2,
                        prefetch_factor=3, multiprocessing_context="fork",
                        sharing_strategy="file_system")
    it = iter(loader)   # never consumed: every published segment keeps its name
    prefix = f"fastloader-{os.getpid()}-"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if len([n for n in os.listdir("/dev/shm") if n.startswith(prefix)]) >= 4:
            break
        time.sleep(0.05)
    print("ready", flush=True)
    time.sleep(600)
"""


def _group_killed_leftovers(env):
    """Start a loader in its own process group, SIGKILL the whole group once its
    workers published, and return the named segments it left behind."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_GROUP_SCRIPT)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    with proc:
        try:
            with deadline(90, "the loader in the killed group"):
                line = proc.stdout.readline()
            assert line == "ready\n", (line, proc.stderr.read() if proc.poll() else "")
            members = [p.pid for p in __import__("psutil").Process(proc.pid).children()]
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert wait_until(lambda: all(is_gone(p) for p in members), 10)
    left = ours(f"fastloader-{proc.pid}-")
    assert len(left) >= 3, f"expected the killed loader's named segments, found {left}"
    return left


def test_group_sigkill_leftovers_are_swept(subprocess_env):
    """Leftovers of a SIGKILLed group are removed by the next file_system loader's
    start, and by `doctor --clean`; a live process's segment and another user's
    never are. In a /dev/shm of its own: under pytest -n, another test process's
    file_system loader could sweep the leftovers first."""
    run_with_private_dev_shm(_group_sigkill_leftovers_are_swept, subprocess_env)


def _group_sigkill_leftovers_are_swept(subprocess_env):
    dead = unused_pid()
    tag = ns_tag()
    live = f"fastloader-{os.getpid()}-{tag}-w0-s0-{'0' * 16}"   # a live loader's
    foreign = f"fastloader-{dead}-{tag}-w0-s0-{'0' * 16}"       # stale, another user's
    keep = [live] + ([foreign] if os.geteuid() == 0 else [])
    plant([live], b"live")
    if os.geteuid() == 0:
        as_nobody(plant, [foreign], b"foreign", 4096)
    leftovers = []
    try:
        leftovers = _group_killed_leftovers(subprocess_env)
        loader = DataLoader(SizedDataset([16] * 4), batch_size=2, num_workers=1,
                            multiprocessing_context="fork", sharing_strategy="file_system")
        assert len(collect(loader)) == 2
        still = [n for n in leftovers if os.path.lexists(os.path.join(SHM, n))]
        assert not still, f"not swept by the next loader's start: {still}"

        leftovers = _group_killed_leftovers(subprocess_env)
        result = subprocess.run([sys.executable, "-m", "fastloader", "doctor", "--no-selftest",
                                 "--clean"], env=subprocess_env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        still = [n for n in leftovers if os.path.lexists(os.path.join(SHM, n))]
        assert not still, f"not swept by doctor --clean: {still}"
        for name in keep:
            assert os.path.lexists(os.path.join(SHM, name)), f"{name} was swept"
    finally:
        remove(keep + leftovers)


def test_sweep_removes_only_dead_owners_regular_files(tmp_path):
    """The sweep itself: a stale name that is a symlink, or another user's file, is
    left alone; only our own regular files of a dead owner go."""
    from fastloader import shm_sweep

    dead = unused_pid()
    tag = ns_tag()
    stale = f"fastloader-{dead}-{tag}-w0-s1-{'1' * 16}"
    link = f"fastloader-{dead}-{tag}-w0-s2-{'2' * 16}"
    live = f"fastloader-{os.getpid()}-{tag}-w0-s3-{'3' * 16}"
    # A dead pid here says nothing about a loader of another PID namespace (or of a
    # name that carries none): never swept.
    other_ns = "ffffffff" if shm_sweep.pid_namespace() != "ffffffff" else "fffffffe"
    elsewhere = f"fastloader-{dead}-{other_ns}{tag[8:]}-w0-s4-{'4' * 16}"
    unknown = f"fastloader-{dead}-{tag[8:]}-w0-s5-{'5' * 16}"
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    # A directory of its own: under pytest -n, another test process's file_system
    # loader runs this same sweep over /dev/shm when it starts, and could take the
    # stale name first.
    shm = tmp_path / "shm"
    shm.mkdir()
    plant([stale, live, elsewhere, unknown], b"x", 4096, directory=shm)
    os.symlink(victim, shm / link)
    removed = shm_sweep.sweep_dead_loaders(str(shm))
    assert stale in removed and not {link, live, elsewhere, unknown} & set(removed)
    assert not os.path.lexists(shm / stale)
    assert os.path.lexists(shm / link) and victim.read_text() == "keep me"
    for name in (live, elsewhere, unknown):
        assert stat.S_ISREG(os.lstat(shm / name).st_mode)


# The loader runs as a pid that is free in the test's namespace, so that judged by
# our /proc its owner looks dead (what a container sharing /dev/shm looks like). It
# gets that pid by setting its namespace's last pid (root in the namespace may).
_NAMESPACED_LOADER = """
import os, sys
target = int(sys.argv[1])
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(target - 1))
child = os.fork()
if child:
    _, status = os.waitpid(child, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
if os.getpid() != target:
    sys.exit(f"got pid {os.getpid()}, not {target}")
import torch
from fastloader import DataLoader

class DS(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i): return torch.full((200000,), float(i))

# 6.4 MB batches go to overflow segments, named until the main process opens them
loader = DataLoader(DS(), batch_size=8, num_workers=2, sharing_strategy="file_system",
                    multiprocessing_context="fork")
seen = 0
for n, batch in enumerate(loader):
    assert bool((batch == torch.arange(8 * n, 8 * n + 8).float()[:, None]).all())
    seen += 1
    if n == 0:
        print("ready", os.getpid(), flush=True)
        sys.stdin.readline()   # the host sweeps while the workers' results wait
print("ok", seen, flush=True)
"""


def test_sweep_leaves_a_live_loader_of_another_pid_namespace_alone(subprocess_env):
    """A file_system loader in its own PID namespace (a container with --ipc=host) whose
    pid is free here: the host's start-up sweep and `doctor --clean` leave its segments
    alone, and it finishes its epoch."""
    from fastloader import shm_sweep

    probe = subprocess.run(["unshare", "-pf", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a PID namespace: {probe.stderr.decode().strip()}")
    proc = subprocess.Popen(["unshare", "-pf", "--mount-proc", sys.executable, "-c",
                             _NAMESPACED_LOADER, str(unused_pid(long_unused=True))],
                            env=subprocess_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        with deadline(120, "the loader in its own PID namespace"):
            line = proc.stdout.readline()
        assert line.startswith("ready "), (line, proc.stderr.read() if proc.poll() else "")
        inner = int(line.split()[1])
        assert wait_until(lambda: ours(f"fastloader-{inner}-"), 60), "no queued result"
        names = set(ours(f"fastloader-{inner}-"))
        mtime = min(os.stat(os.path.join(SHM, n)).st_mtime for n in names)
        assert not shm_sweep.owner_state(inner, mtime)[0], "pid taken here meanwhile"
        removed = shm_sweep.sweep_dead_loaders()
        assert not names & set(removed), "a live loader's segments were swept"
        result = subprocess.run([sys.executable, "-m", "fastloader", "doctor", "--no-selftest",
                                 "--clean", "--json"], env=subprocess_env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads(result.stdout)
        assert not names & set(report["dev_shm"]["cleaned"]["removed"])
        judged = {s["name"]: s for s in report["dev_shm"]["segments"] if s["name"] in names}
        assert judged and all(not s["stale"] and "other namespace" in s["reason"]
                              for s in judged.values()), judged
        assert names <= set(os.listdir(SHM))
        out, err = proc.communicate("go\n", timeout=120)
        assert proc.returncode == 0 and out.strip() == "ok 8", (out, err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
