"""Steady-state throughput of fastloader.DataLoader against torch's DataLoader.

    python -m benchmarks.throughput                  # full run (part of `python -m benchmarks.run`)
    python -m benchmarks.throughput --quick          # smoke run, ~45 s
    python -m benchmarks.throughput --workloads tiny,image --repeats 7 --json out.json
    python -m benchmarks.throughput --context spawn

Workloads (budgets from DESIGN.md, "Budgets", and issue 5):

    tiny           16 float32 + int label per sample          samples/s  >= 5.0x torch
    image          uint8 3x224x224 + int label                MiB/s      >= 1.5x torch
    tokens         16-512 int64 tokens, padded into a dict    samples/s  >= 2.0x torch
                   by a custom collate_fn
    cpu            ~1 ms of pure Python per sample            samples/s  >= 1.0x torch
    next_overhead  tiny samples, prefetch_factor 4, consumer  us/batch   <= 1/10 of torch's
                   sleeps 2.5 ms per batch: wall time of one
                   next() in the main process (median)

Both loaders are built with the same arguments (batch 64, 2 workers, fork
unless --context says otherwise); fastloader runs with its default
sharing_strategy. Progress goes to stderr, the Markdown report to stdout.
The exit status is 0 unless --check is given and a budget is clearly missed.
"""

import argparse
import functools
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.utils.data

from benchmarks import datasets
from benchmarks.harness import (
    Stats,
    checksums_agree,
    json_record,
    markdown_table,
    progress,
    run_alternating,
    time_next_calls,
    time_one_epoch,
    write_json,
)

FASTLOADER = "fastloader"
TORCH = "torch"


# The consumer's stand-in for a training step in the next_overhead workload:
# comfortably longer than either loader needs to produce a tiny batch with 2
# workers (torch: ~1.2 ms), so the workers are always ahead, yet short enough
# that an epoch of a few hundred batches takes about a second.
CONSUMER_SLEEP_S = 0.0025


@dataclass(frozen=True)
class Workload:
    name: str
    make_dataset: Callable[[int], torch.utils.data.Dataset]
    unit: str  # "samples/s", "MiB/s" or "us/batch"
    # Minimum "times better than torch": fastloader/torch for rates,
    # torch/fastloader for times (lower_is_better).
    budget: float
    # Batches timed after the warm-up, sized for a timed window of ~3 s for
    # torch (~1 s with --quick) on the 2-core reference machine: long enough to
    # average out scheduler noise, short enough that a default run of all
    # workloads stays under ~3 minutes and a quick one under a minute.
    timed_batches: int
    quick_timed_batches: int
    description: str = ""
    collate_fn: Optional[Callable] = None
    loader_kwargs: dict = field(default_factory=dict)  # on top of batch size, workers, context
    lower_is_better: bool = False
    measure: Callable = time_one_epoch  # (loader, warmup_batches) -> result with .checksum

    @property
    def budget_text(self):
        if self.lower_is_better:
            return f"<= 1/{self.budget:g} of torch"
        return f">= {self.budget:.1f}x"


WORKLOADS = {
    w.name: w
    for w in (
        Workload("tiny", datasets.TinyDataset, "samples/s", 5.0, 2500, 800,
                 description="16 float32 + int label"),
        Workload("image", datasets.ImageDataset, "MiB/s", 1.5, 600, 200,
                 description="uint8 3x224x224 + int label"),
        Workload("tokens", datasets.TokenDataset, "samples/s", 2.0, 1000, 350,
                 description="16-512 int64 tokens, custom collate pads into a dict",
                 collate_fn=datasets.pad_tokens),
        Workload("cpu", datasets.CpuBoundDataset, "samples/s", 1.0, 100, 32,
                 description="~1 ms of pure Python per sample"),
        # The timed window here is batches x (sleep + next()), ~1.5 s for both
        # loaders; only the next() calls inside it count.
        Workload("next_overhead", datasets.TinyDataset, "us/batch", 10.0, 600, 250,
                 description=f"main-process next() wall time, tiny samples, prefetch_factor 4, "
                             f"consumer sleeps {CONSUMER_SLEEP_S * 1e3:g} ms per batch",
                 loader_kwargs={"prefetch_factor": 4}, lower_is_better=True,
                 measure=functools.partial(time_next_calls, consumer_sleep_s=CONSUMER_SLEEP_S)),
    )
}


