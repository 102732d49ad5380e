"""share_on_node across ranks: subgroups, what a node is, and its failure modes.

Each scenario starts one process per rank (tests/support/multinode_share.py, gloo over
loopback); every rank writes what it got or the error it raised. The two-host
torchrun job (network namespaces) is in tests/distributed/test_multinode_hosts.py."""
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.support import helpers
from tests.support.ports import unclaimed_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 2000   # items in the scenarios' arrays (tests/support/multinode_share.py)


def run_ranks(scenario, world, out_dir, tag="job", wrap=None, timeout=150):
    """Start `world` ranks of `scenario`; wait for all; return their reports.
    wrap: {rank: [command prefix]} (e.g. to start a rank in another namespace).

    A job whose ranks do not all finish in `timeout`, or where gloo's own
    rendezvous failed, is run once more, from scratch: on a loaded box that
    rendezvous has failed or stalled for minutes (seen twice, in full-suite runs
    beside `make test-asan`: a rank in new_group's connectFullMesh). A hang or an
    error of fastloader's comes again and fails."""
    for attempt in (1, 2):
        try:
            reports, logs = _run_ranks_once(scenario, world, out_dir, tag, wrap, timeout)
        except subprocess.TimeoutExpired:
            if attempt == 2:
                raise
            continue
        if attempt == 1 and any("connectFullMesh" in text or "gloo/transport" in text
                                for text in logs + [json.dumps(r) for r in reports.values()]):
            continue
        return reports, logs


