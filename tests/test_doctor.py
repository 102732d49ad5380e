"""`python -m fastloader doctor`: the report has every field, stale /dev/shm segments are
found, and `--clean` removes exactly the stale ones the user owns, nothing else."""
import json
import mmap
import multiprocessing
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

import fastloader
from fastloader import doctor
from fastloader.dataloader import _DEFAULT_STRATEGY
from tests.support.helpers import unused_pid
from tests.support.private_shm import run_with_private_dev_shm

SHM = "/dev/shm"
# Every field a machine reading `--json` may rely on, section by section.
FIELDS = {
    "versions": {"fastloader", "torch", "torch_cuda", "numpy", "python", "platform"},
    "cpus": {"count", "affinity"},
    "sharing": {"torch_strategy", "torch_strategies", "fastloader_default", "memfd_supported",
                "memfd_error", "fd_limit_soft", "fd_limit_hard", "open_fds"},
    "dev_shm": {"path", "exists", "size_bytes", "free_bytes", "usable", "error", "segments",
                "other_files", "other_bytes", "cleaned"},
    "start_methods": {"available", "default", "default_set_explicitly", "cuda_initialized",
                      "pitfalls"},
    "selftest": {"skipped", "method_timeout_s", "results"},
}
SEGMENT_FIELDS = {"name", "kind", "pid", "uid", "mine", "size_bytes", "used_bytes", "mtime",
                  "inode", "stale", "reason", "unjudged"}
RESULT_FIELDS = {"method", "ok", "first_batch_s", "total_s", "error", "log"}


