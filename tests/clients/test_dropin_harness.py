"""The client harness itself: a client run that hangs ends with every process's
stacks in the report and leaves no process behind (CI once lost 15 minutes to a
hung 2-rank accelerate run; killing only the script would leave its ranks)."""
import sys

import psutil

from tests.clients._dropin_harness import _run

HANGS = """
import os, time
from tests.clients._dropin_common import dump_stacks_on_sigusr1

def parent_waits_for_ever():
    time.sleep(3600)

def child_waits_for_ever():
    time.sleep(3600)

dump_stacks_on_sigusr1()
child = os.fork()
if child:
    print(os.getpid(), child, flush=True)
    parent_waits_for_ever()
child_waits_for_ever()
"""


def test_a_hung_run_reports_every_process_stacks_and_leaves_none(tmp_path):
    returncode, stdout, stderr, hung = _run([sys.executable, "-c", HANGS],
                                            str(tmp_path), timeout=10)
    assert hung and returncode != 0
    pids = [int(p) for p in stdout.split()]
    assert len(pids) == 2, stdout
    assert "parent_waits_for_ever" in stderr and "child_waits_for_ever" in stderr, stderr
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], alive
