"""Where the CPU time of a steady-state epoch goes, with Linux ``perf``.

    python -m benchmarks.perf_profile                   # tiny workload, both loaders
    python -m benchmarks.perf_profile --loaders fastloader --top 25 --epochs 4

For each loader it builds a tiny-workload loader (2 persistent fork workers,
batch 64), runs one untimed epoch (start-up and first-use costs stay out of
the profile), attaches ``perf record -e cpu-clock`` to the main process and the
workers, runs the measured epochs, and prints, separately for the main process
and the workers: the CPU milliseconds per batch, the share per shared object
(libpython, libtorch, fastloader's _core, the kernel...) and the top symbols.

``cpu-clock`` is a software event, so it needs no hardware counters (most VMs
have none) and works with ``perf_event_paranoid`` up to 2 for one's own
processes. Instruction counts, which do not depend on the machine's load, are
in ``benchmarks.core_profile`` (callgrind); this shows the whole process,
Python and torch included, which callgrind is too slow for.
"""
import argparse
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks import datasets

BATCH = 64
WORKERS = 2
FREQ = 1999   # Hz: odd, so it does not beat with periodic work


DATASETS = {"tiny": datasets.TinyDataset, "tiny_batched": datasets.TinyBatchedDataset,
            "tokens": datasets.TokenDataset}
COLLATE = {"tokens": datasets.pad_tokens}   # the others use the default collate


def _loader(name, length, dataset="tiny"):
    cls = torch.utils.data.DataLoader
    if name == "fastloader":
        import fastloader

        cls = fastloader.DataLoader
    kwargs = {"collate_fn": COLLATE[dataset]} if dataset in COLLATE else {}
    return cls(DATASETS[dataset](length), batch_size=BATCH, num_workers=WORKERS,
               multiprocessing_context="fork", persistent_workers=True, **kwargs)


def _worker_pids(loader):
    it = loader._iterator
    pool = getattr(it, "_pool", None)
    if pool is not None:
        return pool.pids
    return [w.pid for w in it._workers]


def record(name, epochs, batches_per_epoch, out, dataset="tiny"):
    """Profile ``epochs`` epochs of a warm loader; returns (main pid, worker pids, batches)."""
    loader = _loader(name, BATCH * batches_per_epoch, dataset)
    for _ in loader:   # start-up and first use stay out of the profile
        pass
    pids = [os.getpid(), *_worker_pids(loader)]
    perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(FREQ), "-g",
                             "-p", ",".join(map(str, pids)), "-o", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)   # perf attaches asynchronously
    batches = 0
    for _ in range(epochs):
        for _ in loader:
            batches += 1
    perf.send_signal(signal.SIGINT)
    _, err = perf.communicate(timeout=60)
    if perf.returncode not in (0, -signal.SIGINT) or not os.path.exists(out):
        raise RuntimeError(f"perf record failed: {err.decode(errors='replace')[-2000:]}")
    del loader
    return pids[0], pids[1:], batches


@functools.lru_cache(maxsize=None)   # the main process's and the workers' tables come from one run
def report(data, sort):
    """{pid: [(samples, what)]} for ``--sort pid,<sort>``, flat (no call graphs).
    (perf report's own --pid filter miscounts processes it attached to.)"""
    text = subprocess.run(
        ["perf", "report", "-i", data, "--stdio", "--no-children", "-g", "none", "-n",
         "--sort", f"pid,{sort}"], capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\s*[\d.]+%\s+(\d+)\s+(\d+):\S+\s+(.*\S)", line)
        if m:
            what = " ".join(m.group(3).split())
            rows.setdefault(int(m.group(2)), []).append((int(m.group(1)), what))
    return rows


def _side(data, pids, batches, top):
    def merged(sort):
        totals = {}
        for pid, rows in report(data, sort).items():
            if pid in pids:
                for n, what in rows:
                    totals[what] = totals.get(what, 0) + n
        return sorted(((n, w) for w, n in totals.items()), reverse=True)

    dsos = merged("dso")
    samples = sum(n for n, _ in dsos)
    if not samples:
        return "no samples"
    ms_per_batch = samples / FREQ * 1e3 / batches
    lines = [f"CPU {ms_per_batch:.3f} ms per batch ({samples} samples)", "",
             "| share | shared object |", "|---:|---|"]
    lines += [f"| {100 * n / samples:.1f}% | {w} |" for n, w in dsos[:10]]
    lines += ["", "| share | symbol |", "|---:|---|"]
    lines += [f"| {100 * n / samples:.1f}% | `{w}` |" for n, w in merged("dso,sym")[:top]]
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loaders", default="fastloader,torch")
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="tiny",
                        help="tiny_batched: the same samples through __getitems__; "
                        "tokens: variable-length sequences, padded by a custom collate")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2000, help="batches per epoch")
    parser.add_argument("--top", type=int, default=15, help="symbols listed per side")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if shutil.which("perf") is None:
        sys.exit("perf is not installed (Debian: apt install linux-perf)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in [n.strip() for n in args.loaders.split(",") if n.strip()]:
            data = os.path.join(tmp, f"{name}.data")
            main_pid, workers, batches = record(name, args.epochs, args.batches, data,
                                              args.dataset)
            print(f"## {name}: {batches} {args.dataset} batches ({WORKERS} fork workers, batch {BATCH})\n")
            print("### main process\n\n" + _side(data, [main_pid], batches, args.top) + "\n")
            print("### workers (together)\n\n" + _side(data, workers, batches, args.top) + "\n",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