@dataclass(frozen=True)
class WorkloadReport:
    workload: Workload
    value: dict  # loader name -> Stats, in workload.unit
    first_batch_ms: dict  # loader name -> Stats
    # How many times better fastloader is (fastloader / torch for rates, torch /
    # fastloader for times): the median over repeats of each repeat's ratio.
    ratio: float
    # The same ratio within each repeat: the two runs of a repeat are adjacent
    # in time, so their ratio is the one least disturbed by drift.
    paired_ratios: Stats
    data_agrees: bool
    runs: dict  # loader name -> [RunResult]
    # Loader name -> Stats of the workers' CPU time per timed sample (us), or
    # None where it could not be read (or the workload does not time epochs).
    workers_cpu_us: dict

    @property
    def met(self):
        return self.data_agrees and self.ratio >= self.workload.budget

    @property
    def clearly_missed(self):
        """Missed even by the best repeat: not explained by the machine's noise."""
        return not self.data_agrees or self.paired_ratios.high < self.workload.budget

    @property
    def verdict(self):
        if not self.data_agrees:
            return "INVALID: data differs"
        if self.met:
            return "met"
        return "NOT met" if self.clearly_missed else "NOT met (within noise)"


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.throughput",
        description="Throughput of fastloader.DataLoader vs torch.utils.data.DataLoader.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: fewer batches and 3 repeats (~45 s)")
    parser.add_argument("--repeats", type=_positive_int, default=None,
                        help="runs per loader per workload (default 5, 3 with --quick)")
    parser.add_argument("--workloads", type=_workload_list, default=list(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)")
    parser.add_argument("--context", choices=("fork", "spawn", "forkserver"), default="fork",
                        help="multiprocessing start method for the workers (default: fork)")
    parser.add_argument("--num-workers", type=_positive_int, default=2)
    parser.add_argument("--batch-size", type=_positive_int, default=64)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 if a budget is clearly missed (by every "
                             "repeat, not just the median) or the loaders' data differs")
    parser.add_argument("-v", "--verbose", action="store_true", help="a progress line per run")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    return args


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _workload_list(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload(s) {unknown or text!r}; choose from {','.join(WORKLOADS)}")
    return names


def import_fastloader():
    """fastloader's DataLoader class, or exit with a hint if it is not importable."""
    try:
        import fastloader
    except ImportError as error:
        sys.exit(f"cannot import fastloader ({error}); build it first (e.g. `pip install -e .`)")
    loader_cls = fastloader.DataLoader
    if not issubclass(loader_cls, torch.utils.data.DataLoader):
        sys.exit("fastloader.DataLoader is not a subclass of torch.utils.data.DataLoader")
    if loader_cls is torch.utils.data.DataLoader:
        progress("warning: fastloader.DataLoader *is* torch's DataLoader; ratios will be ~1.0")
    return fastloader, loader_cls


def warmup_batches(num_workers):
    """Untimed batches at the start of each epoch.

    Covers worker start-up and the filling of torch's prefetch pipeline (two
    batches per worker by default): batches that were already waiting when the
    clock started would flatter whichever loader prefetched more.
    """
    return 4 * num_workers


def value_of(workload, result):
    """The figure a workload reports for one run, in ``workload.unit``."""
    if workload.unit == "MiB/s":
        return result.mib_per_s
    if workload.unit == "us/batch":
        return result.median_us
    return result.samples_per_s


def times_better(workload, fastloader_value, torch_value):
    if workload.lower_is_better:
        return torch_value / fastloader_value
    return fastloader_value / torch_value


def benchmark_workload(workload, args, loader_classes):
    warmup = warmup_batches(args.num_workers)
    timed = workload.quick_timed_batches if args.quick else workload.timed_batches
    # Exactly one epoch of warm-up plus timed batches, so every run ends by
    # exhausting its iterator, the way torch shuts its workers down normally.
    dataset = workload.make_dataset((warmup + timed) * args.batch_size)
    loader_kwargs = dict(batch_size=args.batch_size, num_workers=args.num_workers,
                         multiprocessing_context=args.context, **workload.loader_kwargs)
    if workload.collate_fn is not None:
        loader_kwargs["collate_fn"] = workload.collate_fn

    def on_run(repeat, name, result):
        if args.verbose:
            progress(f"  {workload.name} repeat {repeat + 1}/{args.repeats} {name:<10} "
                     f"{_format_rate(value_of(workload, result), workload.unit):>10} "
                     f"{workload.unit}, first batch {result.first_batch_s * 1e3:.0f} ms")

    runs = run_alternating(lambda cls: cls(dataset, **loader_kwargs), loader_classes,
                           args.repeats, warmup, on_run, measure=workload.measure)
    value = {name: Stats.of(value_of(workload, r) for r in rs) for name, rs in runs.items()}
    first_batch_ms = {name: Stats.of(r.first_batch_s * 1e3 for r in rs) for name, rs in runs.items()}
    workers_cpu_us = {}
    for name, rs in runs.items():
        per_sample = [getattr(r, "workers_cpu_us_per_sample", None) for r in rs]
        workers_cpu_us[name] = None if None in per_sample else Stats.of(per_sample)
    paired_ratios = Stats.of(
        times_better(workload, value_of(workload, fast), value_of(workload, reference))
        for fast, reference in zip(runs[FASTLOADER], runs[TORCH])
    )
    return WorkloadReport(
        workload=workload,
        value=value,
        first_batch_ms=first_batch_ms,
        # The headline ratio is the median of the per-repeat ratios: each pair
        # ran back to back, so on a shared machine it is far less disturbed by
        # load that comes and goes than the ratio of the two medians.
        ratio=paired_ratios.median,
        paired_ratios=paired_ratios,
        data_agrees=checksums_agree(runs),
        runs=runs,
        workers_cpu_us=workers_cpu_us,
    )


def _format_rate(value, unit):
    return f"{value:,.0f}" if unit == "samples/s" else f"{value:,.1f}"


def _format_stats(stats, unit):
    return (f"{_format_rate(stats.median, unit)} "
            f"({_format_rate(stats.low, unit)}-{_format_rate(stats.high, unit)})")


def _format_cpu(workers_cpu_us):
    fast, reference = workers_cpu_us.get(FASTLOADER), workers_cpu_us.get(TORCH)
    if fast is None or reference is None:
        return "-"
    digits = 0 if min(fast.median, reference.median) >= 100 else 1
    return f"{fast.median:,.{digits}f} / {reference.median:,.{digits}f}"


def render_report(reports, args):
    headers = ["workload", "unit", "fastloader median (min-max)", "torch median (min-max)",
               "ratio (per-repeat min-max)", "budget", "result", "1st batch ms fastloader / torch",
               "worker CPU us/sample fastloader / torch"]
    rows = []
    for report in reports:
        unit = report.workload.unit
        rows.append([
            report.workload.name,
            unit,
            _format_stats(report.value[FASTLOADER], unit),
            _format_stats(report.value[TORCH], unit),
            f"{report.ratio:.2f}x ({report.paired_ratios.low:.2f}-{report.paired_ratios.high:.2f})",
            report.workload.budget_text,
            report.verdict,
            f"{report.first_batch_ms[FASTLOADER].median:.0f} / {report.first_batch_ms[TORCH].median:.0f}",
            _format_cpu(report.workers_cpu_us),
        ])
    notes = [
        "",
        f"{args.repeats} alternating repeat{'s' if args.repeats > 1 else ''} per loader, "
        f"{args.num_workers} workers, "
        f"batch {args.batch_size}, start method {args.context}; throughput over the batches "
        f"after {warmup_batches(args.num_workers)} warm-up batches "
        f"({'quick' if args.quick else 'full'} run).",
        "Ratio = median over repeats of fastloader / torch within the repeat (for us/batch, a "
        "time: torch / fastloader, so higher is better everywhere); in brackets its range. "
        "\"Within noise\": the median misses the budget but some repeat meets it.",
    ]
    if any(report.workload.lower_is_better for report in reports):
        notes.append(f"next_overhead: median wall time of one next() in the main process while "
                     f"the consumer sleeps {CONSUMER_SLEEP_S * 1e3:g} ms per batch (workers ahead, "
                     f"prefetch_factor 4, tiny samples).")
    for report in reports:
        if not report.data_agrees:
            notes.append(f"WARNING: {report.workload.name}: the loaders delivered different data "
                         "(checksums differ), so its throughput does not count.")
    notes.append("Worker CPU us/sample: user+system CPU time of all workers in the timed window "
                 "per sample (medians); unlike wall time it barely depends on the machine's other "
                 "load, so it shows whether a loader adds work or just got fewer cycles.")
    return markdown_table(headers, rows, align="llrrrrlrr") + "\n" + "\n".join(notes)


def environment(fastloader_module):
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fastloader": getattr(fastloader_module, "__version__", None),
        "fastloader_path": getattr(fastloader_module, "__file__", None),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def report_to_json(reports, args, fastloader_module):
    return json_record(
        "throughput", environment(fastloader_module), args,
        warmup_batches=warmup_batches(args.num_workers),
        workloads=[
            {
                "name": report.workload.name,
                "description": report.workload.description,
                "unit": report.workload.unit,
                "budget": report.workload.budget,
                "budget_text": report.workload.budget_text,
                "lower_is_better": report.workload.lower_is_better,
                "ratio": report.ratio,
                "paired_ratios": asdict(report.paired_ratios),
                "met": report.met,
                "clearly_missed": report.clearly_missed,
                "verdict": report.verdict,
                "data_agrees": report.data_agrees,
                "value": {name: asdict(stats) for name, stats in report.value.items()},
                "first_batch_ms": {name: asdict(stats) for name, stats in report.first_batch_ms.items()},
                "workers_cpu_us_per_sample": {
                    name: None if stats is None else asdict(stats)
                    for name, stats in report.workers_cpu_us.items()
                },
                "runs": {name: [asdict(run) for run in runs] for name, runs in report.runs.items()},
            }
            for report in reports
        ],
    )


def run_workloads(args, fastloader_module, fastloader_cls, step_prefix=""):
    """Benchmark ``args.workloads`` in order, a progress line each; returns the reports."""
    loader_classes = {FASTLOADER: fastloader_cls, TORCH: torch.utils.data.DataLoader}
    progress(f"fastloader {getattr(fastloader_module, '__version__', '?')} "
             f"({fastloader_module.__file__}) vs torch {torch.__version__}; "
             f"{args.num_workers} workers, {args.context}, {args.repeats} repeats")
    reports = []
    for position, name in enumerate(args.workloads, start=1):
        started = time.perf_counter()
        report = benchmark_workload(WORKLOADS[name], args, loader_classes)
        reports.append(report)
        unit = report.workload.unit
        progress(f"{step_prefix}[{position}/{len(args.workloads)}] {name}: "
                 f"fastloader {_format_rate(report.value[FASTLOADER].median, unit)} {unit}, "
                 f"torch {_format_rate(report.value[TORCH].median, unit)} {unit}, "
                 f"ratio {report.ratio:.2f}x ({report.verdict}) "
                 f"in {time.perf_counter() - started:.0f} s")
    return reports


def main(argv=None):
    args = parse_args(argv)
    fastloader_module, fastloader_cls = import_fastloader()
    reports = run_workloads(args, fastloader_module, fastloader_cls)
    print(render_report(reports, args))
    if args.json:
        write_json(args.json, report_to_json(reports, args, fastloader_module))
    if args.check and any(report.clearly_missed for report in reports):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
