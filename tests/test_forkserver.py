"""The forkserver fastloader warms: started when a 'forkserver' loader is built,
with fastloader's worker module (and torch) preloaded, the user's own preload
list kept, and nothing started or changed otherwise.

Each case runs in a fresh interpreter: the forkserver lives as long as the
process that started it, and this test process may already have one."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.support.server_race import BOTH_REFUSED, RESTART_RACE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Imported by the child script: watch a process's memory map for fastloader's
# C module (the preload's sure sign), and compare a loader with torch's.
_PRELUDE = """
import json, os, sys, time
import multiprocessing
import torch
import fastloader
from fastloader import forkserver as fs
from tests.support.datasets import TensorLabelDataset

def has_core(pid):
    with open(f"/proc/{pid}/maps") as f:
        return any("fastloader/_core" in line for line in f)

def wait_for_core(pid, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if has_core(pid):
            return True
        time.sleep(0.05)
    return False

def compare(loader):
    ref = torch.utils.data.DataLoader(loader.dataset, batch_size=loader.batch_size)
    got = list(loader)
    want = list(ref)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))
    return len(got)
"""


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run(body, env_extra=None, sigint_ignored=False, argv=()):
    """`body` in a fresh interpreter (started with SIGINT ignored, as a background
    job is, if `sigint_ignored`; `argv` as its sys.argv[1:]); returns the JSON its
    last line prints."""
    env = dict(os.environ, **(env_extra or {}))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    code = _PRELUDE + "\nif __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent(body), "    ")
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240,
                          preexec_fn=_ignore_sigint if sigint_ignored else None)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_building_a_loader_starts_a_server_that_preloads_fastloader():
    out = _run("""
        multiprocessing.set_forkserver_preload(["json"])   # the user's own entry stays
        assert fs.server_pid() is None
        loader = fastloader.DataLoader(TensorLabelDataset(40), batch_size=4, num_workers=2,
                                       multiprocessing_context="forkserver")
        pid = fs.server_pid()
        assert pid is not None, "no server started when the loader was built"
        preloaded = wait_for_core(pid)
        it = iter(loader)
        parents = [open(f"/proc/{w}/stat").read().split(") ")[1].split()[1]
                   for w in it._pool.pids]
        del it
        n = compare(loader)
        print(json.dumps({"preloaded": preloaded, "server": pid, "parents": parents,
                          "batches": n, "same_server": fs.server_pid() == pid,
                          "list": multiprocessing.forkserver._forkserver._preload_modules}))
    """)
    assert out["preloaded"], "the forkserver never loaded fastloader's C module"
    assert out["same_server"]
    assert out["parents"] == [str(out["server"])] * 2, "workers must be forks of that server"
    assert out["batches"] == 10
    assert out["list"][0] == "json" and out["list"][-1] == "fastloader.worker"


_ENV_SEQUENCE = """
    from tests.support.datasets import EnvVarDataset
    Loader = fastloader.DataLoader if sys.argv[1] == "fastloader" else torch.utils.data.DataLoader
    os.environ["FS_TEST_VAR"] = "at build"
    loader = Loader(EnvVarDataset("FS_TEST_VAR"), batch_size=2, num_workers=2,
                    multiprocessing_context="forkserver")
    built_with = fs.server_pid()
    os.environ["FS_TEST_VAR"] = "at first iter"
    first = [v for b in loader for v in b]
    first_server = fs.server_pid()
    os.environ["FS_TEST_VAR"] = "at second iter"
    second = [v for b in loader for v in b]
    print(json.dumps({"first": first, "second": second, "built_with": built_with,
                      "first_server": first_server, "then": fs.server_pid(),
                      "core": has_core(fs.server_pid())}))
