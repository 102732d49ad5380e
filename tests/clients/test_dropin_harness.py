"""The client harness itself: a client run that hangs ends with every process's
stacks in the report and leaves no process behind, even one that left the
process group (CI once lost 15 minutes to a hung 2-rank accelerate run; killing
only the script would leave its ranks)."""
import os
import sys

import psutil
import pytest
import torch

from tests.clients._dropin_harness import _run, run_script

# (what dump_stacks_on_sigusr1 in _dropin_common does, without importing torch,
# which on a loaded box could outlast the timeout)
HANGS = """
import faulthandler, os, signal, time

def parent_waits_for_ever():
    time.sleep(3600)

def child_waits_for_ever():
    time.sleep(3600)

faulthandler.register(signal.SIGUSR1, all_threads=True)
child = os.fork()
if child:
    print(os.getpid(), child, flush=True)
    parent_waits_for_ever()
os.setsid()   # out of the group, as a launcher may put a rank
child_waits_for_ever()
"""


def test_a_hung_run_reports_every_process_stacks_and_leaves_none(tmp_path):
    pids, stderr = _hung_run(HANGS, tmp_path, timeout=5)
    assert "parent_waits_for_ever" in stderr and "child_waits_for_ever" in stderr, stderr
    assert [p for p in pids if _alive(p)] == []


# The process that left the group closes its pipes, then hangs holding 1 GiB of
# touched memory: killed, it is still freeing that memory (not yet a zombie) when
# the pipes' EOF lets the harness's communicate() return. CI once caught a
# killed process in that window.
DIES_SLOWLY = """
import mmap, os, time
child = os.fork()
if child:
    print(os.getpid(), child, flush=True)
    time.sleep(3600)
os.setsid()
memory = mmap.mmap(-1, 1 << 30)
for offset in range(0, len(memory), mmap.PAGESIZE):
    memory[offset] = 1
os.close(1)
os.close(2)
time.sleep(3600)
"""


def test_a_killed_run_is_dead_when_the_harness_returns_though_it_dies_slowly(tmp_path):
    # (touching 1 GiB takes ~1 s here: the timeout leaves it 10x that)
    pids, _stderr = _hung_run(DIES_SLOWLY, tmp_path, timeout=10)
    assert [p for p in pids if _alive(p)] == []


def _hung_run(script, tmp_path, timeout):
    """Run `script` (which prints its two pids, then hangs) under the harness with
    `timeout` (seconds; the script must have printed by then): (the pids, its stderr)."""
    returncode, stdout, stderr, hung = _run([sys.executable, "-c", script], str(tmp_path),
                                            timeout=timeout)
    assert hung and returncode != 0
    pids = [int(p) for p in stdout.split()]
    assert len(pids) == 2, stdout
    return pids, stderr


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_only_the_torch_reference_is_run_again_after_a_hang(tmp_path):
    """The reference (torch's own DataLoader) gets a second run after a hang; a run
    with fastloader that hangs fails at once."""
    # (the second run is a bare Python start-up, ~30 ms here: the timeout is 150x
    # that, for a loaded box; the first run waits all of it out)
    os.makedirs(tmp_path / "ref")
    torch.save({"ranks": []}, tmp_path / "ref" / "saved-result.pt")
    result, markers = run_script("_hangs_once_script.py", "torch", str(tmp_path / "ref"),
                                 timeout=5)
    assert result == {"ranks": []} and markers == []
    assert sorted(os.listdir(tmp_path / "ref")) == [
        "_hangs_once_script-torch", "_hangs_once_script-torch-2", "ran-once",
        "saved-result.pt"]
    with pytest.raises(AssertionError, match="hung"):
        run_script("_hangs_once_script.py", "fastloader", str(tmp_path / "fast"), timeout=5)
