"""Dataset metadata and worker memory: a Python list of file names vs a packed array.

    python -m benchmarks.packed_memory                 # full run: 2M names, ~5 min
    python -m benchmarks.packed_memory --quick         # smoke run: 1M names, fork + spawn, ~1.5 min
    python -m benchmarks.packed_memory --names 4000000 --methods spawn --json out.json

Three sections, each a Markdown table on stdout (progress on stderr):

1. Worker memory over one epoch, per start method: each of torch's DataLoader and
   fastloader's, with the names in a Python list and in a PackedStringArray. Each
   configuration runs in a fresh interpreter (so no run inherits another's heap):
   it builds the names, starts 2 persistent workers (batch 1024, shuffled),
   measures each worker's private memory (USS, from /proc/<pid>/smaps) after 16
   warm-up batches and at the end of the epoch, and the total PSS of the main
   process plus the workers at the end. "growth" is what copy-on-read costs a
   forked worker; "USS at end" also shows what spawn/forkserver workers unpickled.
2. Time to the first batch under spawn and forkserver (budget: fastloader with
   a packed array <= 0.5x torch's DataLoader with the list), measured by
   benchmarks.startup, each run in a fresh interpreter, with the floor.
3. Building, saving and loading packed arrays; scanning a directory tree.
"""

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import timeit
import warnings

import psutil
import torch
import torch.utils.data

from benchmarks import packed_memory_datasets as mds
from benchmarks import startup
from benchmarks.harness import markdown_table, progress, run_child

MIB = 1 << 20
WORKERS = 2
EPOCH_BATCH = 1024
WARMUP_BATCHES = 16
VARIANTS = (("torch", "list"), ("torch", "packed"), ("fastloader", "list"),
            ("fastloader", "packed"))
QUICK_VARIANTS = (("torch", "list"), ("fastloader", "packed"))


# ---- one configuration, in a fresh interpreter ---------------------------------------------

def _loader_class(name):
    if name == "torch":
        return torch.utils.data.DataLoader
    import fastloader

    return fastloader.DataLoader


def _names(storage, n):
    if storage == "list":
        return list(mds.iter_names(n))
    from fastloader.packed import PackedStringArray

    return PackedStringArray(mds.iter_names(n))   # streamed: never a list


def _worker_pids(iterator):
    pids = getattr(iterator, "worker_pids", None)
    return list(pids) if pids is not None else [w.pid for w in iterator._workers]


def _full_info(pid):
    return psutil.Process(pid).memory_full_info()


def run_epoch(spec):
    """One configuration (``spec``: loader, storage, method, names); returns a dict."""
    warnings.simplefilter("ignore")   # the heavy-metadata warning is expected for lists
    n = spec["names"]
    t = time.perf_counter()
    dataset = (mds.NoNamesDataset(n) if spec["storage"] == "none"
               else mds.NamesDataset(_names(spec["storage"], n)))
    build_s = time.perf_counter() - t
    gc.collect()
    loader = _loader_class(spec["loader"])(
        dataset, batch_size=EPOCH_BATCH, shuffle=True, num_workers=WORKERS,
        multiprocessing_context=spec["method"], persistent_workers=True)
    t = time.perf_counter()
    it = iter(loader)
    checksum = int(next(it).sum())
    first_batch_s = time.perf_counter() - t
    for _ in range(WARMUP_BATCHES - 1):
        checksum += int(next(it).sum())
    pids = _worker_pids(it)
    start = [_full_info(p).uss for p in pids]
    for batch in it:
        checksum += int(batch.sum())
    epoch_s = time.perf_counter() - t
    end_info = [_full_info(p) for p in pids]
    me = _full_info(os.getpid())
    result = {
        **spec,
        "build_s": build_s,
        "first_batch_s": first_batch_s,
        "epoch_s": epoch_s,
        "worker_uss_start": start,
        "worker_uss_end": [i.uss for i in end_info],
        "pss_total": me.pss + sum(i.pss for i in end_info),
        "main_uss": me.uss,
        "checksum": checksum,
    }
    it._shutdown_workers()
    return result


