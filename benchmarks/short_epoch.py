"""Short epochs with non-persistent workers: what a 10-batch validation loop pays.

    python -m benchmarks.short_epoch                    # fork + spawn, 15 repeats
    python -m benchmarks.short_epoch --quick            # fork only, 5 repeats
    python -m benchmarks.short_epoch --methods fork --repeats 31 --json out.json

Every epoch starts and stops its workers (``persistent_workers=False``), so a
short one is dominated by start-up and teardown. Each epoch is timed in four
parts, on the main thread, as the training loop sees them:

- ``iter``: ``iter(loader)`` returns (workers started);
- ``first``: from then to the first batch in hand;
- ``teardown``: from the last batch in hand to the loop being free again: the
  ``next()`` that raises StopIteration plus ``del`` of the iterator (the time the
  iterator's end blocks the loop);
- ``epoch``: the whole thing, ``iter()`` to after the ``del``;
- CPU time (rusage, robust to other load): the main process's over the timed
  epoch, and the workers' over their whole lives (taken once they are reaped).

Workload: tiny samples (16 floats + an int label), batch 64, 2 workers, 10
batches. torch's DataLoader and fastloader alternate (the order flips every
repeat) in one process, on one loader each built once; after every timed epoch
the harness waits, untimed, until that epoch's workers are gone, so no epoch
pays for another's exiting workers. A back-to-back figure (epochs with no wait
in between, as a loop of short validation epochs runs) is taken too.
Figures are medians over the repeats; the ratio is the median of the
per-repeat ratios torch / fastloader (above 1: fastloader faster).
Both loaders run in a process that has ``numpy.random`` loaded already (as a
script using NumPy has): a forked worker seeds NumPy as torch does, and would
otherwise import it in every worker of every epoch (~20 ms; fastloader loads it
once in the main process before forking, which would flatter torch's later runs
in the same process anyway).
Budgets (issue 14): a 10-batch epoch >= 2x torch's speed; teardown blocks the
loop <= 5 ms.
"""

import argparse
import gc
import json
import statistics
import sys
import time
import warnings

import numpy.random  # noqa: F401  (see the docstring: both loaders start with it loaded)
import resource

import psutil
import torch

from benchmarks.datasets import TinyDataset
from benchmarks.harness import (Stats, json_record, markdown_table, positive_int, progress,
                                write_json)

WORKERS = 2
BATCH = 64
BATCHES = 10
EPOCH_BUDGET = 2.0        # fastloader epoch >= 2x torch's speed
TEARDOWN_BUDGET_S = 0.005
PARTS = ("iter", "first", "teardown", "epoch", "main_cpu", "workers_cpu")
LOADERS = ("torch", "fastloader")


def _loader_class(name):
    if name == "torch":
        return torch.utils.data.DataLoader
    import fastloader

    return fastloader.DataLoader


def _build(name, method):
    return _loader_class(name)(TinyDataset(BATCH * BATCHES), batch_size=BATCH,
                               num_workers=WORKERS, multiprocessing_context=method)


def _wait_gone(pids, timeout=10.0):
    """Untimed: until these workers are gone and reaped (by the loader that
    started them, or the server that forked them: never here), so that their CPU
    time is counted (_reaped_workers_cpu_s)."""
    end = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < end:
            try:
                psutil.Process(pid)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.001)


def _cpu_s(who):
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _reaped_workers_cpu_s():
    """CPU of every reaped worker so far: our children's, and the children's of the
    servers that fork fastloader's workers under spawn and forkserver (theirs to
    reap, so not in our RUSAGE_CHILDREN)."""
    from fastloader import forkserver, spawn_server
    total = _cpu_s(resource.RUSAGE_CHILDREN)
    for pid in {spawn_server.server_pid(), forkserver.server_pid()} - {None}:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.children_user + times.children_system
    return total