def run_doctor(env, *args, timeout=300):
    # -W error: the doctor itself must not emit a single warning.
    return subprocess.run([sys.executable, "-W", "error", "-m", "fastloader", "doctor", *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


def run_doctor_json(env, *args):
    result = run_doctor(env, "--json", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == "", result.stderr
    return json.loads(result.stdout)


def plant(name):
    path = os.path.join(SHM, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    return path, fd


def segments_by_name(report):
    return {s["name"]: s for s in report["dev_shm"]["segments"]}


# ---- the report ------------------------------------------------------------------------

def test_json_report_in_a_fresh_process_has_every_field(subprocess_env):
    report = run_doctor_json(subprocess_env)

    for section, fields in FIELDS.items():
        assert set(report[section]) >= fields, (section, fields - set(report[section]))
    assert {"findings", "status"} <= set(report)
    assert report["status"] in ("ok", "warning"), report["findings"]

    assert report["versions"]["fastloader"] == fastloader.__version__
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["python"] == "%d.%d.%d" % sys.version_info[:3]
    assert report["cpus"]["count"] == os.cpu_count()
    assert report["cpus"]["affinity"] == sorted(os.sched_getaffinity(0))
    sharing = report["sharing"]
    assert sharing["torch_strategy"] == torch.multiprocessing.get_sharing_strategy()
    assert sharing["fastloader_default"] == _DEFAULT_STRATEGY
    assert sharing["memfd_supported"] is True, sharing["memfd_error"]
    assert isinstance(sharing["open_fds"], int) and sharing["open_fds"] >= 3
    assert report["dev_shm"]["usable"] is True, report["dev_shm"]["error"]
    for seg in report["dev_shm"]["segments"]:
        assert set(seg) >= SEGMENT_FIELDS

    methods = multiprocessing.get_all_start_methods()
    assert report["start_methods"]["available"] == methods
    assert report["start_methods"]["default"] in methods
    assert set(report["start_methods"]["pitfalls"]) == set(methods)

    results = report["selftest"]["results"]
    assert report["selftest"]["skipped"] is False
    assert [r["method"] for r in results] == methods
    for r in results:
        assert set(r) >= RESULT_FIELDS
        assert r["ok"], r
        assert 0 < r["first_batch_s"] <= r["total_s"] < doctor.SELFTEST_METHOD_TIMEOUT_S + 5, r


def test_text_report_reads_as_sections(capsys):
    # In this process (the fresh-process run is the JSON test above): same code path.
    assert doctor.main(["--no-selftest"]) == 0
    text = capsys.readouterr().out
    for heading in ("Versions", "CPUs", "Sharing", "/dev/shm", "Start methods", "Self-test"):
        assert f"\n{heading}" in text, heading
    assert "ulimit -n" in text and "memfd" in text
    assert text.rstrip().splitlines()[-1] in ("Status: OK", "Status: WARNING")


def test_unknown_command_is_a_usage_error(capsys):
    from fastloader.__main__ import main

    assert main(["frobnicate"]) == 2
    assert "doctor" in capsys.readouterr().err


# ---- stale segments and --clean --------------------------------------------------------

def test_stale_segments_found_and_only_they_cleaned(subprocess_env, tmp_path):
    """Planted segments: detection judged in this process, `--clean` run in a fresh one
    (which must still see that this process maps one of them). In a /dev/shm of its
    own: under pytest -n, another test process's file_system loader sweeps /dev/shm
    when it starts, and once took the stale fastloader segment before `--clean` did."""
    run_with_private_dev_shm(_stale_segments_found_and_only_they_cleaned, subprocess_env,
                             tmp_path)


def _stale_segments_found_and_only_they_cleaned(subprocess_env, tmp_path):
    dead = unused_pid()
    # concurrent runs on one machine must not collide; our PID namespace comes first
    tag = fastloader.shm_sweep.pid_namespace() + uuid.uuid4().hex[:10]
    stale = f"fastloader-{dead}-{tag}-w0-s0"
    stale_torch = f"torch_{dead}_{tag}_0"
    live = f"fastloader-{os.getpid()}-{tag}-w0-s0"
    # Creator gone, but a live process (this one) still maps it: in use, not garbage.
    mapped = f"torch_{dead}_{tag}_1"
    # Named like a segment but a symlink: --clean must never follow or remove it.
    link = f"fastloader-{dead}-{tag}-w0-s1"
    foreign = f"fastloader-{dead}-{tag}-w0-s2"   # stale, but another user's (root only)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    paths, fds, views = [], [], []
    try:
        for name in (stale, stale_torch, live, mapped):
            path, fd = plant(name)
            paths.append(path)
            fds.append(fd)
        views.append(mmap.mmap(fds[3], 4096))
        for fd in fds:
            os.close(fd)
        fds.clear()
        os.symlink(victim, os.path.join(SHM, link))
        paths.append(os.path.join(SHM, link))
        if os.geteuid() == 0:
            path, fd = plant(foreign)
            os.close(fd)
            paths.append(path)
            os.chown(path, 65534, 65534)

        before = {s["name"]: s for s in doctor.scan_segments()[0]}
        assert before[stale]["stale"] and before[stale]["mine"], before[stale]
        assert before[stale]["kind"] == "fastloader" and before[stale]["pid"] == dead
        assert before[stale_torch]["stale"] and before[stale_torch]["kind"] == "torch"
        assert not before[live]["stale"], before[live]
        assert not before[mapped]["stale"], before[mapped]
        assert str(os.getpid()) in before[mapped]["reason"]
        assert link not in before
        if os.geteuid() == 0:
            assert before[foreign]["stale"] and not before[foreign]["mine"]

        report = run_doctor_json(subprocess_env, "--no-selftest", "--clean")
        removed = set(report["dev_shm"]["cleaned"]["removed"])
        assert {stale, stale_torch} <= removed
        assert not removed & {live, mapped, link, foreign}
        assert not os.path.exists(os.path.join(SHM, stale))
        assert not os.path.exists(os.path.join(SHM, stale_torch))
        for name in (live, mapped, link) + ((foreign,) if os.geteuid() == 0 else ()):
            assert os.path.lexists(os.path.join(SHM, name)), f"{name} was removed"
        assert victim.read_text() == "keep me"
        after = segments_by_name(report)
        assert stale not in after and live in after
        if os.geteuid() == 0:
            assert any("other users" in f["message"] for f in report["findings"])
    finally:
        for view in views:
            view.close()
        for fd in fds:
            os.close(fd)
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


# Run inside a new PID namespace (a "container") over its own small tmpfs on /dev/shm, as
# a fresh interpreter: plants a torch-named segment whose pid that namespace does not
# have (another container sharing /dev/shm could own it), then reports what the doctor
# judges and whether `--clean`, without and with --shm-is-private, removes it.
_CONTAINER_SCRIPT = r"""
import json, os, subprocess, sys
from fastloader import doctor
name = "torch_54321_%s_0" % sys.argv[1]
path = os.path.join("/dev/shm", name)
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 4096)
os.close(fd)
os.utime(path, (0, 0))   # written long ago: no clock slack can make it look recent
assert not os.path.exists("/proc/54321")
seg = {s["name"]: s for s in doctor.scan_segments()[0]}[name]
def clean(*flags):
    out = subprocess.run([sys.executable, "-W", "error", "-m", "fastloader", "doctor",
                          "--json", "--no-selftest", "--clean", *flags],
                         capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    return report["dev_shm"]["cleaned"]["removed"], [f["message"] for f in report["findings"]]
removed_plain, findings = clean()
there_after_plain = os.path.exists(path)
removed_private, _ = clean("--shm-is-private")
print(json.dumps({"seg": seg, "removed_plain": removed_plain, "findings": findings,
                  "there_after_plain": there_after_plain, "removed_private": removed_private,
                  "there_after_private": os.path.exists(path), "name": name}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/unshare"),
                    reason="needs root and unshare for a PID and mount namespace")
def test_torch_segment_in_a_container_is_left_alone_unless_shm_is_private(subprocess_env):
    """torch_<pid>_... names carry no PID namespace: in a container, a pid its /proc does
    not show may be a live process of another container sharing /dev/shm, so `--clean`
    must not remove the segment (it did: a sibling container's live tensor lost its
    name). `--shm-is-private` says no one else uses this /dev/shm, and then it goes."""
    tag = uuid.uuid4().hex[:10]
    inner = (f"mount -t tmpfs -o size=4m,mode=1777 tmpfs /dev/shm && "
             f"exec {sys.executable} -c '{_CONTAINER_SCRIPT}' {tag}")
    result = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--mount-proc",
                             "sh", "-c", inner], env=subprocess_env, capture_output=True,
                            text=True, timeout=300)
    if result.returncode != 0 and "unshare" in result.stderr:
        pytest.skip(f"cannot make namespaces here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stdout + result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    seg = out["seg"]
    assert not seg["stale"] and seg["unjudged"], seg
    assert "another container sharing /dev/shm may own it" in seg["reason"], seg
    assert out["removed_plain"] == [] and out["there_after_plain"], out
    assert any("--shm-is-private" in f for f in out["findings"]), out["findings"]
    assert out["removed_private"] == [out["name"]] and not out["there_after_private"], out


def test_reused_pid_makes_a_segment_stale():
    """A pid that runs now but started after the segment was written is another process."""
    started = doctor.process_start_time(os.getpid())
    assert started is not None and started <= time.time() + 2
    assert doctor.owner_state(os.getpid(), time.time())[0]
    alive, why = doctor.owner_state(os.getpid(), started - 3600)
    assert not alive and "started after" in why
    alive, why = doctor.owner_state(unused_pid(), time.time())
    assert not alive and "no longer exists" in why


# ---- exit status and failure reporting -------------------------------------------------

def test_exit_status_nonzero_when_no_shared_memory_works(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "probe_memfd", lambda: (False, "memfd_create: blocked"))
    monkeypatch.setattr(doctor, "probe_shm_dir", lambda shm_dir=SHM: (False, "read-only"))
    assert doctor.main(["--json", "--no-selftest"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "error"
    assert any(f["level"] == "error" and f["topic"] == "sharing" for f in report["findings"])


def test_selftest_crash_is_reported_not_raised():
    mark = doctor._STDERR_MARK
    out = "\n".join([json.dumps({"method": "fork", "event": "start"}),
                     json.dumps({"method": "fork", "event": "done", "ok": True,
                                 "first_batch_s": 0.1, "total_s": 0.2, "error": None}),
                     json.dumps({"method": "spawn", "event": "start"})])
    err = "\n".join([mark + "fork", "noise from fork", mark + "spawn",
                     "Fatal Python error: Segmentation fault"])
    results = doctor._selftest_results(["fork", "spawn", "forkserver"], out, err, -11)
    assert [r["ok"] for r in results] == [True, False, False]
    assert results[0]["log"] is None
    assert "SIGSEGV during it" in results[1]["error"]
    assert results[1]["log"] == "Fatal Python error: Segmentation fault"
    assert results[2]["error"].startswith("not run")


def test_selftest_failure_carries_its_workers_stderr(subprocess_env):
    """A worker that dies prints why to stderr: the report shows it with the failed
    method (fork, so the patched dataset reaches the workers)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, fastloader.doctor as d\n"
         "d.SelfTestDataset.__getitem__ = lambda self, i: sys.exit('worker gave up: planted')\n"
         "sys.exit(d.selftest_child(['fork']))"],
        env=subprocess_env, capture_output=True, text=True, timeout=55)
    [result] = doctor._selftest_results(["fork"], proc.stdout, proc.stderr, proc.returncode)
    assert not result["ok"] and result["error"], result
    assert "worker gave up: planted" in (result["log"] or ""), result


@pytest.mark.parametrize("cpus, text", [([0], "0"), ([0, 1], "0-1"),
                                        ([0, 1, 2, 5, 7, 8], "0-2,5,7-8")])
def test_cpu_ranges(cpus, text):
    assert doctor._cpu_ranges(cpus) == text