def _run_ranks_once(scenario, world, out_dir, tag, wrap, timeout):
    out_dir.mkdir(exist_ok=True)
    for old in out_dir.glob("*.json"):
        old.unlink()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT]),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(unclaimed_port()),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = []
    try:
        for rank in range(world):
            prefix = (wrap or {}).get(rank, [])
            procs.append(subprocess.Popen(
                [*prefix, sys.executable, "-m", "tests.support.multinode_share", scenario, str(rank),
                 str(world), str(out_dir), tag],
                cwd=ROOT, env=env, start_new_session=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:   # on every exit path: no rank outlives the test
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            # nor its pipe (after a timeout, an unclosed one warned in a later test)
            p.stdout.close()
    reports = {}
    for rank in range(world):
        path = out_dir / f"{rank}.json"
        if path.exists():
            reports[rank] = json.loads(path.read_text())
    return reports, logs


def expect_array(report, tag="job"):
    assert "error" not in report, report
    assert report["array"]["len"] == N
    assert report["array"]["first"] == f"{tag}/item_000000"
    assert report["array"]["last"] == f"{tag}/item_{N - 1:06d}"


def test_subgroup_smaller_than_the_job_builds_once_per_subgroup(tmp_path):
    """Job of 4, two subgroups of 2: the exchange is sized by the group, each
    subgroup builds once (its lowest rank) and its other rank attaches."""
    reports, logs = run_ranks("subgroup", 4, tmp_path / "out")
    assert sorted(reports) == [0, 1, 2, 3], logs
    for r in range(4):
        expect_array(reports[r])
        assert reports[r]["warnings"] == []
    assert [reports[r]["built"] for r in range(4)] == [True, False, True, False]


def test_rank_outside_the_group_is_told_so(tmp_path):
    reports, logs = run_ranks("not_member", 3, tmp_path / "out")
    assert sorted(reports) == [0, 1, 2], logs
    expect_array(reports[0])
    expect_array(reports[1])
    assert reports[2]["error_type"] == "ValueError", reports[2]
    assert "rank 2 is not in the group (ranks 0, 1)" in reports[2]["error"]
    assert not reports[2]["built"]


def _unshare_available():
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create PID namespaces here: {probe.stderr.strip()}"
    return None


PIDNS = ["unshare", "--pid", "--fork", "--mount", "--mount-proc"]


@pytest.mark.skipif(_unshare_available() is not None, reason=str(_unshare_available()))
def test_ranks_in_other_pid_namespaces_are_other_nodes(tmp_path):
    """Same machine, same hostname, rank 1 in its own PID namespace (its own
    /proc): the builder's /proc/<pid>/fd is not reachable from there, so they are
    two nodes and each builds (grouping by hostname made rank 1 fail to attach)."""
    reports, logs = run_ranks("pidns", 2, tmp_path / "out", wrap={1: PIDNS})
    assert sorted(reports) == [0, 1], logs
    for r in range(2):
        expect_array(reports[r])
        assert reports[r]["built"], f"rank {r} did not build its own copy"
        assert reports[r]["warnings"] == []
    assert reports[1]["pid"] == 1 or reports[1]["pid"] != reports[0]["pid"]


@pytest.mark.skipif(_unshare_available() is not None, reason=str(_unshare_available()))
def test_rank_that_cannot_attach_builds_its_own_copy_and_warns(tmp_path):
    """Told that both ranks are one node (node_key patched), rank 1 in another
    PID namespace cannot open the builder's fd: one warning, its own copy."""
    reports, logs = run_ranks("pidns_same_key", 2, tmp_path / "out", wrap={1: PIDNS})
    assert sorted(reports) == [0, 1], logs
    expect_array(reports[0])
    expect_array(reports[1])
    assert reports[0]["built"] and reports[0]["warnings"] == []
    assert reports[1]["built"]
    [warning] = reports[1]["warnings"]
    assert "rank 1 cannot attach to the array of rank 0" in warning
    assert "\n" not in warning


@pytest.mark.skipif(_unshare_available() is not None, reason=str(_unshare_available()))
def test_rank_whose_own_copy_fails_fails_every_rank(tmp_path):
    """Rank 1 cannot attach and its own build raises: it raises that, and rank 0
    (which has its array) raises naming rank 1 rather than waiting for it."""
    reports, logs = run_ranks("pidns_same_key_copy_fails", 2, tmp_path / "out",
                              wrap={1: PIDNS})
    assert sorted(reports) == [0, 1], logs
    assert reports[1]["error_type"] == "ValueError", reports[1]
    assert reports[0]["error_type"] == "FastLoaderError", reports[0]
    assert "rank 1 (building its own copy) failed: ValueError: no index today" \
        in reports[0]["error"]


def test_different_builders_is_an_error_on_every_rank(tmp_path):
    reports, logs = run_ranks("different_builders", 2, tmp_path / "out")
    assert sorted(reports) == [0, 1], logs
    for r in range(2):
        assert reports[r]["error_type"] == "FastLoaderError", reports[r]
        msg = reports[r]["error"]
        assert "different builders" in msg
        assert re.search(r"rank\(s\) 0: [\w.]+\.build(\[args \w+\])?;", msg), msg
        assert re.search(r"rank\(s\) 1: [\w.]+\.other_build\)", msg), msg
        assert not reports[r]["built"]


def test_partials_with_different_arguments_are_different_builders(tmp_path):
    """partial(build, "train") on rank 0 and partial(build, "val") on rank 1 build
    different data: an error on every rank, never rank 0's array handed to rank 1."""
    reports, logs = run_ranks("different_partial_args", 2, tmp_path / "out")
    assert sorted(reports) == [0, 1], logs
    for r in range(2):
        assert reports[r]["error_type"] == "FastLoaderError", reports[r]
        msg = reports[r]["error"]
        assert "different builders" in msg
        assert re.search(r"rank\(s\) 0: [\w.]+\.build\[args \w+\];", msg), msg
        assert re.search(r"rank\(s\) 1: [\w.]+\.build\[args \w+\]\)", msg), msg
        assert not reports[r]["built"]


def test_partials_with_equal_arguments_share_one_array(tmp_path):
    reports, logs = run_ranks("same_partial_args", 2, tmp_path / "out", tag="part")
    assert sorted(reports) == [0, 1], logs
    for r in range(2):
        expect_array(reports[r], tag="part")
    assert [reports[r]["built"] for r in range(2)] == [True, False]


def test_unpicklable_partial_arguments_ask_for_a_key():
    import threading

    import fastloader.distributed as fd

    def build(lock):
        return lock

    with pytest.raises(TypeError, match=r"cannot be pickled.*pass key="):
        fd._builder_name(functools.partial(build, threading.Lock()), None)
    assert fd._builder_name(functools.partial(build, threading.Lock()), "index") == "index"
    # set order differs between processes (hash randomisation): not a difference
    code = ("import functools, fastloader.distributed as fd, tests.support.multinode_share as m; "
            "print(fd._builder_name(functools.partial(m.build, {f's{i}' for i in range(50)}),"
            " None))")
    names = set()
    for seed in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed,
                   PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT]))
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                             capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr
        names.add(out.stdout.strip())
    assert len(names) == 1 and "[args " in names.pop()


def test_rank_that_never_calls_is_named_after_the_timeout(tmp_path):
    reports, logs = run_ranks("missing", 3, tmp_path / "out")
    assert sorted(reports) == [0, 1, 2], logs
    for r in (0, 1):
        assert reports[r]["error_type"] == "FastLoaderError", reports[r]
        assert "rank(s) 2 did not reach share_on_node within 8 s" in reports[r]["error"]
        assert not reports[r]["built"]
    assert reports[2]["skipped_the_call"]