def _pids(it):
    pids = getattr(it, "worker_pids", None)
    if pids is None:
        pids = [w.pid for w in getattr(it, "_workers", ())]
    return list(pids)


def time_epoch(loader):
    """One epoch, timed in parts (seconds), and its workers' pids."""
    clock = time.perf_counter
    t0 = clock()
    it = iter(loader)
    t1 = clock()
    batch = next(it)
    t2 = clock()
    n = 1
    for batch in it:   # noqa: B007 -- the loop's own end is part of the teardown
        n += 1
        if n == BATCHES:
            t3 = clock()
    pids = _pids(it)
    del it, batch
    t4 = clock()
    assert n == BATCHES, n
    return {"iter": t1 - t0, "first": t2 - t1, "teardown": t4 - t3, "epoch": t4 - t0}, pids


def back_to_back(loader, epochs):
    """Seconds per epoch over `epochs` epochs run with no pause in between."""
    clock = time.perf_counter
    started = clock()
    for _ in range(epochs):
        for _batch in loader:
            pass
    return (clock() - started) / epochs


def measure(methods, repeats, chain, step_prefix=""):
    """{method: {"parts": {loader: {part: [s...]}}, "back_to_back": {loader: [s...]}}}"""
    results = {}
    for method in methods:
        loaders = {name: _build(name, method) for name in LOADERS}
        parts = {name: {p: [] for p in PARTS} for name in LOADERS}
        chained = {name: [] for name in LOADERS}
        arena = []   # fastloader: ring memory reserved per worker, from loader.stats()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in LOADERS:   # untimed: lazy imports and first-use set-up
                _wait_gone(time_epoch(loaders[name])[1])
            for repeat in range(repeats):
                order = LOADERS if repeat % 2 == 0 else LOADERS[::-1]
                for name in order:
                    gc.collect()
                    main0 = _cpu_s(resource.RUSAGE_SELF)
                    workers0 = _reaped_workers_cpu_s()
                    got, pids = time_epoch(loaders[name])
                    main1 = _cpu_s(resource.RUSAGE_SELF)
                    _wait_gone(pids)
                    # CPU of the epoch, whatever else the box runs: the main process
                    # until the loop was free again, and the workers' whole lives
                    got["main_cpu"] = main1 - main0
                    got["workers_cpu"] = _reaped_workers_cpu_s() - workers0
                    for p in PARTS:
                        parts[name][p].append(got[p])
                    if name == "fastloader":
                        arena.append(loaders[name].stats()["arena_reserved_bytes"] / WORKERS)
                progress(f"{step_prefix}{method} repeat {repeat + 1}/{repeats}: " + ", ".join(
                    f"{name} epoch {parts[name]['epoch'][-1] * 1e3:.1f} ms "
                    f"(teardown {parts[name]['teardown'][-1] * 1e3:.1f})" for name in LOADERS))
            for repeat in range(max(1, repeats // 5)):
                for name in (LOADERS if repeat % 2 == 0 else LOADERS[::-1]):
                    chained[name].append(back_to_back(loaders[name], chain))
                    gc.collect()
                    time.sleep(0.2)   # the last epoch's workers leave
        del loaders
        gc.collect()
        results[method] = {"parts": parts, "back_to_back": chained,
                           "arena_reserved_bytes_per_worker": arena}
    return results


def verdict(method_result):
    parts = method_result["parts"]
    speedup = Stats.of(t / f for t, f in zip(parts["torch"]["epoch"], parts["fastloader"]["epoch"]))
    teardown = Stats.of(parts["fastloader"]["teardown"])
    return {
        "epoch_speedup": speedup.median,
        "epoch_speedup_range": [speedup.low, speedup.high],
        "epoch_met": speedup.median >= EPOCH_BUDGET,
        "teardown_median_s": teardown.median,
        "teardown_max_s": teardown.high,
        "teardown_met": teardown.median <= TEARDOWN_BUDGET_S,
    }


def _ms(values):
    return Stats.of(values).ms()


def render_report(results, repeats, chain):
    headers = ["start method", "loader", "iter() ms", "first batch ms", "teardown ms",
               "10-batch epoch ms", "speed vs torch", f"back-to-back ms/epoch ({chain})",
               "CPU ms/epoch main + workers", "ring memory/worker KiB"]
    rows = []
    for method, res in results.items():
        v = verdict(res)
        for name in LOADERS:
            p = res["parts"][name]
            speed = (f"{v['epoch_speedup']:.2f}x ({v['epoch_speedup_range'][0]:.2f}-"
                     f"{v['epoch_speedup_range'][1]:.2f})" if name == "fastloader" else "1.00x")
            chained = res["back_to_back"][name]
            arena = res.get("arena_reserved_bytes_per_worker") if name == "fastloader" else None
            rows.append([method, name, _ms(p["iter"]), _ms(p["first"]), _ms(p["teardown"]),
                         _ms(p["epoch"]), speed,
                         f"{statistics.median(chained) * 1e3:.1f}" if chained else "-",
                         f"{statistics.median(p['main_cpu']) * 1e3:.0f} + "
                         f"{statistics.median(p['workers_cpu']) * 1e3:.0f}",
                         f"{statistics.median(arena) / 1024:.0f}" if arena else "-"])
    notes = []
    for method, res in results.items():
        v = verdict(res)
        notes.append(f"{method}: epoch >= {EPOCH_BUDGET:.0f}x torch "
                     f"{'met' if v['epoch_met'] else 'NOT met'}, teardown <= "
                     f"{TEARDOWN_BUDGET_S * 1e3:.0f} ms {'met' if v['teardown_met'] else 'NOT met'}"
                     f" (max {v['teardown_max_s'] * 1e3:.1f} ms)")
    note = (f"\nTiny samples, batch {BATCH}, {WORKERS} workers, {BATCHES} batches, "
            f"non-persistent workers; medians (min-max) over {repeats} alternating repeats in "
            "one process. Speed: median of per-repeat torch/fastloader epoch ratios. Ring memory: "
            "fastloader's `arena_reserved_bytes` per worker (shared memory its ring holds). CPU: "
            "rusage of the main process over the timed epoch, and of the epoch's workers over "
            "their lives (robust to a busy box).\n"
            + "\n".join(notes))
    return markdown_table(headers, rows, align="llrrrrrrrr") + note


def report_to_json(results, args, environment=None):
    return json_record("short_epoch", environment or _environment(), args,
                       results=results,
                       verdicts={m: verdict(r) for m, r in results.items()})


def _environment():
    import platform

    import fastloader

    return {"python": platform.python_version(), "torch": torch.__version__,
            "fastloader": getattr(fastloader, "__version__", None),
            "cpus": psutil.cpu_count()}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.short_epoch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fork only, 5 repeats")
    parser.add_argument("--methods", default=None, help="default fork,spawn (fork with --quick)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="default 15 (5 with --quick)")
    parser.add_argument("--chain", type=positive_int, default=None,
                        help="epochs per back-to-back run (default 10, 5 with --quick)")
    parser.add_argument("--context", choices=("fork", "spawn", "forkserver"), default=None,
                        help="one start method (what benchmarks.run passes)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.methods is None:
        args.methods = args.context or ("fork" if args.quick else "fork,spawn")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.repeats is None:
        args.repeats = 5 if args.quick else 15
    if args.chain is None:
        args.chain = 5 if args.quick else 10
    return args


def run(args, step_prefix=""):
    """Measure and return the JSON document (what benchmarks.run stores)."""
    results = measure(args.methods, args.repeats, args.chain, step_prefix=step_prefix)
    return report_to_json(results, args)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    document = run(args)
    print(render_report(document["results"], args.repeats, args.chain))
    if args.json:
        write_json(args.json, document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
