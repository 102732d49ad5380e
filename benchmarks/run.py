"""Every benchmark in one go: what `make bench` runs.

    python -m benchmarks.run                 # full run, 15-45 min on a 2-core box (the VM's speed varies)
    python -m benchmarks.run --quick         # smoke run, ~1-1.5 min
    python -m benchmarks.run --only throughput,charts --out-dir /tmp/bench
    python -m benchmarks.run --check         # exit 1 if a budget is clearly missed

Steps, in order (``--only`` picks a subset):

    throughput  tiny, image, tokens, cpu and next_overhead against their budgets
                (benchmarks.throughput; 2 workers, batch 64)
    scaling     tiny samples, 1/2/4 workers x batch 1/16/256 (benchmarks.scaling)
    memory      per-worker USS over a tiny-workload epoch (benchmarks.memory)
    startup     time to the first batch under spawn and forkserver, 2M packed
                names vs torch with a list, each in a fresh interpreter
                (benchmarks.startup)
    short_epoch 10-batch epochs with non-persistent workers: iter(), first
                batch, teardown, whole epoch, fork and spawn (benchmarks.short_epoch)
    error_epoch an epoch that ends in a dataset error the loop catches: the
                error's arrival and the garbage collection that frees the
                iterator (benchmarks.error_epoch)
    charts      throughput.png, scaling.png, memory.png (benchmarks.charts)

Writes ``summary.json`` and the PNGs into ``--out-dir`` (default
``benchmarks/results/``). A progress line per workload goes to stderr; the
Markdown report (budget table, scaling table, memory table, chart paths) to
stdout. Each step is also a module of its own, runnable alone.
"""

import argparse
import json
import os
import sys
import time

import torch

from benchmarks import charts, error_epoch, memory, scaling, short_epoch, startup, throughput
from benchmarks.harness import json_record, progress, write_json

STEPS = ("throughput", "scaling", "memory", "startup", "short_epoch", "error_epoch", "charts")


def _steps(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in STEPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown step(s) {unknown or text!r}; choose from {','.join(STEPS)}")
    return names


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="All fastloader benchmarks (vs torch.utils.data.DataLoader), charts and summary.",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run (~1-1.5 min)")
    parser.add_argument("--context", choices=("fork", "spawn", "forkserver"), default="fork",
                        help="multiprocessing start method for the workers (default: fork)")
    parser.add_argument("--only", type=_steps, default=list(STEPS),
                        help=f"comma-separated subset of {','.join(STEPS)} (default: all)")
    parser.add_argument("--out-dir", default=charts.DEFAULT_RESULTS_DIR,
                        help="where summary.json and the PNGs go (default: benchmarks/results)")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 if a budget is clearly missed (by every repeat) "
                             "or the loaders' data differs")
    parser.add_argument("--no-peers", dest="peers", action="store_false",
                        help="throughput: fastloader and torch only (no torchdata, SPDL, ...)")
    parser.add_argument("-v", "--verbose", action="store_true", help="a progress line per run")
    return parser.parse_args(argv)


