"""Time to the first batch under spawn and forkserver, against torch's DataLoader.

    python -m benchmarks.startup                      # 2M names, spawn + forkserver, 3 repeats
    python -m benchmarks.startup --quick              # 1M names, 1 repeat
    python -m benchmarks.startup --floor --methods spawn --json out.json

The dataset holds one file name per sample (about 40 bytes each, ImageNet-like):
torch's DataLoader gets them as a Python list, fastloader as a PackedStringArray
(budget, issue 5: fastloader's first batch in <= 0.5x torch's time, under both
start methods). ``--floor`` adds torch with the packed array and fastloader with
a dataset holding no names at all (the cost of starting two interpreters).

Every measurement runs in a fresh interpreter: the forkserver lives as long as
the process that started it, and a server warmed by an earlier run would flatter
every later one. The child builds the names (not timed), then times

- first epoch: from constructing the loader to its first batch in hand (a
  training script waits for exactly that; fastloader starts the forkserver when
  the loader is built, so the clock must include construction);
- next epoch: a second ``iter()`` on the same loader to its first batch (the
  workers are not persistent, so every epoch starts them again).

Repeats alternate the order of the configurations; the ratio is the median of
the per-repeat ratios, with their range.
"""

import argparse
import json
import sys
import time
import warnings

from benchmarks import packed_memory_datasets as mds
from benchmarks.harness import Stats, markdown_table, progress, run_child

WORKERS = 2
BATCH = 64
BUDGET = 0.5
REFERENCE, CANDIDATE = "torch + list", "fastloader + packed"
FLOOR_CONFIGS = ("torch + packed", "fastloader, no names")
# configuration -> (loader, how the names are held)
CONFIGS = {
    REFERENCE: ("torch", "list"),
    CANDIDATE: ("fastloader", "packed"),
    "torch + packed": ("torch", "packed"),
    "fastloader, no names": ("fastloader", "none"),
}


# ---- one measurement, in a fresh interpreter ---------------------------------------------

def _dataset(storage, n):
    if storage == "none":
        return mds.NoNamesDataset(n)
    names = list(mds.iter_names(n))
    if storage == "packed":
        from fastloader.packed import PackedStringArray

        names = PackedStringArray(names)
    return mds.NamesDataset(names)


def _first_batch(loader):
    it = iter(loader)
    next(it)
    return it


def measure(spec):
    """Runs in the child: {"loader", "storage", "method", "names"} -> seconds."""
    import torch
    import torch.utils.data

    if spec["loader"] == "torch":
        cls = torch.utils.data.DataLoader
    else:
        import fastloader

        cls = fastloader.DataLoader
    dataset = _dataset(spec["storage"], spec["names"])
    # A short epoch of random samples over the whole dataset (each worker still
    # gets every name). With replacement the sampler draws 32 indices at a time,
    # instead of a 2M-long permutation that would cost both loaders 0.1 s.
    sampler = torch.utils.data.RandomSampler(dataset, replacement=True,
                                             num_samples=BATCH * 4 * WORKERS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the heavy-metadata warning, on purpose
        started = time.perf_counter()
        loader = cls(dataset, batch_size=BATCH, sampler=sampler, num_workers=WORKERS,
                     multiprocessing_context=spec["method"])
        it = _first_batch(loader)
        first = time.perf_counter() - started
        for _ in it:
            pass
        del it
        started = time.perf_counter()
        it = _first_batch(loader)
        second = time.perf_counter() - started
        for _ in it:
            pass
    return {"first": first, "next": second}


# ---- the comparison --------------------------------------------------------------------------

def run(names, methods, repeats, floor=False, step_prefix=""):
    """{method: {config: {"first": [s...], "next": [s...]}}}"""
    configs = [REFERENCE, CANDIDATE] + (list(FLOOR_CONFIGS) if floor else [])
    results = {}
    for method in methods:
        times = {c: {"first": [], "next": []} for c in configs}
        for repeat in range(repeats):
            for config in (configs if repeat % 2 == 0 else configs[::-1]):
                loader, storage = CONFIGS[config]
                got = run_child("benchmarks.startup", {"loader": loader, "storage": storage, "method": method,
                                 "names": names})
                for key in ("first", "next"):
                    times[config][key].append(got[key])
                progress(f"{step_prefix}{method} repeat {repeat + 1}/{repeats} {config:<20} "
                         f"first batch {got['first']:.2f} s, next epoch {got['next']:.2f} s")
        results[method] = times
    return results


def verdict(method_times):
    ref, cand = method_times[REFERENCE]["first"], method_times[CANDIDATE]["first"]
    paired = Stats.of(c / r for c, r in zip(cand, ref))
    if paired.median <= BUDGET:
        text = "met"
    else:
        text = "NOT met (within noise)" if paired.low <= BUDGET else "NOT met"
    return paired, text


def _fmt(stats):
    return f"{stats.median:.2f} ({stats.low:.2f}-{stats.high:.2f})"


def render_report(results, names, repeats):
    headers = ["start method", "configuration", "first epoch: 1st batch s median (min-max)",
               "ratio vs torch + list", "budget", "result", "next epoch: 1st batch s"]
    rows = []
    for method, times in results.items():
        paired, text = verdict(times)
        ref_next = Stats.of(times[REFERENCE]["next"]).median
        for config, t in times.items():
            first, nxt = Stats.of(t["first"]), Stats.of(t["next"])
            if config == CANDIDATE:
                ratio = f"{paired.median:.2f}x ({paired.low:.2f}-{paired.high:.2f})"
                budget, result = f"<= {BUDGET}x", text
            else:
                ratio = f"{first.median / Stats.of(times[REFERENCE]['first']).median:.2f}x"
                budget = result = ""
            rows.append([method, config, _fmt(first), ratio, budget, result,
                         f"{_fmt(nxt)} ({nxt.median / ref_next:.2f}x)"])
    note = (f"\n{names:,} names, {WORKERS} workers, batch {BATCH}, {repeats} alternating "
            "repeat(s), each in a fresh interpreter. First epoch: from constructing the loader "
            "to its first batch. Next epoch: a second iter() on the same loader (workers not "
            "persistent). Ratio for fastloader + packed: median (range) of the per-repeat "
            "ratios.")
    return markdown_table(headers, rows, align="llrrllr") + note


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1M names, 1 repeat")
    parser.add_argument("--names", type=int, default=None, help="default 2M (1M with --quick)")
    parser.add_argument("--methods", default="spawn,forkserver")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--floor", action="store_true",
                        help="also torch + packed and fastloader with no names")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.names is None:
        args.names = 1_000_000 if args.quick else 2_000_000
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return 0
    results = run(args.names, args.methods, args.repeats, floor=args.floor)
    print(render_report(results, args.names, args.repeats))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"names": args.names, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
