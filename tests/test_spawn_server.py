"""With FASTLOADER_SPAWN_SERVER=1, 'spawn' workers are forks of one clean server
that has imported torch (spawn_server.py), and behave as spawned ones: checked
against torch's DataLoader under spawn, in a fresh interpreter per case that runs
a script file, so that the main module is imported again in every worker as spawn
does. Without it (the default) workers are spawned."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Both scripts: run fn() in a forked child, and return what it returned (JSON).
_IN_CHILD = """
def in_child(fn):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = fn()
        except BaseException as exc:
            out = {"error": repr(exc)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = json.loads(f.read())
    os.waitpid(pid, 0)
    return got
"""

# The script's own top: runs again in every worker (as __mp_main__), which records it.
_TOP = """
import json, os, sys, time
MARKS = os.environ["SPAWN_TEST_MARKS"]
with open(MARKS, "a") as f:
    f.write(json.dumps([os.getpid(), __name__]) + "\\n")
import atexit, multiprocessing, resource, signal, tempfile
import numpy as np
import torch
import fastloader
from fastloader import spawn_server

class Probe(torch.utils.data.Dataset):
    # what a worker sees: its pid and parent, an environment variable, a draw from
    # NumPy's global random state, and its process name
    def __len__(self):
        return 8
    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return {"pid": os.getpid(), "ppid": os.getppid(), "i": i,
                "env": os.environ.get("SPAWN_TEST_VAR", ""),
                "put": os.environ.get("SPAWN_TEST_PUT", ""),
                "core": resource.getrlimit(resource.RLIMIT_CORE)[0],
                "pgrp": os.getpgrp(),
                "draw": int(np.random.randint(0, 2**62)),
                "name": multiprocessing.current_process().name.rsplit("-", 1)[0],
                "method": multiprocessing.get_start_method(allow_none=True),
                "worker": info.id}

class LeavesTidying(Probe):
    # registers exit-time work in the worker, as libraries do (a temporary
    # directory, an atexit handler); a spawned worker's interpreter does it at exit
    def __getitem__(self, i):
        d = tempfile.TemporaryDirectory(dir=os.environ["SPAWN_TEST_DIR"])
        open(os.path.join(d.name, "f"), "w").close()
        LeavesTidying.keep = getattr(LeavesTidying, "keep", []) + [d]
        mark = os.path.join(os.environ["SPAWN_TEST_DIR"], f"atexit-{os.getpid()}")
        atexit.register(lambda: open(mark, "w").close())
        return super().__getitem__(i)

class Says(Probe):
    # writes to fd 2, wherever the process's stderr is when the worker starts
    def __getitem__(self, i):
        os.write(2, f"worker {os.getpid()} says {i}\\n".encode())
        return super().__getitem__(i)

def epoch(loader):
    return [{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in b.items()}
            for b in loader]

def pids(batches):
    return sorted({p for b in batches for p in b["pid"]})

def ppids(batches):
    return sorted({p for b in batches for p in b["ppid"]})
""" + _IN_CHILD


def _pids(batches):
    return sorted({p for b in batches for p in b["pid"]})


def _run(tmp_path, body, env_extra=None):
    """`body` as the `if __name__ == '__main__':` part of a script file, run in a
    fresh interpreter; returns (JSON of its last line, the main-module marks)."""
    script = tmp_path / "spawn_script.py"
    marks = tmp_path / "marks.jsonl"
    script.write_text(_TOP + "\nif __name__ == '__main__':\n"
                      + textwrap.indent(textwrap.dedent(body), "    "))
    env = dict(os.environ, FASTLOADER_SPAWN_SERVER="1")
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "python")]
                                        + [p for p in sys.path if p])
    env["SPAWN_TEST_MARKS"] = str(marks)
    env["SPAWN_TEST_DIR"] = str(tmp_path)
    env.pop("PYTHONWARNINGS", None)
    done = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in marks.read_text().splitlines()]
    return json.loads(done.stdout.strip().splitlines()[-1]), lines


@pytest.mark.parametrize("how", ["context", "default"])
def test_spawn_workers_are_forks_of_one_server_and_run_the_main_module_as_spawned(
        tmp_path, how):
    """Two epochs under spawn, from a 'spawn' context and from the default start
    method set to spawn: the same batches as torch's, and as under spawn each worker
    imports the main module again as __mp_main__, has the process name and start
    method torch's would; but every worker's parent is one server, which never
    imported the main module itself and holds fastloader's C module already."""
    kwargs = ("multiprocessing_context='spawn'" if how == "context" else "")
    out, marks = _run(tmp_path, f"""
        if {how!r} == "default":
            multiprocessing.set_start_method("spawn")
        loader = fastloader.DataLoader(Probe(), batch_size=2, num_workers=2, {kwargs})
        server = spawn_server.server_pid()
        with open(f"/proc/{{server}}/maps") as f:
            ready = any("fastloader/_core" in line for line in f)   # may still import
        ours = [epoch(loader), epoch(loader)]
        torchs = [epoch(torch.utils.data.DataLoader(Probe(), batch_size=2, num_workers=2,
                                                    {kwargs})) for _ in range(2)]
        deadline = time.monotonic() + 60
        while not ready and time.monotonic() < deadline:
            with open(f"/proc/{{server}}/maps") as f:
                ready = any("fastloader/_core" in line for line in f)
            time.sleep(0.05)
        print(json.dumps({{"server": server, "now": spawn_server.server_pid(),
                          "main": os.getpid(), "ours": ours, "torchs": torchs,
                          "preloaded": ready}}))
    """)
    server, ours, torchs = out["server"], out["ours"], out["torchs"]
    assert server is not None and out["now"] == server, "one server for both epochs"
    assert out["preloaded"], "the server never loaded fastloader's C module"
    for mine, theirs in zip(ours, torchs):
        strip = lambda batches, keys=("i", "env", "name", "method", "worker"): [
            {k: b[k] for k in keys} for b in batches]
        assert strip(mine) == strip(theirs)
    assert ours[0][0]["name"] == (["SpawnProcess"] if how == "context" else ["Process"]) * 2
    assert ours[0][0]["method"] == ["spawn"] * 2
    # workers: forks of the server, new ones each epoch (not persistent)
    for batches in ours:
        assert [p for b in batches for p in b["ppid"]] == [server] * 8
    assert not set(_pids(ours[0])) & set(_pids(ours[1]))
    for batches in torchs:
        assert [p for b in batches for p in b["ppid"]] == [out["main"]] * 8
    # the main module: once in the main process, once in every worker, never in the server
    by_pid = {}
    for pid, name in marks:
        by_pid.setdefault(pid, []).append(name)
    assert by_pid.pop(out["main"]) == ["__main__"]
    assert server not in by_pid
    workers = _pids(ours[0]) + _pids(ours[1]) + _pids(torchs[0]) + _pids(torchs[1])
    assert sorted(by_pid) == sorted(workers)
    assert all(names == ["__mp_main__"] for names in by_pid.values())


def test_numpy_global_random_state_is_fresh_in_every_worker_as_under_spawn(tmp_path):
    """A fresh interpreter seeds NumPy's global random state from the OS; a fork of
    the server would share the server's, and every worker of every epoch would draw
    the same numbers (the fork bug spawn users do not have)."""
    out, _ = _run(tmp_path, """
        loader = fastloader.DataLoader(Probe(), batch_size=1, num_workers=2,
                                       multiprocessing_context="spawn")
        draws = {}
        for e in range(3):
            for b in epoch(loader):
                draws.setdefault(f"{e}-{b['worker'][0]}", []).append(b["draw"][0])
        print(json.dumps({"first_draws": [d[0] for d in draws.values()]}))
    """)
    first = out["first_draws"]
    assert len(first) == 6
    assert len(set(first)) == 6, f"workers drew the same numbers: {first}"


def test_a_change_to_what_a_spawned_child_inherits_starts_a_new_server(tmp_path):
    """A server started before the program changed its environment or its stdio
    would hand workers the old ones; spawn hands the new. Such a change starts a
    new server (what spawn costs, once), an unchanged state keeps the old one, and
    the old server is reaped once its last worker is gone."""
    out, _ = _run(tmp_path, """
        import psutil
        loader = fastloader.DataLoader(Probe(), batch_size=2, num_workers=2,
                                       multiprocessing_context="spawn")
        first = spawn_server.server_pid()
        before = epoch(loader)
        same = spawn_server.server_pid()
        os.environ["SPAWN_TEST_VAR"] = "changed"
        after_env = epoch(loader)
        second = spawn_server.server_pid()
        # the first server exits once its last worker has (each holds its alive pipe)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and psutil.pid_exists(first) and \
                psutil.Process(first).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
        # stdio: fd 2 now a file; a worker's stderr goes there, as a spawned one's would
        log = os.path.abspath("worker_stderr.txt")
        saved = os.dup(2)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 2)
        os.close(fd)
        said = epoch(fastloader.DataLoader(Says(), batch_size=2, num_workers=2,
                                           multiprocessing_context="spawn"))
        os.dup2(saved, 2)
        third = spawn_server.server_pid()
        # libc's environment behind os.environ's back, a resource limit, the process group
        os.putenv("SPAWN_TEST_PUT", "put")
        put = epoch(loader)
        soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
        new_core = 0 if soft != 0 else (1 << 20 if hard == resource.RLIM_INFINITY
                                        else min(hard, 1 << 20))
        assert new_core != soft, "cannot change RLIMIT_CORE here"
        resource.setrlimit(resource.RLIMIT_CORE, (new_core, hard))
        core = epoch(loader)
        os.setpgrp()
        group = epoch(loader)
        unchanged = epoch(loader)
        with open(log) as f:
            lines = f.read().splitlines()
        zombies = [c.pid for c in psutil.Process().children()
                   if c.status() == psutil.STATUS_ZOMBIE]
        print(json.dumps({"servers": [first, same, second, third],
                          "later": [ppids(b) for b in (put, core, group, unchanged)],
                          "put": sorted({v for b in put for v in b["put"]}),
                          "core": sorted({v for b in core for v in b["core"]}),
                          "pgrp": sorted({v for b in group for v in b["pgrp"]}),
                          "my_pgrp": os.getpgrp(), "new_core": new_core,
                          "env_before": [e for b in before for e in b["env"]],
                          "env_after": [e for b in after_env for e in b["env"]],
                          "said": sorted(line for line in lines if " says " in line),
                          "said_pids": pids(said), "zombies": zombies,
                          "first_alive": psutil.pid_exists(first) and
                              psutil.Process(first).status() != psutil.STATUS_ZOMBIE}))
    """)
    first, same, second, third = out["servers"]
    assert first == same, "an unchanged state must keep the server"
    assert second != first and third not in (first, second)
    assert out["env_before"] == [""] * 8 and out["env_after"] == ["changed"] * 8
    assert len(out["said"]) == 8 and {int(line.split()[1]) for line in out["said"]} == set(
        out["said_pids"])
    # the first server exited once its workers had, and was reaped at the next start
    assert not out["first_alive"] and first not in out["zombies"]
    # each later change its own server; no change, the same one
    later = [p[0] for p in out["later"]]
    assert all(len(p) == 1 for p in out["later"]), out["later"]
    assert len(set(later[:3]) | {third}) == 4 and later[3] == later[2]
    # (under make test-asan, ASan's runtime sets the soft core limit to 0 in every
    # process it starts, the new server included: its workers see 0)
    core = [0] if os.environ.get("FASTLOADER_ASAN") else [out["new_core"]]
    assert out["put"] == ["put"] and out["core"] == core and out["pgrp"] == [out["my_pgrp"]]


def test_a_killed_server_is_started_again(tmp_path):
    out, _ = _run(tmp_path, """
        loader = fastloader.DataLoader(Probe(), batch_size=2, num_workers=2,
                                       multiprocessing_context="spawn")
        a = epoch(loader)
        first = spawn_server.server_pid()
        os.kill(first, signal.SIGKILL)
        b = epoch(loader)
        print(json.dumps({"first": first, "then": spawn_server.server_pid(),
                          "a": [i for x in a for i in x["i"]],
                          "b": [i for x in b for i in x["i"]],
                          "ppid_b": ppids(b)}))
    """)
    assert out["a"] == out["b"] == list(range(8))
    assert out["then"] not in (None, out["first"]) and out["ppid_b"] == [out["then"]]


def test_a_server_that_dies_while_two_workers_start_is_started_again_once(tmp_path):
    """The server dies just as an epoch's two workers start (each from its own
    thread): one thread has found it running, the other finds it dead and starts
    the next. The first must connect to the new server, not fail: Python's
    connect_to_new_process() read the address after the other thread had cleared
    it (CI: "TypeError: a bytes-like object is required, not 'NoneType'").
    Interleaving forced: tests/support/server_race.py."""
    out, _ = _run(tmp_path, """
        from tests.support.server_race import RESTART_RACE, make_it_die
        loader = fastloader.DataLoader(Probe(), batch_size=2, num_workers=2,
                                       multiprocessing_context="spawn")
        a = epoch(loader)
        first = spawn_server.server_pid()
        raced = make_it_die(spawn_server._State.server, RESTART_RACE)
        b = epoch(loader)
        print(json.dumps({"first": first, "then": spawn_server.server_pid(),
                          "raced": raced,
                          "a": [i for x in a for i in x["i"]],
                          "b": [i for x in b for i in x["i"]],
                          "ppid_b": ppids(b)}))
    """)
    assert out["raced"] == [True]
    assert out["a"] == out["b"] == list(range(8))
    assert out["then"] not in (None, out["first"]) and out["ppid_b"] == [out["then"]]


def test_a_worker_start_asks_the_server_through_its_own_python_s_protocol():
    """The fix above reads the server's fields under its lock, but must still ask
    through the server's own connect_to_new_process(): the protocol is each Python
    version's (3.14's server first checks a key on the socket, which a copy of
    3.11's steps does not answer: every worker start would fail there). Checked with a
    server whose connect_to_new_process() records what it was asked with."""
    from multiprocessing import forkserver as mp_forkserver
    from multiprocessing.connection import wait

    from fastloader import spawn_server

    asked = []

    class Recording(mp_forkserver.ForkServer):
        def connect_to_new_process(self, fds):
            asked.append((self._forkserver_address, self._forkserver_pid))
            return super().connect_to_new_process(fds)

    server = Recording()
    try:
        status_r, data_w, pid = spawn_server._connect(server, [])
        try:
            os.close(data_w)   # the forked child reads nothing, and exits
            assert wait([status_r], 120), "the server forked no child"
            child = mp_forkserver.read_signed(status_r)
        finally:
            os.close(status_r)
        assert child > 0 and pid == server._forkserver_pid
        assert asked == [(server._forkserver_address, pid)]
    finally:
        server._stop()


@pytest.mark.parametrize("workers,blob", [(2, 0), (1, 1 << 20)], ids=["small", "1MiB"])
def test_a_hung_server_is_killed_and_replaced(tmp_path, workers, blob):
    """A server that stops answering (here: stopped; in life: deadlocked in a fork)
    would hold the training loop for ever: after REPLY_TIMEOUT_S it is killed, a
    new one starts, and the epoch goes on. Also when what the worker is sent
    (here a 1 MiB dataset) does not fit the pipe, which nothing reads until the
    server forks."""
    out, _ = _run(tmp_path, """
        ds = Probe()
        ds.blob = b"x" * BLOB
        loader = fastloader.DataLoader(ds, batch_size=2, num_workers=WORKERS,
                                       multiprocessing_context="spawn")
        a = epoch(loader)
        spawn_server.REPLY_TIMEOUT_S = 5   # for a server that has answered before
        first = spawn_server.server_pid()
        os.kill(first, signal.SIGSTOP)
        b = epoch(loader)
        gone = not os.path.exists(f"/proc/{first}")   # killed and reaped
        print(json.dumps({"first": first, "then": spawn_server.server_pid(),
                          "a": [i for x in a for i in x["i"]],
                          "b": [i for x in b for i in x["i"]],
                          "ppid_b": ppids(b), "gone": gone}))
    """.replace("BLOB", str(blob)).replace("WORKERS", str(workers)))
    assert out["a"] == out["b"] == list(range(8))
    assert out["then"] not in (None, out["first"]) and out["ppid_b"] == [out["then"]]
    assert out["gone"]


def test_fds_above_1023_are_waited_on(tmp_path):
    """A process with many files open hands out fds above 1023, which select()
    cannot take: the server's answers and deaths are waited for with poll()."""
    out, _ = _run(tmp_path, """
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        loader = fastloader.DataLoader(Probe(), batch_size=2, num_workers=2,
                                       multiprocessing_context="spawn")
        got = epoch(loader)
        print(json.dumps({"i": [i for x in got for i in x["i"]], "top": max(held)}))
    """)
    assert out["top"] > 1023 and out["i"] == list(range(8))


def test_a_forked_child_starts_its_own_server_not_its_parents(tmp_path):
    """A child forked from a process with a server inherits the server's handle; the
    server is not its child (it cannot wait for it), so it starts its own."""
    out, _ = _run(tmp_path, """
        loader = fastloader.DataLoader(Probe(), batch_size=2, num_workers=2,
                                       multiprocessing_context="spawn")
        parent_server = spawn_server.server_pid()
        def in_the_child():
            inherited = spawn_server.server_pid()
            got = epoch(loader)
            return {"inherited": inherited, "server": spawn_server.server_pid(),
                    "ppid": ppids(got), "n": sum(len(b["i"]) for b in got)}
        msg = in_child(in_the_child)
        mine = epoch(loader)
        print(json.dumps({"parent_server": parent_server, "child": msg,
                          "parent_ppid": ppids(mine),
                          "parent_server_after": spawn_server.server_pid()}))
    """)
    child = out["child"]
    assert "error" not in child, child
    assert child["inherited"] is None and child["n"] == 8
    assert child["server"] not in (None, out["parent_server"])
    assert child["ppid"] == [child["server"]]
    assert out["parent_ppid"] == [out["parent_server"]] == [out["parent_server_after"]]


def test_exit_handlers_run_in_workers_as_in_spawned_ones(tmp_path):
    """The forkserver ends its children with os._exit(); a spawned worker's
    interpreter runs atexit handlers and weakref finalizers (a TemporaryDirectory
    removes itself) as it exits. Both, for fastloader's workers and torch's."""
    out, _ = _run(tmp_path, """
        got = {}
        for name, cls in (("fastloader", fastloader.DataLoader),
                          ("torch", torch.utils.data.DataLoader)):
            batches = epoch(cls(LeavesTidying(), batch_size=2, num_workers=2,
                                multiprocessing_context="spawn"))
            workers = pids(batches)
            # The marks come first: atexit runs handlers last-registered first, and
            # weakref's (which removes the directories) was registered before them.
            # So wait for both, or for the deadline.
            def left():
                return sorted(d for d in os.listdir(".") if d.startswith("tmp"))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (left() or not all(
                    os.path.exists(f"atexit-{p}") for p in workers)):
                time.sleep(0.05)
            got[name] = {"atexit": [os.path.exists(f"atexit-{p}") for p in workers],
                         "left": left()}
        got["served"] = spawn_server.server_pid() is not None
        print(json.dumps(got))
    """)
    assert out["served"]
    for name in ("fastloader", "torch"):
        assert out[name] == {"atexit": [True, True], "left": []}, (name, out[name])


def test_off_by_default_workers_are_spawned(tmp_path):
    out, _ = _run(tmp_path, """
        loader = fastloader.DataLoader(Probe(), batch_size=2, num_workers=2,
                                       multiprocessing_context="spawn")
        got = epoch(loader)
        print(json.dumps({"server": spawn_server.server_pid(), "ppid": ppids(got),
                          "main": os.getpid()}))
    """, {"FASTLOADER_SPAWN_SERVER": ""})
    assert out["server"] is None and out["ppid"] == [out["main"]]


_RESEED_SCRIPT = """
import json, os
import numpy as np
np.random.randint(0, 10)   # numpy.random imported in the server (NumPy 1.x does so)
import fastloader._spawn_server_child   # as the server's preload
""" + _IN_CHILD + """

def draw_in_child(then=None):
    return in_child(lambda: [int(np.random.randint(0, 2**62))] + ([then()] if then else []))

def grandchild_and_me():
    # in a child: a grandchild keeps its parent's state, as any fork does
    state = np.random.get_state()
    theirs = draw_in_child()[0]
    np.random.set_state(state)
    return [theirs, int(np.random.randint(0, 2**62))]

children = [draw_in_child()[0] for _ in range(3)]
nested = draw_in_child(grandchild_and_me)[1]
print(json.dumps({"children": children, "server": int(np.random.randint(0, 2**62)),
                  "grandchild": nested}))
"""


def test_each_process_the_server_forks_draws_numpy_state_anew(subprocess_env):
    """The server's preload reseeds NumPy's global random state in each process it
    forks (where the server has imported numpy.random), and only in those."""
    done = subprocess.run([sys.executable, "-c", _RESEED_SCRIPT], env=subprocess_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(set(out["children"] + [out["server"]])) == 4, out
    theirs, mine = out["grandchild"]
    assert theirs == mine, "a process forked by the server's child keeps its parent's state"
