"""The rings' geometry (offsets, capacities) lives in the control block, which the
worker can write: each side copies it once when it attaches and never reads it
again, so changing it afterwards has no effect (and cannot make fastloader read or
write outside its mappings). Also under `make test-asan`."""
import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rewriting_the_ring_geometry_after_attach_has_no_effect():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), os.path.join(ROOT, "python"), ROOT) if p]))
    proc = subprocess.run([sys.executable, "-m", "tests.support.ring_geometry_child"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"the loader's process died of "
        f"{signal.Signals(-proc.returncode).name if proc.returncode < 0 else proc.returncode}"
        f" once the control block's geometry changed\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["error"] is None, got
    assert got["seen"] == [float(i) for i in range(40)] * 2, got