def _sub_argv(args):
    argv = ["--context", args.context]
    if args.quick:
        argv.append("--quick")
    return argv


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    fastloader_module, fastloader_cls = throughput.import_fastloader()
    if "charts" in args.only:
        charts._pyplot()  # fail now, not after minutes of measuring, if matplotlib is missing
    os.makedirs(args.out_dir, exist_ok=True)
    verbose = ["-v"] if args.verbose else []
    summary = json_record(
        "run", throughput.environment(fastloader_module),
        {"quick": args.quick, "context": args.context, "only": args.only},
        command=" ".join(["python -m benchmarks.run", *(sys.argv[1:] if argv is None else argv)]))
    sections = []
    missed = False

    if "throughput" in args.only:
        step_args = throughput.parse_args(_sub_argv(args) + verbose
                                          + ([] if args.peers else ["--no-peers"]))
        reports, skipped, unavailable = throughput.run_workloads(
            step_args, fastloader_module, fastloader_cls, step_prefix="throughput ")
        summary["throughput"] = throughput.report_to_json(reports, step_args, fastloader_module,
                                                          skipped, unavailable)
        sections.append("## Budgets\n\n" + throughput.render_report(reports, step_args, skipped,
                                                                     unavailable))
        missed = any(report.clearly_missed for report in reports)

    if "scaling" in args.only:
        step_args = scaling.parse_args(_sub_argv(args) + verbose)
        progress(f"scaling: workers {step_args.workers} x batch sizes {step_args.batch_sizes}, "
                 f"{step_args.repeats} repeat(s)")
        cells = scaling.run_cells(step_args, fastloader_cls, step_prefix="scaling ")
        summary["scaling"] = json_record("scaling", summary["environment"], step_args,
                                         cells=scaling.cells_to_json(cells))
        sections.append("## Scaling\n\n" + scaling.render_report(cells, step_args))
        missed = missed or any(not cell.data_agrees for cell in cells)

    if "memory" in args.only:
        step_args = memory.parse_args(_sub_argv(args))
        traces = memory.trace_loaders(step_args, fastloader_cls)
        summary["memory"] = json_record("memory", summary["environment"], step_args,
                                        traces=memory.traces_to_json(traces))
        sections.append("## Per-worker memory\n\n" + memory.render_report(traces, step_args))

    if "startup" in args.only:
        step_args = startup.parse_args(["--quick"] if args.quick else [])
        results = startup.run(step_args.names, step_args.methods, step_args.repeats,
                              step_prefix="startup ")
        verdicts = {method: startup.verdict(times)[1] for method, times in results.items()}
        summary["startup"] = {"names": step_args.names, "repeats": step_args.repeats,
                              "results": results, "verdicts": verdicts}
        sections.append("## Time to first batch\n\n"
                        + startup.render_report(results, step_args.names, step_args.repeats))
        missed = missed or any(v == "NOT met" for v in verdicts.values())

    if "short_epoch" in args.only:
        # fork and spawn in a full run whatever --context says: the budget is fork's,
        # spawn is reported beside it
        step_args = short_epoch.parse_args(["--quick"] if args.quick else [])
        document = short_epoch.run(step_args, step_prefix="short_epoch ")
        summary["short_epoch"] = document
        sections.append("## Short epochs (non-persistent workers)\n\n"
                        + short_epoch.render_report(document["results"], step_args.repeats,
                                                    step_args.chain))

    if "error_epoch" in args.only:
        step_args = error_epoch.parse_args(["--quick"] if args.quick else [])
        results = error_epoch.measure(step_args.repeats, step_prefix="error_epoch ")
        summary["error_epoch"] = {"repeats": step_args.repeats, "results": results}
        sections.append("## An epoch that ends in a caught dataset error\n\n"
                        + error_epoch.render_report(results, step_args.repeats))

    summary_path = os.path.join(args.out_dir, "summary.json")
    if "charts" in args.only:
        if set(args.only) == {"charts"}:
            # Charts alone: redraw them from the last summary instead of measuring.
            with open(summary_path) as stream:
                summary = json.load(stream)
        paths = charts.write_charts(summary, args.out_dir)
        summary["charts"] = [os.path.relpath(path) for path in paths]
        progress(f"charts: {', '.join(summary['charts']) or 'nothing to draw'}")
        if paths:
            sections.append("## Charts\n\n" + "\n".join(f"- `{path}`" for path in summary["charts"]))

    elapsed = time.perf_counter() - started
    summary["elapsed_s"] = elapsed
    if set(args.only) != {"charts"}:
        write_json(summary_path, summary)
    progress(f"done in {elapsed:.0f} s; summary: {os.path.relpath(summary_path)}")
    env = summary["environment"]
    print(f"# fastloader benchmarks\n\nfastloader {env.get('fastloader')} vs torch {torch.__version__}, "
          f"Python {env.get('python')}, {env.get('cpus')} CPUs, start method {args.context}, "
          f"{'quick' if args.quick else 'full'} run, {elapsed:.0f} s.\n")
    print("\n\n".join(sections))
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
