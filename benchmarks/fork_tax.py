"""What importing fastloader adds to every fork of the process.

    python -m benchmarks.fork_tax [--forks 31]

Every fork a process makes runs the at-fork hooks its modules registered: in the
child, before its first line of Python (each of a loader's forked workers, and
every fork the user's code or another library makes). What a hook writes there is
a copy-on-write fault per page. This compares, each in a fresh interpreter:

- ``torch``: torch imported;
- ``torch + fastloader``: fastloader imported too, and a fork loader with two
  workers run for one epoch (so its pools, reaper and channels have been used).

For each, the median over the forks of: the child's page faults (minflt) at its
first line, and the time from calling ``os.fork()`` to that line. Faults do not
depend on what else the machine runs; times do. Not a test: figures only.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import json, os, resource, statistics, sys, time
import torch
if sys.argv[1] == "fastloader":
    import fastloader
    loader = fastloader.DataLoader(list(range(64)), batch_size=8, num_workers=2,
                                   multiprocessing_context="fork")
    for _ in loader:
        pass
    from fastloader import reaper
    reaper.wait_idle(30)
faults, times = [], []
r, w = os.pipe()
for _ in range(int(sys.argv[2])):
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        seen = time.monotonic()
        os.write(w, json.dumps([resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                                seen - start]).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    flt, dt = json.loads(os.read(r, 200))
    faults.append(flt)
    times.append(dt)
print(json.dumps([statistics.median(faults), statistics.median(times) * 1e3]))
"""


def measure(kind: str, forks: int):
    out = subprocess.run([sys.executable, "-c", _CHILD, kind, str(forks)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forks", type=int, default=31)
    args = ap.parse_args(argv)
    base = measure("torch", args.forks)
    ours = measure("fastloader", args.forks)
    print("| process | child's faults at its first line | fork() to that line, ms |")
    print("|---|---:|---:|")
    print(f"| torch | {base[0]:.0f} | {base[1]:.2f} |")
    print(f"| torch + fastloader (a loader ran) | {ours[0]:.0f} | {ours[1]:.2f} |")
    print(f"fastloader adds {ours[0] - base[0]:.0f} faults to each forked child "
          f"(medians of {args.forks} forks each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
