"""Instruction counts of the C core's hot paths, per batch, with callgrind.

`python -m benchmarks.core_profile` runs both ends of one channel in a single
process (tests/loopback.py's pairing) for a tiny-workload batch: the worker's
publish (encode into a slot) and the main process's recv (decode into tensor
views), under `valgrind --tool=callgrind`, and prints the inclusive instruction
count per batch of each C entry point. Instruction counts do not depend on what
else the machine runs, so they compare across commits where wall time cannot."""
import os
import re
import subprocess
import sys
import tempfile

ROUNDS = 400
ENTRY_POINTS = ["workerchan_publish", "fl_plan_build", "fl_plan_write", "fl_recv",
                "fl_mainchan_take", "fl_decode", "mainchan_put_index", "workerchan_get_task"]

DRIVER = f"""
import torch
from benchmarks.loopback import make_pair
from fastloader import _core
from fastloader.collate import slot_collate
main, worker = make_pair()
rows = torch.randn(64, 16)
samples = [(rows[i], i) for i in range(64)]
for i in range({ROUNDS}):
    main.put_index(i, list(range(64)))
    worker.get_task()
    worker.publish(_core.RES_BATCH, i, slot_collate(samples))
    got = _core.recv((main,), 0, 5.0)
    del got
main.close()
"""


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                        sys.executable, "-c", DRIVER], check=True,
                       capture_output=True, env=dict(os.environ, PYTHONMALLOC="malloc"))
        text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out],
                              check=True, capture_output=True, text=True).stdout
    print(f"| C function | instructions per batch (inclusive), {ROUNDS} tiny batches |")
    print("|---|---:|")
    for name in ENTRY_POINTS:
        m = re.search(rf"^\s*([\d,]+)\s+\([^)]*\)\s+\S*:{name}\b", text, re.M)
        count = int(m.group(1).replace(",", "")) // ROUNDS if m else None
        print(f"| `{name}` | {count:,} |" if count is not None else f"| `{name}` | n/a |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
