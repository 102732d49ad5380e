"""`python -m fastloader doctor`: what users of torch's DataLoader otherwise ask their
shell one command at a time (`get_sharing_strategy()`, `ulimit -n`, `ls /proc/self/fd`,
`df /dev/shm`, `ls /dev/shm`), checked together, with what each answer means.

The report is a plain dict (`collect()`), printed as text (`render_text()`) or JSON.
Checks only observe; `assess()` turns observations into warnings and errors, so the
policy lives in one place. The only thing the doctor ever changes is /dev/shm, with
`--clean`, and there only stale segments the current user owns.
"""
from __future__ import annotations

import argparse
import errno
import json
import mmap
import multiprocessing
import os
import platform
import re
import resource
import signal
import stat
import subprocess
import sys
import textwrap
import time
import uuid
import warnings

import torch
from torch.utils.data import Dataset

from . import sharing
from .shm_sweep import owner_state, process_start_time  # noqa: F401  (part of the report API)
from .shm_sweep import segment_namespace_state, torch_name_state

SHM_DIR = "/dev/shm"

# torch's file_descriptor strategy keeps one fd per tensor storage that is in flight
# or kept by the user; 1024 (a common default soft limit) is reached by ordinary
# loaders, hence "Too many open files" / "received 0 items of ancdata".
FD_SOFT_LIMIT_LOW = 4096
# Docker gives containers 64 MiB of /dev/shm; one batch of 64 RGB 224x224 images is
# ~9 MiB, and workers x prefetch_factor of them are in flight at once.
SHM_SIZE_LOW = 1 << 30
SHM_FREE_FRACTION_LOW = 0.10
# Per start method. Spawn and forkserver workers import torch first: seconds on an
# idle box, well past 10 s on a loaded one or under a sanitizer. A slow machine must
# not be reported as a broken start method, so this only catches a hang.
SELFTEST_METHOD_TIMEOUT_S = 30
_TEXT_WIDTH = 88

# Segment names carry the pid of the process whose lifetime they belong to; ours
# are parsed by sharing.py, torch's (torch_<pid>_...) here.
_TORCH_SEGMENT = re.compile(r"torch_(\d+)_")

_START_METHOD_PITFALLS = {
    "fork": "fastest start; workers share the parent's memory copy-on-write. Unsafe once "
            "CUDA is initialised in the parent ('Cannot re-initialize CUDA in forked "
            "subprocess'): create loaders before touching CUDA, or use spawn/forkserver. "
            "Forking while other threads hold locks can deadlock (Python >= 3.12 warns).",
    "spawn": "each worker starts a fresh interpreter and re-imports your main module: guard "
             "it with `if __name__ == '__main__':`; dataset, collate_fn and worker_init_fn "
             "must be picklable and are pickled into every worker, and every worker of every "
             "epoch imports torch (FASTLOADER_SPAWN_SERVER=1 forks them from a clean server "
             "that holds torch instead: see the README's 'What differs').",
    "forkserver": "workers fork from a clean server process (Python 3.14's default on "
                  "Linux): CUDA-safe, same picklability rules as spawn; the first loader "
                  "pays for starting the server.",
}


# ---- versions and CPUs ----------------------------------------------------------------