# ---- 2. time to first batch under spawn and forkserver -------------------------------------

def ttfb_section(args):
    # benchmarks.startup measures it (each run in a fresh interpreter); here with
    # the floor configurations too
    methods = [m for m in args.methods if m != "fork"] or ["spawn"]
    results = startup.run(args.ttfb_names, methods, args.repeats, floor=True,
                          step_prefix="time to first batch: ")
    out = {"names": args.ttfb_names, "results": results,
           "verdicts": {m: startup.verdict(t)[1] for m, t in results.items()}}
    text = startup.render_report(results, args.ttfb_names, args.repeats)
    return text + (" \"fastloader, no names\" is the floor: the same loader and workers "
                   "with a dataset that holds nothing."), out


# ---- 3. building, loading, scanning -----------------------------------------------------------

def build_section(args):
    from fastloader.packed import PackedStringArray

    n = args.names
    rows = []
    names = list(mds.iter_names(n))
    list_bytes = sys.getsizeof(names) + sum(sys.getsizeof(s) for s in names)
    t = time.perf_counter()
    packed = PackedStringArray(names)
    rows.append([f"PackedStringArray(list of {n:,})", f"{(time.perf_counter() - t) * 1e3:,.0f} ms"])
    t = time.perf_counter()
    PackedStringArray(mds.iter_names(n))
    rows.append([f"PackedStringArray(generator of {n:,}) incl. making the names",
                 f"{(time.perf_counter() - t) * 1e3:,.0f} ms"])
    rows.append(["memory: Python list (objects + list) / packed (.nbytes)",
                 f"{list_bytes / MIB:,.0f} MiB / {packed.nbytes / MIB:,.0f} MiB"])
    glb = {"p": packed, "l": names, "i": n // 2}
    per = min(timeit.repeat("p[i]", globals=glb, number=200_000, repeat=5)) / 200_000
    per_list = min(timeit.repeat("l[i]", globals=glb, number=200_000, repeat=5)) / 200_000
    rows.append(["a[i] -> str (packed / list)", f"{per * 1e9:.0f} ns / {per_list * 1e9:.0f} ns"])
    tmp = tempfile.mkdtemp(prefix="fastloader-bench-")
    try:
        path = os.path.join(tmp, "names.fpk")
        t = time.perf_counter()
        packed.save(path)
        rows.append([f"save ({os.path.getsize(path) / MIB:,.0f} MiB file)",
                     f"{(time.perf_counter() - t) * 1e3:,.0f} ms"])
        t = time.perf_counter()
        loaded = PackedStringArray.load(path)
        rows.append(["load (memory-mapped; items checked as read)",
                     f"{(time.perf_counter() - t) * 1e3:,.2f} ms"])
        assert loaded[n - 1] == names[n - 1]
        del loaded
        rows += scan_rows(tmp, args.scan_files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return markdown_table(["operation", "time / size"], rows)


def scan_rows(tmp, files):
    from fastloader.packed import PackedStringArray

    root = os.path.join(tmp, "tree")
    progress(f"directory scan: creating {files:,} files")
    per_dir = 1000
    for i in range(files):
        d = os.path.join(root, f"class_{i // per_dir:05d}")
        if i % per_dir == 0:
            os.makedirs(d)
        open(os.path.join(d, f"img_{i:08d}.jpg"), "wb").close()
    os.sync()
    t = time.perf_counter()
    packed = PackedStringArray.from_directory(root, suffixes=(".jpg", ".png"))
    fast = time.perf_counter() - t
    t = time.perf_counter()
    ref = []
    for dirpath, _dirs, fnames in os.walk(root, followlinks=True):
        rel = os.path.relpath(dirpath, root)
        ref.extend(os.path.join(rel, f) for f in fnames if f.lower().endswith((".jpg", ".png")))
    ref.sort()
    slow = time.perf_counter() - t
    assert packed == ref
    return [[f"from_directory: {files:,} files in {files // per_dir:,} folders (sorted list via "
             "os.walk)", f"{fast * 1e3:,.0f} ms ({slow * 1e3:,.0f} ms)"]]


# ---- report ---------------------------------------------------------------------------------

def epoch_section(args):
    results = []
    variants = QUICK_VARIANTS if args.quick else VARIANTS
    for method in args.methods:
        for loader, storage in variants:
            spec = {"loader": loader, "storage": storage, "method": method, "names": args.names}
            progress(f"epoch: {method:<10} {loader:<10} + {storage:<6} ...")
            r = run_child("benchmarks.packed_memory", spec)
            growth = max(e - s for s, e in zip(r["worker_uss_start"], r["worker_uss_end"]))
            progress(f"  worker USS growth {growth / MIB:.1f} MiB, end "
                     f"{max(r['worker_uss_end']) / MIB:.1f} MiB, PSS total "
                     f"{r['pss_total'] / MIB:.0f} MiB, first batch {r['first_batch_s']:.2f} s")
            results.append(r)
    checksums = {r["checksum"] for r in results}
    rows = []
    for r in results:
        growth = [e - s for s, e in zip(r["worker_uss_start"], r["worker_uss_end"])]
        rows.append([
            r["method"], f"{r['loader']} + {r['storage']}",
            f"{max(growth) / MIB:,.1f}",
            f"{max(r['worker_uss_end']) / MIB:,.0f}",
            f"{r['pss_total'] / MIB:,.0f}",
            f"{r['first_batch_s']:.2f}",
            f"{r['epoch_s']:.1f}",
        ])
    table = markdown_table(
        ["start method", "loader + names", "worker USS growth over the epoch, MiB (max of 2)",
         "worker USS at end, MiB (max)", "PSS main + workers, MiB", "1st batch s", "epoch s"],
        rows, align="llrrrrr")
    note = (f"\n{args.names:,} names (~40 bytes each), {WORKERS} persistent workers, batch "
            f"{EPOCH_BATCH}, shuffled; USS after {WARMUP_BATCHES} warm-up batches and at the end "
            f"of the epoch; every configuration in a fresh interpreter."
            + ("" if len(checksums) == 1 else " WARNING: the epochs' checksums differ!"))
    return table + note, results


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.packed_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="1M names, fork and spawn, list-vs-packed only, 2 repeats")
    parser.add_argument("--names", type=int, default=None,
                        help="names in the epoch and build runs (default 2M, 1M with --quick)")
    parser.add_argument("--ttfb-names", type=int, default=2_000_000,
                        help="names for the time-to-first-batch runs (default 2M)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated start methods (default fork,spawn,forkserver; "
                             "fork,spawn with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="time-to-first-batch repeats (default 3, 1 with --quick)")
    parser.add_argument("--scan-files", type=int, default=None,
                        help="files in the directory-scan tree (default 200k, 20k with --quick)")
    parser.add_argument("--sections", default="epoch,ttfb,build",
                        help="comma-separated subset of epoch,ttfb,build")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.names is None:
        args.names = 1_000_000 if args.quick else 2_000_000
    if args.methods is None:
        args.methods = "fork,spawn" if args.quick else "fork,spawn,forkserver"
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.scan_files is None:
        args.scan_files = 20_000 if args.quick else 200_000
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        print(json.dumps(run_epoch(json.loads(args.child))))
        return 0
    out = {}
    header = (f"Machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, torch "
              f"{torch.__version__}; {'quick' if args.quick else 'full'} run.\n")
    print(header)
    if "epoch" in args.sections:
        text, out["epoch"] = epoch_section(args)
        print("### Worker memory over one epoch\n\n" + text + "\n", flush=True)
    if "ttfb" in args.sections:
        text, out["ttfb"] = ttfb_section(args)
        print("### Time to first batch, spawn and forkserver\n\n" + text + "\n", flush=True)
    if "build" in args.sections:
        print("### Building and loading\n\n" + build_section(args) + "\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