"""


@pytest.mark.parametrize("loader", ["torch", "fastloader"])
def test_workers_see_the_environment_of_the_first_iter_as_torchs_do(loader):
    """torch's forkserver starts at the first iter(): its workers see the environment
    as it is then, and keep seeing it (the server lives on). fastloader starts the
    server when the loader is built; a server whose start state changed before
    anything was forked from it is replaced at the first iter()."""
    out = _run(_ENV_SEQUENCE, argv=[loader])
    assert out["first"] == ["at first iter"] * 4
    assert out["second"] == ["at first iter"] * 4
    assert out["first_server"] == out["then"]
    if loader == "fastloader":
        assert out["built_with"] not in (None, out["then"])
        assert out["core"], "the replacement server does not preload fastloader"
    else:
        assert out["built_with"] is None


def test_a_warm_server_that_served_the_program_is_kept():
    """A process of the program's own, forked from the server after the loader was
    built, learns its exit code from that server: the server stays, with the
    environment it took when the loader was built."""
    out = _run("""
        from tests.support.datasets import EnvVarDataset
        loader = fastloader.DataLoader(EnvVarDataset("FS_TEST_VAR"), batch_size=2,
                                       num_workers=2, multiprocessing_context="forkserver")
        built_with = fs.server_pid()
        ctx = multiprocessing.get_context("forkserver")
        p = ctx.Process(target=time.sleep, args=(30,))
        p.start()
        os.environ["FS_TEST_VAR"] = "at first iter"
        got = [v for b in loader for v in b]
        p.kill()
        p.join()
        print(json.dumps({"got": got, "same": fs.server_pid() == built_with,
                          "exitcode": p.exitcode}))
    """)
    assert out["same"] and out["got"] == [""] * 4
    assert out["exitcode"] == -signal.SIGKILL


@pytest.mark.parametrize("how", [RESTART_RACE, BOTH_REFUSED])
def test_a_server_that_dies_as_two_workers_start_is_started_again(how):
    """The server dies as an epoch's two workers start (fastloader starts them
    from two threads; torch, one after the other). "dies while one start restarts
    it": one start has found it running, the other finds it dead and starts the
    next, and Python's connect_to_new_process() gave the first None for the
    server's address ("TypeError: a bytes-like object is required, not
    'NoneType'", with torch's pickling hint). "dies before both": both have found
    it running, and both connects are refused. Either way each start now tries
    once more, from the next server, and the epoch is torch's (interleavings
    forced: tests/support/server_race.py)."""
    out = _run("""
        from multiprocessing import forkserver as mp_forkserver
        from tests.support.datasets import TensorLabelDataset
        from tests.support.server_race import make_it_die
        loader = fastloader.DataLoader(TensorLabelDataset(8), batch_size=2, num_workers=2,
                                       multiprocessing_context="forkserver")
        compare(loader)
        server = mp_forkserver._forkserver
        first = server._forkserver_pid
        raced = make_it_die(server, sys.argv[1])
        n = compare(loader)
        print(json.dumps({"batches": n, "first": first, "then": server._forkserver_pid,
                          "raced": raced}))
    """, argv=[how])
    assert out["batches"] == 4
    assert out["then"] not in (None, out["first"])
    if how == RESTART_RACE:
        assert out["raced"] == [True]


def test_only_a_failed_connect_to_the_server_counts_as_a_server_lost_during_a_start(
        monkeypatch):
    """The retry above is for connects to a server that died. The same error
    types raised elsewhere in a start (a dataset whose pickling opens a missing
    file, a broken pipe writing the data to a child that failed to unpickle it)
    are the user's: they must be raised as they are, without waiting up to 5 s for
    a server that is fine (review: a BrokenPipeError from the data's write waited)."""
    from multiprocessing import forkserver as mp_forkserver

    from fastloader import forkserver

    waited = []
    monkeypatch.setattr(forkserver, "has_died", lambda *a, **k: waited.append(a) or True)
    server = mp_forkserver.ForkServer()
    server._forkserver_pid, server._forkserver_alive_fd = 999_999, 0
    server._forkserver_address = "/nonexistent/fastloader-test-forkserver-socket"
    server.ensure_running = lambda: None
    monkeypatch.setattr(forkserver, "_server", lambda: server)

    def raised(fn):
        try:
            fn()
        except BaseException as exc:
            return exc
        raise AssertionError("nothing raised")

    def pickling_opens_a_missing_file():
        open("/nonexistent/fastloader-test-dataset-file")

    def writing_to_a_child_that_exited():
        raise BrokenPipeError(32, "Broken pipe")

    for exc in (raised(pickling_opens_a_missing_file), raised(writing_to_a_child_that_exited)):
        assert not forkserver.lost_during_start(exc, 999_999)
    assert waited == []
    connect = raised(lambda: server.connect_to_new_process([]))
    assert isinstance(connect, FileNotFoundError)
    assert forkserver.lost_during_start(connect, 999_999) and len(waited) == 1
    server._forkserver_pid = 1_000_000   # another thread's start replaced it
    assert forkserver.lost_during_start(connect, 999_999) and len(waited) == 1


def test_a_start_the_program_makes_from_another_thread_keeps_the_server():
    """A thread of the program starts its own forkserver process as the loader is
    built; the server is still importing torch, so the request waits in its queue.
    Replacing the server then would lose it: the server stays."""
    out = _run("""
        import threading
        from tests.support.datasets import EnvVarDataset
        loader = fastloader.DataLoader(EnvVarDataset("FS_TEST_VAR"), batch_size=2,
                                       num_workers=2, multiprocessing_context="forkserver")
        built_with = fs.server_pid()
        res = {}
        def start_one():
            p = multiprocessing.get_context("forkserver").Process(target=time.sleep,
                                                                  args=(3,))
            p.start()
            p.join()
            res["exitcode"] = p.exitcode
        t = threading.Thread(target=start_one)
        t.start()
        def in_forkserver_code(ident):
            f = sys._current_frames().get(ident)
            while f is not None:
                if "forkserver" in os.path.basename(f.f_code.co_filename):
                    return True
                f = f.f_back
            return False
        deadline = time.monotonic() + 60   # until its start is under way there
        while time.monotonic() < deadline and not in_forkserver_code(t.ident):
            time.sleep(0.005)
        os.environ["FS_TEST_VAR"] = "at first iter"
        got = [v for b in loader for v in b]
        t.join()
        print(json.dumps({"got": got, "same": fs.server_pid() == built_with, **res}))
    """)
    assert out["exitcode"] == 0 and out["same"] and out["got"] == [""] * 4


@pytest.mark.parametrize("change", ["sigchld_ignored", "sigterm_blocked"])
def test_signal_state_at_the_first_iter(change):
    """SIGCHLD ignored after the loader was built: a change, so the server is
    replaced, and with the kernel reaping it the replacement must still work (it
    raised ChildProcessError, then every iter() did). SIGTERM blocked before:
    starting the server (its resource tracker) unblocks it in this thread, which is
    no change by the program, so the server stays."""
    out = _run(f"""
        import signal
        from tests.support.datasets import EnvVarDataset
        if "{change}" == "sigterm_blocked":
            signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
        loader = fastloader.DataLoader(EnvVarDataset("FS_TEST_VAR"), batch_size=2,
                                       num_workers=2, multiprocessing_context="forkserver")
        built_with = fs.server_pid()
        if "{change}" == "sigchld_ignored":
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        epochs = [[v for b in loader for v in b] for _ in range(2)]
        print(json.dumps({{"epochs": epochs, "same": fs.server_pid() == built_with}}))
    """)
    assert out["epochs"] == [[""] * 4] * 2
    assert out["same"] == (change == "sigterm_blocked")


def test_preload_can_be_turned_off():
    out = _run("""
        loader = fastloader.DataLoader(TensorLabelDataset(40), batch_size=4, num_workers=2,
                                       multiprocessing_context="forkserver")
        started_early = fs.server_pid() is not None
        n = compare(loader)
        pid = fs.server_pid()
        print(json.dumps({"started_early": started_early, "core": has_core(pid),
                          "batches": n}))
    """, {"FASTLOADER_FORKSERVER_PRELOAD": "0"})
    assert not out["started_early"]
    assert not out["core"], "the server preloaded fastloader although turned off"
    assert out["batches"] == 10


@pytest.mark.parametrize("tracker_first", [False, True], ids=["", "tracker_running"])
@pytest.mark.parametrize("preload", ["1", "0"])
def test_the_programs_own_forkserver_processes_take_ctrl_c_as_without_fastloader(
        preload, tracker_first):
    """The forkserver is Python's one per process: after a loader ran through it,
    a process the program itself starts through it takes SIGINT with Python's
    default handler (KeyboardInterrupt), as it would without fastloader. It used to
    inherit the SIGINT fastloader starts the server ignoring; and where
    multiprocessing's resource tracker already ran (whose start unblocked SIGINT
    by chance otherwise), with SIGINT blocked: a Ctrl-C did nothing there."""
    out = _run(("""
        from multiprocessing import resource_tracker
        resource_tracker.ensure_running()
""" if tracker_first else "") + """
        from tests.support.sigint_probe import report_sigint
        ctx = multiprocessing.get_context("forkserver")
        loader = fastloader.DataLoader(TensorLabelDataset(40), batch_size=4, num_workers=2,
                                       multiprocessing_context=ctx)
        n = compare(loader)
        queue = ctx.Queue()
        proc = ctx.Process(target=report_sigint, args=(queue,))
        proc.start()
        handler, outcome = queue.get(timeout=120)
        proc.join(60)
        print(json.dumps({"batches": n, "handler": handler, "outcome": outcome}))
    """, {"FASTLOADER_FORKSERVER_PRELOAD": preload})
    assert out == {"batches": 10, "handler": repr(signal.default_int_handler),
                   "outcome": "KeyboardInterrupt"}


_PROBE = """
    from tests.support import sigint_probe
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["json"])   # the program's own preload list
    loader = fastloader.DataLoader(TensorLabelDataset(40), batch_size=4, num_workers=2,
                                   multiprocessing_context=ctx)
    preload = list(fs._server()._preload_modules)   # what the server started with
    n = compare(loader)
    queue = ctx.Queue()
    proc = ctx.Process(target=getattr(sigint_probe, {target!r}), args=(queue,))
    proc.start()
    handler, outcome = queue.get(timeout=120)
    proc.join(60)
    print(json.dumps({{"batches": n, "handler": handler, "outcome": outcome,
                      "preload": preload}}))
"""


def test_the_servers_children_unblock_sigint_by_its_last_preload():
    """fastloader starts the server with SIGINT blocked, so that a Ctrl-C cannot
    kill it while it imports the program's preloads and fastloader's worker module
    (which imports torch); its last preload makes every process it forks unblock
    SIGINT, so the program's own forkserver processes take Ctrl-C with Python's
    default handler (blocked, the SIGINT sent below would do nothing)."""
    out = _run(_PROBE.format(target="report_sigint"))
    assert out["preload"] == ["json", "fastloader.worker", "fastloader._forkserver_sigint"]
    assert (out["handler"], out["outcome"]) == (repr(signal.default_int_handler),
                                                "KeyboardInterrupt")


def test_a_program_that_ignores_sigint_keeps_its_forkserver_processes_ignoring_it():
    """A program started with SIGINT ignored (a background job): its forkserver
    processes ignore it too, as without fastloader; nothing is put back."""
    out = _run(_PROBE.format(target="report_sigint"), sigint_ignored=True)
    assert (out["handler"], out["outcome"]) == (repr(signal.SIG_IGN), "nothing")
    assert out["preload"][-1] == "fastloader._forkserver_sigint"


def test_a_forkserver_process_that_ignores_sigint_keeps_ignoring_it_after_importing_fastloader():
    """Importing fastloader in a forkserver child changes nothing of its SIGINT
    (here the server does not preload fastloader, so the child imports it)."""
    out = _run(_PROBE.format(target="ignore_then_import_fastloader"),
               {"FASTLOADER_FORKSERVER_PRELOAD": "0"})
    assert (out["handler"], out["outcome"]) == (repr(signal.SIG_IGN), "nothing")


@pytest.mark.parametrize("kwargs", [
    "num_workers=0",
    "num_workers=2, multiprocessing_context='fork'",
    "num_workers=2, multiprocessing_context='spawn'",
    "num_workers=2",   # the default start method is fork on Linux before 3.14
])
def test_no_server_for_other_loaders(kwargs):
    if "context" not in kwargs and sys.version_info >= (3, 14):
        pytest.skip("forkserver is the default start method on 3.14")
    out = _run(f"""
        loader = fastloader.DataLoader(TensorLabelDataset(8), batch_size=4, {kwargs})
        print(json.dumps({{"server": fs.server_pid(),
                           "method": multiprocessing.get_start_method(allow_none=True)}}))
    """)
    assert out["server"] is None
    assert out["method"] is None, "building a loader must not fix the default start method"


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_building_a_loader_that_starts_a_server_leaves_the_start_method_unset(method):
    """Starting the server read multiprocessing's preparation data, which fixes the
    process-wide start method: after building a forkserver loader, a program's own
    multiprocessing.set_start_method() raised "context has already been set" (not
    with torch's DataLoader, which fixes it only when an iterator starts workers)."""
    out = _run(f"""
        loader = fastloader.DataLoader(TensorLabelDataset(8), batch_size=4, num_workers=2,
                                       multiprocessing_context={method!r})
        unset = multiprocessing.get_start_method(allow_none=True) is None
        multiprocessing.set_start_method("spawn")
        print(json.dumps({{"unset": unset, "batches": compare(loader)}}))
    """)
    assert out == {"unset": True, "batches": 2}


def test_a_server_already_running_is_used_as_it_is():
    out = _run("""
        multiprocessing.forkserver.ensure_running()
        pid = fs.server_pid()
        loader = fastloader.DataLoader(TensorLabelDataset(40), batch_size=4, num_workers=2,
                                       multiprocessing_context="forkserver")
        n = compare(loader)
        print(json.dumps({"same": fs.server_pid() == pid, "core": has_core(pid), "batches": n}))
    """)
    assert out["same"] and out["batches"] == 10
    assert not out["core"]


def test_default_start_method_forkserver_is_warmed_too():
    out = _run("""
        multiprocessing.set_start_method("forkserver")
        loader = fastloader.DataLoader(TensorLabelDataset(40), batch_size=4, num_workers=2)
        pid = fs.server_pid()
        preloaded = pid is not None and wait_for_core(pid)
        print(json.dumps({"preloaded": preloaded, "batches": compare(loader)}))
    """)
    assert out["preloaded"] and out["batches"] == 10