def test_rank_that_never_calls_is_named_at_the_process_group_timeout(tmp_path):
    """No timeout= given: the exchange ends at the process group's timeout (15 s
    here), and the error still names the rank that never came."""
    reports, logs = run_ranks("missing_default", 3, tmp_path / "out")
    assert sorted(reports) == [0, 1, 2], logs
    for r in (0, 1):
        assert reports[r]["error_type"] == "FastLoaderError", reports[r]
        assert re.search(r"rank\(s\) 2 did not reach share_on_node within \d+ s",
                         reports[r]["error"]), reports[r]["error"]


def test_builder_of_another_node_that_dies_fails_every_rank(tmp_path):
    """Nodes {0} and {1, 2}; rank 1 exits inside build(): rank 2 names rank 1 as
    its builder, rank 0 (which built its own) fails the exchange instead of
    waiting for the process group's timeout."""
    reports, logs = run_ranks("two_nodes_builder_dies", 3, tmp_path / "out")
    assert sorted(reports) == [0, 1, 2], logs
    assert reports[1]["died"]
    assert reports[2]["error_type"] == "FastLoaderError", reports[2]
    assert "waiting for rank 1, the builder for this node" in reports[2]["error"]
    assert reports[0]["error_type"] == "FastLoaderError", reports[0]
    assert "exchanging the nodes' arrays (a rank died?)" in reports[0]["error"]
    assert reports[0]["built"] and not reports[2]["built"]


def test_builder_of_another_node_that_raises_fails_every_rank(tmp_path):
    reports, logs = run_ranks("two_nodes_builder_raises", 3, tmp_path / "out")
    assert sorted(reports) == [0, 1, 2], logs
    assert reports[1]["error_type"] == "ValueError"
    assert "rank 1 (the builder for another node) failed: ValueError: no index today" \
        in reports[0]["error"]
    assert "rank 1 (the builder for this node) failed: ValueError: no index today" \
        in reports[2]["error"]


def test_builder_that_dies_before_publishing_is_named(tmp_path):
    """Rank 0 exits inside build(): ranks 1 and 2 raise an error naming rank 0
    as their node's builder (gloo sees the closed connection), well before the
    process group's timeout."""
    reports, logs = run_ranks("builder_dies", 3, tmp_path / "out")
    assert sorted(reports) == [0, 1, 2], logs
    assert reports[0]["died"]
    for r in (1, 2):
        assert reports[r]["error_type"] == "FastLoaderError", reports[r]
        assert "waiting for rank 0, the builder for this node" in reports[r]["error"]


def test_builder_that_raises_fails_every_rank_of_its_node(tmp_path):
    reports, logs = run_ranks("builder_raises", 2, tmp_path / "out")
    assert reports[0]["error_type"] == "ValueError"
    assert reports[1]["error_type"] == "FastLoaderError"
    assert "rank 0 (the builder for this node) failed: ValueError: no index today" \
        in reports[1]["error"]


def test_builder_that_returns_no_packed_array_is_a_type_error(tmp_path):
    reports, logs = run_ranks("not_packed", 2, tmp_path / "out")
    assert reports[0]["error_type"] == "TypeError", reports[0]
    assert "build() must return a fastloader packed array, got list" in reports[0]["error"]
    assert reports[1]["error_type"] == "FastLoaderError"
    assert "rank 0 (the builder for this node) failed: TypeError" in reports[1]["error"]


def test_killed_job_leaves_no_data_for_the_next(tmp_path):
    """A job on named segments is SIGKILLed after publishing; the next job with
    the same builder gets its own data on every rank, never the dead job's."""
    before = helpers.shm_names()
    killed, logs = run_ranks("stale", 2, tmp_path / "killed", tag="killed")
    assert sorted(killed) == [0, 1], logs
    for r in range(2):
        expect_array(killed[r], "killed")
    reports, logs = run_ranks("stale", 2, tmp_path / "next", tag="next")
    assert sorted(reports) == [0, 1], logs
    for r in range(2):
        expect_array(reports[r], "next")
        assert reports[r]["array"]["strategy"] == "file_system"
    assert [reports[r]["built"] for r in range(2)] == [True, False]
    deadline = time.monotonic() + 10   # the dead job's segments go with its tracker
    while helpers.shm_left(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not helpers.shm_left(before)