def collect_versions() -> dict:
    import numpy

    import fastloader

    return {
        "fastloader": fastloader.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,   # None: a CPU-only build
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def collect_cpus() -> dict:
    count = os.cpu_count()
    try:
        # Containers and taskset restrict this below cpu_count(); torch sizes its
        # worker warning and thread pools from it.
        affinity = sorted(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {"count": count, "affinity": affinity}


# ---- sharing: strategies, memfd, file descriptors -------------------------------------

def _touch_mapping(fd: int, size: int = 1 << 16) -> None:
    """Size, map and write a segment the way fastloader's C core does, so that a seccomp
    filter, a noexec/ro mount or a full tmpfs shows up here and not mid-epoch."""
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        # The C core also accepts filesystems that cannot reserve pages up front.
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    with mmap.mmap(fd, size) as m:
        m[0] = 1


def probe_memfd() -> tuple[bool, str | None]:
    try:
        fd = os.memfd_create("fastloader-doctor", os.MFD_CLOEXEC)
    except (AttributeError, OSError) as exc:
        return False, f"memfd_create: {exc}"
    try:
        _touch_mapping(fd)
    except OSError as exc:
        return False, f"memfd segment: {exc}"
    finally:
        os.close(fd)
    return True, None


def probe_shm_dir(shm_dir: str = SHM_DIR) -> tuple[bool, str | None]:
    # A hidden name: the probe must never look like a segment to a scan or to a
    # leak check globbing fastloader-* while it exists.
    path = os.path.join(shm_dir, f".fastloader-doctor-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
    except OSError as exc:
        return False, f"creating a segment in {shm_dir}: {exc}"
    try:
        _touch_mapping(fd)
    except OSError as exc:
        return False, f"mapping a segment in {shm_dir}: {exc}"
    finally:
        os.close(fd)
        os.unlink(path)
    return True, None


def _limit(value: int) -> int | None:
    return None if value == resource.RLIM_INFINITY else value   # None: unlimited


def count_open_fds() -> int:
    # The listing itself holds an fd on /proc/self/fd while it runs; don't count it.
    return len(os.listdir("/proc/self/fd")) - 1


def collect_sharing() -> dict:
    memfd_ok, memfd_error = probe_memfd()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {
        "torch_strategy": torch.multiprocessing.get_sharing_strategy(),
        "torch_strategies": sorted(torch.multiprocessing.get_all_sharing_strategies()),
        "fastloader_default": sharing.DEFAULT_STRATEGY,
        "memfd_supported": memfd_ok,
        "memfd_error": memfd_error,
        "fd_limit_soft": _limit(soft),
        "fd_limit_hard": _limit(hard),
        "open_fds": count_open_fds(),
    }


# ---- /dev/shm: space and leftover segments --------------------------------------------

def _paths_in_use(paths: set) -> dict:
    """path -> pid of a process that has it open or mapped, among the processes we may
    inspect. A named segment whose creator died can still be mapped by another process
    (torch's main process keeps a worker's file_system tensors); it is not garbage."""
    found: dict = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target in paths:
                    found.setdefault(target, pid)
        except OSError:
            pass   # gone meanwhile, or not ours to inspect
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].rstrip("\n") in paths:
                        found.setdefault(parts[5].rstrip("\n"), pid)
        except OSError:
            pass
    return found


def _segment_kind(name: str) -> tuple[str, int] | None:
    ours = sharing.parse_segment_name(name)
    if ours is not None:
        return ours.kind, ours.pid
    match = _TORCH_SEGMENT.match(name)
    return ("torch", int(match.group(1))) if match else None


def scan_segments(shm_dir: str = SHM_DIR, shm_is_private: bool = False) -> tuple[list, dict]:
    """fastloader and torch segments in shm_dir, each judged stale or not, and the
    count and bytes of every other file (what else fills /dev/shm). shm_is_private:
    the user says no other PID namespace uses shm_dir, so torch's names, which carry
    none, may be judged by our /proc even in a container."""
    segments, other = [], {"files": 0, "bytes": 0}
    euid = os.geteuid()
    for entry in os.scandir(shm_dir):
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue   # removed meanwhile
        kind = _segment_kind(entry.name)
        # Only regular files are segments: a planted symlink must never lead --clean
        # elsewhere.
        if kind is None or not stat.S_ISREG(st.st_mode):
            other["files"] += 1
            other["bytes"] += st.st_blocks * 512
            continue
        alive, reason = owner_state(kind[1], st.st_mtime)
        unjudged = False
        if kind[0] == "torch":
            ours, why = torch_name_state(shm_is_private)
            unjudged = not ours and not alive   # stale, were it judged here
        else:
            ours, why = segment_namespace_state(entry.name)
        if not ours:
            alive, reason = True, why   # its pid cannot be judged by our /proc
        segments.append({
            "name": entry.name, "kind": kind[0], "pid": kind[1], "uid": st.st_uid,
            "mine": st.st_uid == euid, "size_bytes": st.st_size,
            "used_bytes": st.st_blocks * 512, "mtime": st.st_mtime, "inode": st.st_ino,
            "stale": not alive, "reason": reason, "unjudged": unjudged,
        })
    orphans = {os.path.join(shm_dir, s["name"]): s for s in segments if s["stale"]}
    if orphans:
        for path, pid in _paths_in_use(set(orphans)).items():
            seg = orphans[path]
            seg["stale"] = False
            seg["reason"] += f", but process {pid} still has it open or mapped"
    segments.sort(key=lambda s: s["name"])
    return segments, other


def collect_dev_shm(shm_dir: str = SHM_DIR, shm_is_private: bool = False) -> dict:
    info = {"path": shm_dir, "exists": os.path.isdir(shm_dir), "size_bytes": None,
            "free_bytes": None, "usable": False, "error": None, "segments": [],
            "other_files": 0, "other_bytes": 0, "cleaned": None}
    if not info["exists"]:
        info["error"] = f"{shm_dir} does not exist"
        return info
    info["usable"], info["error"] = probe_shm_dir(shm_dir)
    try:
        vfs = os.statvfs(shm_dir)
        info["size_bytes"] = vfs.f_blocks * vfs.f_frsize
        info["free_bytes"] = vfs.f_bavail * vfs.f_frsize
        segments, other = scan_segments(shm_dir, shm_is_private)
    except OSError as exc:
        info["error"] = info["error"] or f"reading {shm_dir}: {exc}"
        return info
    info["segments"] = segments
    info["other_files"], info["other_bytes"] = other["files"], other["bytes"]
    return info


def clean_stale(segments: list, shm_dir: str = SHM_DIR) -> dict:
    """Unlink stale segments owned by the effective uid, nothing else. Each file is
    checked again just before unlinking, so one replaced since the scan is left alone."""
    removed, failed = [], []
    candidates = {os.path.join(shm_dir, s["name"]): s
                  for s in segments if s["stale"] and s["mine"]}
    # Looked up once more: a process may have opened one since the scan.
    in_use = _paths_in_use(set(candidates)) if candidates else {}
    for path, seg in candidates.items():
        if path in in_use:
            continue
        try:
            st = os.lstat(path)
            unchanged = (st.st_ino == seg["inode"] and st.st_mtime == seg["mtime"]
                         and stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid())
            if not unchanged or owner_state(seg["pid"], st.st_mtime)[0]:
                continue
            os.unlink(path)
            removed.append(seg["name"])
        except FileNotFoundError:
            continue   # someone else removed it first: the goal is reached
        except OSError as exc:
            failed.append({"name": seg["name"], "error": str(exc)})
    return {"removed": removed, "failed": failed}


# ---- start methods ---------------------------------------------------------------------

def collect_start_methods() -> dict:
    available = multiprocessing.get_all_start_methods()
    chosen = multiprocessing.get_start_method(allow_none=True)
    return {
        "available": available,
        "default": sharing.default_start_method(),
        "default_set_explicitly": chosen is not None,
        "cuda_initialized": torch.cuda.is_initialized(),
        "pitfalls": {m: _START_METHOD_PITFALLS.get(m, "") for m in available},
    }


# ---- self-test: real workers, real batches --------------------------------------------

class SelfTestDataset(Dataset):
    """Module-level so that spawn and forkserver workers can import it."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        return torch.full((16,), float(index)), index


def _check_batch(batch, first_index: int, batch_size: int) -> None:
    samples, labels = batch
    expected = torch.arange(first_index, first_index + batch_size)
    if not torch.equal(labels, expected):
        raise AssertionError(f"labels {labels.tolist()} != {expected.tolist()}")
    if not torch.equal(samples, expected.to(torch.float32)[:, None].expand(-1, 16)):
        raise AssertionError(f"samples do not match indices {expected.tolist()}")


class _SelfTestTimeout(BaseException):
    """A BaseException so that no loader code wraps or swallows it."""


def _on_alarm(signum, frame):
    raise _SelfTestTimeout(f"no result within {SELFTEST_METHOD_TIMEOUT_S + 5} s")


def _selftest_one(method: str) -> dict:
    from fastloader import DataLoader

    batch_size = 4
    started = time.perf_counter()
    result = {"method": method, "event": "done", "ok": False, "first_batch_s": None,
              "total_s": None, "error": None}
    # The loader's own timeout bounds each wait; the alarm is the backstop for a hang
    # outside those waits (worker start, shutdown).
    signal.setitimer(signal.ITIMER_REAL, SELFTEST_METHOD_TIMEOUT_S + 5)
    try:
        loader = DataLoader(SelfTestDataset(), batch_size=batch_size, num_workers=2,
                            multiprocessing_context=method,
                            timeout=SELFTEST_METHOD_TIMEOUT_S)
        it = iter(loader)
        # One batch per worker (round robin): each of the two worked.
        for i in range(2):
            batch = next(it)
            if i == 0:
                result["first_batch_s"] = round(time.perf_counter() - started, 3)
            _check_batch(batch, i * batch_size, batch_size)
        del batch, it   # stops the workers: part of the measured round trip
        result["ok"] = True
    except BaseException as exc:   # report every failure, crash on none
        result["error"] = f"{type(exc).__name__}: {exc}".strip()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    result["total_s"] = round(time.perf_counter() - started, 3)
    return result


# Written to stderr before each method, so that what its workers print (a traceback
# from a dying worker) can be told apart from what the next method's workers print.
_STDERR_MARK = "== fastloader doctor self-test: "
_LOG_LINES = 15


def selftest_child(methods: list) -> int:
    """Runs in a separate interpreter (see run_selftest): one JSON line per event."""
    # A box with one usable CPU makes torch warn about 2 workers; that is expected here.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    signal.signal(signal.SIGALRM, _on_alarm)
    for method in methods:
        print(_STDERR_MARK + method, file=sys.stderr, flush=True)
        print(json.dumps({"method": method, "event": "start"}), flush=True)
        print(json.dumps(_selftest_one(method)), flush=True)
    return 0


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "was still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def run_selftest(methods: list) -> list:
    """Runs the self-test in a child interpreter: a crash or hang in the C core while
    under test becomes a reported failure, not a dead or stuck doctor. The child leads
    its own process group, so its workers go with it if it has to be killed."""
    import fastloader

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(fastloader.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    code = ("import sys; from fastloader.doctor import selftest_child; "
            "sys.exit(selftest_child(sys.argv[1:]))")
    # Interpreter start plus, per method, the loader timeout and worker shutdown.
    budget = 30 + len(methods) * (SELFTEST_METHOD_TIMEOUT_S + 10)
    proc = subprocess.Popen([sys.executable, "-c", code, *methods], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        err += f"\n(self-test killed after {budget} s)"
    return _selftest_results(methods, out, err, proc.returncode)


def _split_stderr(err: str) -> dict:
    """method -> what was printed to stderr while it ran ('' key: before any method)."""
    logs, current = {"": []}, ""
    for line in err.splitlines():
        if line.startswith(_STDERR_MARK):
            current = line[len(_STDERR_MARK):]
            logs.setdefault(current, [])
        else:
            logs[current].append(line)
    return {method: "\n".join(lines[-_LOG_LINES:]) or None for method, lines in logs.items()}


def _selftest_results(methods: list, out: str, err: str, returncode: int | None) -> list:
    results, started = {}, set()
    for line in out.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue   # a stray print from user site-customisation
        if event.get("event") == "start":
            started.add(event["method"])
        elif event.get("event") == "done":
            event.pop("event")
            results[event["method"]] = event
    logs = _split_stderr(err)
    for method in methods:
        if method not in results:
            if method in started:
                error = f"the self-test process {_describe_exit(returncode)} during it"
            else:
                error = f"not run: the self-test process {_describe_exit(returncode)}"
            results[method] = {"method": method, "ok": False, "first_batch_s": None,
                               "total_s": None, "error": error}
        result = results[method]
        # A failure's cause is often only in a worker's traceback on stderr.
        result["log"] = None if result["ok"] else logs.get(method) or logs[""]
    return [results[m] for m in methods]


# ---- assessment ------------------------------------------------------------------------

def _finding(level: str, topic: str, message: str) -> dict:
    return {"level": level, "topic": topic, "message": message}


def assess(report: dict) -> list:
    """Warnings (something will bite some loaders) and errors (something is broken)."""
    findings = []
    sharing, shm = report["sharing"], report["dev_shm"]
    if not sharing["memfd_supported"] and not shm["usable"]:
        findings.append(_finding(
            "error", "sharing", "neither memfd nor /dev/shm can hold a shared segment: no "
            "loader with workers can work (fastloader's or torch's)"))
    elif not sharing["memfd_supported"]:
        findings.append(_finding(
            "warning", "sharing", "memfd segments are unavailable, so fastloader's default "
            "'file_descriptor' strategy cannot work: pass sharing_strategy='file_system'"))
    elif not shm["usable"]:
        findings.append(_finding(
            "warning", "dev_shm", f"{shm['path']} is unusable ({shm['error']}): torch's "
            "DataLoader with workers and fastloader's 'file_system' strategy will fail; "
            "fastloader's default strategy does not need it"))

    soft = sharing["fd_limit_soft"]
    torch_uses_fds = sharing["torch_strategy"] == "file_descriptor"
    if soft is not None and soft < FD_SOFT_LIMIT_LOW and torch_uses_fds:
        hard = sharing["fd_limit_hard"]
        if hard is None or hard > soft:
            how = (f"raise it with `ulimit -n {'unlimited' if hard is None else hard}` "
                   "(up to the hard limit needs no privileges)")
        else:
            how = ("the hard limit is the same, so raising it needs root (limits.conf, "
                   "`docker run --ulimit nofile=...`)")
        findings.append(_finding(
            "warning", "fds", f"open-file limit is {soft}: torch's 'file_descriptor' strategy "
            f"holds one fd per shared tensor and may fail with 'Too many open files'; {how}, "
            "or use fastloader, whose fd count per worker is constant"))
    if soft is not None and sharing["open_fds"] > soft * 0.8:
        findings.append(_finding(
            "warning", "fds", f"{sharing['open_fds']} fds already open of a limit of {soft}"))

    if shm["exists"] and shm["size_bytes"] is not None:
        if shm["size_bytes"] < SHM_SIZE_LOW:
            findings.append(_finding(
                "warning", "dev_shm", f"{shm['path']} is only {_human_bytes(shm['size_bytes'])}: "
                "torch's DataLoader may die with 'Bus error' (containers: `docker run "
                "--shm-size=...`); fastloader's default (memfd) does not use it"))
        elif shm["free_bytes"] < shm["size_bytes"] * SHM_FREE_FRACTION_LOW:
            findings.append(_finding(
                "warning", "dev_shm", f"{shm['path']} is nearly full "
                f"({_human_bytes(shm['free_bytes'])} free)"))

    stale = [s for s in shm["segments"] if s["stale"]]
    mine = [s for s in stale if s["mine"]]
    if mine:
        findings.append(_finding(
            "warning", "dev_shm", f"{len(mine)} stale segment(s) of yours hold "
            f"{_human_bytes(sum(s['used_bytes'] for s in mine))}: remove them with "
            "`python -m fastloader doctor --clean`"))
    if len(stale) > len(mine):
        findings.append(_finding(
            "warning", "dev_shm", f"{len(stale) - len(mine)} stale segment(s) belong to "
            "other users: only they (or root) can remove them"))
    unjudged = [s for s in shm["segments"] if s.get("unjudged")]
    if unjudged:
        findings.append(_finding(
            "warning", "dev_shm", f"{len(unjudged)} torch segment(s) hold "
            f"{_human_bytes(sum(s['used_bytes'] for s in unjudged))} and name a process "
            "this PID namespace does not have: in a container, another container sharing "
            "/dev/shm may own them, so they are left alone. If this /dev/shm is this "
            "container's own (docker's default), `python -m fastloader doctor --clean "
            "--shm-is-private` removes those that are stale"))
    cleaned = shm.get("cleaned") or {}
    for failure in cleaned.get("failed", []):
        findings.append(_finding(
            "warning", "dev_shm", f"could not remove {failure['name']}: {failure['error']}"))

    for result in report["selftest"]["results"]:
        if not result["ok"]:
            findings.append(_finding(
                "error", "selftest", f"{result['method']}: {result['error']}"))
    return findings


# ---- report ----------------------------------------------------------------------------

def collect(selftest: bool = True, clean: bool = False, shm_is_private: bool = False) -> dict:
    report = {
        "versions": collect_versions(),
        "cpus": collect_cpus(),
        "sharing": collect_sharing(),
        "dev_shm": collect_dev_shm(shm_is_private=shm_is_private),
        "start_methods": collect_start_methods(),
        "selftest": {"skipped": not selftest, "method_timeout_s": SELFTEST_METHOD_TIMEOUT_S,
                     "results": []},
    }
    if clean and report["dev_shm"]["exists"]:
        cleaned = clean_stale(report["dev_shm"]["segments"])
        report["dev_shm"] = collect_dev_shm(shm_is_private=shm_is_private)   # what is left
        report["dev_shm"]["cleaned"] = cleaned
    if selftest:
        report["selftest"]["results"] = run_selftest(report["start_methods"]["available"])
    report["findings"] = assess(report)
    levels = {f["level"] for f in report["findings"]}
    report["status"] = "error" if "error" in levels else "warning" if levels else "ok"
    return report


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def _cpu_ranges(cpus: list) -> str:
    """[0, 1, 2, 5] -> '0-2,5', as taskset and /proc print CPU lists."""
    spans, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            spans.append(str(start) if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(spans)


def _limit_text(value: int | None) -> str:
    return "unlimited" if value is None else str(value)


def _render_versions(r: dict) -> list:
    v = r["versions"]
    torch_build = f"CUDA {v['torch_cuda']}" if v["torch_cuda"] else "CPU only"
    return ["Versions",
            f"  fastloader          {v['fastloader']}",
            f"  torch               {v['torch']} ({torch_build})",
            f"  numpy               {v['numpy']}",
            f"  python              {v['python']} ({v['platform']})"]


def _render_cpus(r: dict) -> list:
    c = r["cpus"]
    aff = c["affinity"]
    usable = "unknown" if aff is None else f"{_cpu_ranges(aff)} ({len(aff)} usable)"
    return ["CPUs", f"  count               {c['count']}", f"  affinity            {usable}"]


def _render_sharing(r: dict) -> list:
    s = r["sharing"]
    memfd = "supported" if s["memfd_supported"] else f"UNAVAILABLE ({s['memfd_error']})"
    return ["Sharing",
            f"  torch strategy      {s['torch_strategy']} "
            f"(available: {', '.join(s['torch_strategies'])})",
            f"  fastloader default  {s['fastloader_default']}",
            f"  memfd               {memfd}",
            f"  ulimit -n           soft {_limit_text(s['fd_limit_soft'])}, "
            f"hard {_limit_text(s['fd_limit_hard'])}",
            f"  open fds            {s['open_fds']} (this process)"]


def _render_segment(seg: dict) -> str:
    state = "STALE" if seg["stale"] else "live "
    owner = "" if seg["mine"] else f", uid {seg['uid']}"
    return (f"    {state} {seg['name']}  {_human_bytes(seg['used_bytes'])}  "
            f"({seg['reason']}{owner})")


def _render_dev_shm(r: dict, max_segments: int = 20) -> list:
    d = r["dev_shm"]
    lines = [d["path"]]
    if not d["exists"]:
        return lines + [f"  {d['error']}"]
    usable = "yes" if d["usable"] else f"NO ({d['error']})"
    lines += [f"  size / free         {_human_bytes(d['size_bytes'])} / "
              f"{_human_bytes(d['free_bytes'])}",
              f"  usable              {usable}"]
    segs = d["segments"]
    nstale = sum(s["stale"] for s in segs)
    lines.append(f"  segments            {len(segs)} fastloader/torch ({nstale} stale), "
                 f"{d['other_files']} other file(s) using {_human_bytes(d['other_bytes'])}")
    lines += [_render_segment(s) for s in segs[:max_segments]]
    if len(segs) > max_segments:
        lines.append(f"    ... and {len(segs) - max_segments} more (see --json)")
    if d["cleaned"] is not None:
        removed = d["cleaned"]["removed"]
        lines.append(f"  cleaned             removed {len(removed)} stale segment(s)")
        lines += [f"    removed {name}" for name in removed[:max_segments]]
        if len(removed) > max_segments:
            lines.append(f"    ... and {len(removed) - max_segments} more (see --json)")
    return lines


def _render_start_methods(r: dict) -> list:
    m = r["start_methods"]
    how = "set explicitly" if m["default_set_explicitly"] else "platform default"
    lines = ["Start methods",
             f"  available           {', '.join(m['available'])}",
             f"  default             {m['default']} ({how})"]
    for name, text in m["pitfalls"].items():
        lines += textwrap.wrap(text, width=_TEXT_WIDTH, initial_indent=f"  {name + ':':<19} ",
                               subsequent_indent=" " * 22, break_on_hyphens=False)
    return lines


def _render_selftest(r: dict) -> list:
    t = r["selftest"]
    if t["skipped"]:
        return ["Self-test           skipped (--no-selftest)"]
    lines = ["Self-test (fastloader.DataLoader, 2 workers, 2 batches each)"]
    for res in t["results"]:
        if res["ok"]:
            lines.append(f"  {res['method']:<19} ok    first batch {res['first_batch_s']:.2f} s, "
                         f"total {res['total_s']:.2f} s")
        else:
            lines.append(f"  {res['method']:<19} FAILED  {res['error']}")
            lines += [f"  {'':<19} | {line}" for line in (res["log"] or "").splitlines()]
    return lines


def render_text(report: dict) -> str:
    sections = [_render_versions, _render_cpus, _render_sharing, _render_dev_shm,
                _render_start_methods, _render_selftest]
    lines = ["fastloader doctor", ""]
    for section in sections:
        lines += section(report) + [""]
    if report["findings"]:
        lines.append("Findings")
        for f in report["findings"]:
            lines += textwrap.wrap(f"{f['level'].upper()}: {f['message']}", width=_TEXT_WIDTH,
                                   initial_indent="  ", subsequent_indent="    ",
                                   break_on_hyphens=False)
        lines.append("")
    lines.append(f"Status: {report['status'].upper()}")
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fastloader doctor",
        description="Check the environment fastloader and torch's DataLoader run in.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--clean", action="store_true",
                        help="remove stale fastloader/torch segments you own from /dev/shm")
    parser.add_argument("--shm-is-private", action="store_true",
                        help="no other container uses this /dev/shm: judge torch_<pid> "
                             "segments by this PID namespace's processes")
    parser.add_argument("--no-selftest", action="store_true",
                        help="skip starting workers with each start method")
    args = parser.parse_args(argv)
    report = collect(selftest=not args.no_selftest, clean=args.clean,
                     shm_is_private=args.shm_is_private)
    print(json.dumps(report, indent=2) if args.json else render_text(report))
    return 1 if report["status"] == "error" else 0
