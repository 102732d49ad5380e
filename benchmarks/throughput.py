"""Steady-state throughput of fastloader.DataLoader against torch's DataLoader and peers.

    python -m benchmarks.throughput                  # full run (part of `python -m benchmarks.run`)
    python -m benchmarks.throughput --quick          # smoke run, ~3 min with the peers
    python -m benchmarks.throughput --no-peers       # fastloader and torch only
    python -m benchmarks.throughput --workloads tiny,image --repeats 7 --json out.json
    python -m benchmarks.throughput --context spawn

Workloads (budgets from the design document's "Budgets", and issues 5 and 14):

    tiny           16 float32 + int label per sample          samples/s  >= 5.0x torch,
                                                                         efficiency >= 0.9
    tiny_batched   tiny samples from __getitems__ (skipped    samples/s  >= 1.0x torch
                   if datasets has no TinyBatchedDataset)
    image          uint8 3x224x224 + int label                MiB/s      >= 1.5x torch
    tokens         16-512 int64 tokens, padded into a dict    samples/s  >= 2.0x torch
                   by a custom collate_fn                                efficiency >= 0.9
    cpu            ~1 ms of pure Python per sample            samples/s  >= 1.0x torch,
                                                                         efficiency >= 0.9
    decode         PIL JPEG decode + 224x224 crop + tensor    samples/s  >= 1.0x torch
    next_overhead  tiny samples, prefetch_factor 4, consumer  us/batch   <= 1/10 of torch's
                   sleeps 2.5 ms per batch: wall time of one
                   next() in the main process (median)

Every loader (fastloader, torch, and the peers of benchmarks.loaders: torchdata's
StatefulDataLoader and nodes pipelines, SPDL's thread and subprocess pipelines)
gets the same dataset object and arguments (batch 64, 2 workers or threads, fork
unless --context says otherwise); fastloader runs with its default
sharing_strategy. next_overhead is fastloader and torch only. Efficiency and
peak PSS (main + workers) are reported for every loader; see benchmarks/README.md. Progress goes to stderr, the Markdown report to stdout.
The exit status is 0 unless --check is given and a budget is clearly missed.
"""

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import psutil
import torch
import torch.utils.data

from benchmarks import datasets, loaders as loader_registry
from benchmarks.harness import (
    EXCLUDED_PIDS,
    MIB,
    Stats,
    json_record,
    loaders_agreeing,
    markdown_table,
    positive_int,
    progress,
    run_alternating,
    run_memory_epochs,
    time_next_calls,
    time_steady_epoch,
    wait_for_workers_to_exit,
    warm_up,
    write_json,
)
from benchmarks.loaders import FASTLOADER, IN_PROCESS, TORCH
from benchmarks.ceiling import machine_ceiling
from benchmarks.pss import PssSampler

# Efficiency (the design document's "Budgets"): steady-state epoch time of the loader against
# the in-process epoch divided by min(workers, usable CPUs).
EFFICIENCY_BUDGET = 0.9


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
    # workloads stays under ~15 minutes with the peers (8 loaders) and a quick
    # one at a few minutes.
    timed_batches: int
    quick_timed_batches: int
    description: str = ""
    collate_fn: Optional[Callable] = None
    loader_kwargs: dict = field(default_factory=dict)  # on top of batch size, workers, context
    lower_is_better: bool = False
    # (loader, warmup_batches) -> result with .checksum. The default runs a first
    # partial epoch on persistent workers, then measures a whole second epoch.
    measure: Callable = time_steady_epoch
    persistent: bool = True
    # Peers (torchdata, SPDL, ...) and the in-process baseline run this workload too.
    with_peers: bool = True
    efficiency_budget: Optional[float] = None
    # None if the workload can run; else why not (reported, not silently dropped).
    unavailable: Optional[Callable[[], Optional[str]]] = None

    @property
    def budget_text(self):
        if self.lower_is_better:
            return f"<= 1/{self.budget:g} of torch"
        return f">= {self.budget:.1f}x"


def _tiny_batched(length):
    return datasets.TinyBatchedDataset(length)


def _tiny_batched_missing():
    if getattr(datasets, "TinyBatchedDataset", None) is None:
        return ("benchmarks.datasets has no TinyBatchedDataset (it comes with the batched-fetch "
                "work, helper `fast`): workload skipped")
    return None


def _decode(length):
    return datasets.JpegDataset(length, datasets.make_jpegs())


WORKLOADS = {
    w.name: w
    for w in (
        Workload("tiny", datasets.TinyDataset, "samples/s", 5.0, 2500, 800,
                 description="16 float32 + int label", efficiency_budget=EFFICIENCY_BUDGET),
        Workload("tiny_batched", _tiny_batched, "samples/s", 1.0, 2500, 800,
                 description="tiny samples from __getitems__ (fastloader.CollatedSamples)",
                 unavailable=_tiny_batched_missing),
        Workload("image", datasets.ImageDataset, "MiB/s", 1.5, 600, 200,
                 description="uint8 3x224x224 + int label"),
        Workload("tokens", datasets.TokenDataset, "samples/s", 2.0, 1000, 350,
                 description="16-512 int64 tokens, custom collate pads into a dict",
                 collate_fn=datasets.pad_tokens, efficiency_budget=EFFICIENCY_BUDGET),
        Workload("cpu", datasets.CpuBoundDataset, "samples/s", 1.0, 100, 16,
                 description="~1 ms of pure Python per sample",
                 efficiency_budget=EFFICIENCY_BUDGET),
        Workload("decode", _decode, "samples/s", 1.0, 40, 12,
                 description="PIL JPEG decode (256x256-512x384) + 224x224 crop + to tensor"),
        # The timed window here is batches x (sleep + next()), ~1.5 s for both
        # loaders; only the next() calls inside it count.
        Workload("next_overhead", datasets.TinyDataset, "us/batch", 10.0, 600, 250,
                 description=f"main-process next() wall time, tiny samples, prefetch_factor 4, "
                             f"consumer sleeps {CONSUMER_SLEEP_S * 1e3:g} ms per batch",
                 loader_kwargs={"prefetch_factor": 4}, lower_is_better=True,
                 measure=functools.partial(time_next_calls, consumer_sleep_s=CONSUMER_SLEEP_S),
                 persistent=False, with_peers=False),
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
    data_agrees: bool  # fastloader's and torch's data agree
    runs: dict  # loader name -> [RunResult]
    # Loader name -> Stats of the workers' CPU time per timed sample (us), or
    # None where it could not be read (or the workload does not time epochs).
    workers_cpu_us: dict
    # Every loader that ran, torch included: name -> Stats of its per-repeat
    # ratio to torch (higher is better).
    ratios: dict = field(default_factory=dict)
    # name -> whether its data matched torch's (False: its row is INVALID)
    agrees: dict = field(default_factory=dict)
    # name -> efficiency (None where there is no in-process baseline)
    efficiency: dict = field(default_factory=dict)
    total_cpu_us: dict = field(default_factory=dict)  # name -> Stats or None
    peak_pss_mib: dict = field(default_factory=dict)  # name -> Stats or None
    # name -> Stats or None: peak PSS + shared memory in flight that no process maps
    peak_with_shm_mib: dict = field(default_factory=dict)
    arena_mib: dict = field(default_factory=dict)  # name -> per-worker MiB list or None
    not_run: dict = field(default_factory=dict)  # name -> why it did not run this workload
    memory_runs: dict = field(default_factory=dict)  # name -> the untimed PSS epoch's result
    kinds: dict = field(default_factory=dict)  # name -> "processes" / "threads" / "in-process"
    # benchmarks.ceiling: what the CPUs give k independent copies of the in-process
    # work (1.0 = linear); only for workloads with an efficiency budget
    machine_ceiling: Optional[Stats] = None

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

    @property
    def efficiency_verdict(self):
        value = self.efficiency.get(FASTLOADER)
        budget = self.workload.efficiency_budget
        if value is None:
            return "-"
        if budget is None:
            return f"{value:.2f}"
        return f"{value:.2f} ({'met' if value >= budget else 'NOT met'} >= {budget:g})"

    def peers_ahead(self):
        """Peers whose median ratio to torch beats fastloader's, with valid data."""
        mine = self.ratios.get(FASTLOADER)
        if mine is None:
            return []
        return [name for name, stats in self.ratios.items()
                if name not in (FASTLOADER, TORCH, IN_PROCESS) and self.agrees.get(name)
                and stats.median > mine.median]


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.throughput",
        description="Throughput of fastloader.DataLoader vs torch.utils.data.DataLoader.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: fewer batches and 2 repeats (~3 min)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="runs per loader per workload (default 3, 2 with --quick)")
    parser.add_argument("--workloads", type=_workload_list, default=list(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)")
    parser.add_argument("--context", choices=("fork", "spawn", "forkserver"), default="fork",
                        help="multiprocessing start method for the workers (default: fork)")
    parser.add_argument("--num-workers", type=positive_int, default=2)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 if a budget is clearly missed (by every "
                             "repeat, not just the median) or the loaders' data differs")
    parser.add_argument("--no-peers", dest="peers", action="store_false",
                        help="fastloader and torch only (no torchdata, SPDL, ...)")
    parser.add_argument("-v", "--verbose", action="store_true", help="a progress line per run")
    args = parser.parse_args(argv)
    if args.repeats is None:
        # 8 loaders per workload with the peers: 3 repeats keep a full run near 15
        # min on 2 cores; --quick takes 2 (a smoke run, not a measurement).
        args.repeats = 2 if args.quick else 3
    return args


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


def usable_cpus():
    return len(os.sched_getaffinity(0))


def _preflight(name, spec, build, warmup):
    """Build the loader and take a few batches: None, or why this loader cannot run it."""
    try:
        warm_up(build(spec), 2 * warmup)
    except Exception as error:  # noqa: BLE001 - reported in the table, never hidden
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
    return None


def benchmark_workload(workload, args, specs, pss_sampler=None):
    """Run every loader in ``specs`` (name -> LoaderSpec) on ``workload``, alternating.

    torch and fastloader always run; a peer that fails to build or to deliver
    its first batches is reported as not run, with the error.
    """
    warmup = warmup_batches(args.num_workers)
    timed = workload.quick_timed_batches if args.quick else workload.timed_batches
    # Exactly one epoch of warm-up plus timed batches, so every run ends by
    # exhausting its iterator, the way torch shuts its workers down normally.
    dataset = workload.make_dataset((warmup + timed) * args.batch_size)

    def build(spec):
        workers = 0 if spec.name == IN_PROCESS else args.num_workers
        # loader_kwargs are DataLoader options (only workloads without peers have them)
        extra = workload.loader_kwargs if workers > 0 else {}
        return spec.build(dataset, batch_size=args.batch_size, num_workers=workers,
                          collate_fn=workload.collate_fn, persistent=workload.persistent,
                          context=args.context, **extra)

    if not workload.with_peers:
        specs = {name: spec for name, spec in specs.items() if name in (FASTLOADER, TORCH)}
    not_run = {}
    for name, spec in list(specs.items()):
        ok, reason = spec.supports(workload.name)
        if not ok:
            not_run[name] = reason
            del specs[name]
    children_before = {child.pid for child in psutil.Process().children(recursive=True)}
    # The untimed first epoch of every loader (see harness.run_alternating), which
    # also finds the peers that cannot run this workload.
    for name, spec in list(specs.items()):
        if name in (FASTLOADER, TORCH):  # these must run: an error is the benchmark's
            warm_up(build(spec), 2 * warmup)
            wait_for_workers_to_exit(children_before)
            continue
        reason = _preflight(name, spec, build, warmup)
        wait_for_workers_to_exit(children_before)
        if reason is not None:
            not_run[name] = reason
            del specs[name]
            progress(f"  {workload.name}: {name} cannot run it: {reason}")

    def on_run(repeat, name, result):
        if args.verbose:
            progress(f"  {workload.name} repeat {repeat + 1}/{args.repeats} {name:<16} "
                     f"{_format_rate(value_of(workload, result), workload.unit):>10} "
                     f"{workload.unit}, first batch {result.first_batch_s * 1e3:.0f} ms")

    runs = run_alternating(build, specs, args.repeats, warmup, on_run, measure=workload.measure,
                           warm=False)
    memory = {} if pss_sampler is None else run_memory_epochs(
        build, specs, warmup, pss_sampler, measure=workload.measure)
    ceiling = None
    if workload.efficiency_budget is not None and IN_PROCESS in specs:
        ceiling = Stats.of(
            machine_ceiling(build(specs[IN_PROCESS]), workload.measure, warmup,
                            min(args.num_workers, usable_cpus()))
            for _ in range(args.repeats))
    value = {name: Stats.of(value_of(workload, r) for r in rs) for name, rs in runs.items()}
    first_batch_ms = {name: Stats.of(r.first_batch_s * 1e3 for r in rs) for name, rs in runs.items()}

    def stats_or_none(rs, attribute):
        values = [getattr(r, attribute, None) for r in rs]
        return None if not values or None in values else Stats.of(values)

    workers_cpu_us = {name: stats_or_none(rs, "workers_cpu_us_per_sample")
                      for name, rs in runs.items()}
    total_cpu_us = {name: stats_or_none(rs, "total_cpu_us_per_sample") for name, rs in runs.items()}
    def peak_mib(attribute):
        peaks = {name: getattr(memory.get(name), attribute, None) for name in runs}
        return {name: None if peak is None else Stats.of([peak / MIB])
                for name, peak in peaks.items()}

    peak_pss_mib = peak_mib("peak_pss_bytes")
    peak_with_shm_mib = peak_mib("peak_with_unmapped_shm_bytes")
    arena_mib = {}
    for name, rs in runs.items():
        last = getattr(rs[-1], "arena_bytes_per_worker", None) if rs else None
        arena_mib[name] = None if last is None else [b / MIB for b in last]
    ratios = {
        name: Stats.of(times_better(workload, value_of(workload, mine), value_of(workload, ref))
                       for mine, ref in zip(rs, runs[TORCH]))
        for name, rs in runs.items()
    }
    # the memory epochs delivered data too: it must agree as well
    agrees = loaders_agreeing({name: rs + ([memory[name]] if name in memory else [])
                               for name, rs in runs.items()}, TORCH)
    efficiency = {}
    baseline = value.get(IN_PROCESS)
    parallel = min(args.num_workers, usable_cpus())
    for name in runs:
        if baseline is None or workload.lower_is_better or name == IN_PROCESS:
            efficiency[name] = None
        else:
            # paired per repeat, as the ratios to torch are: the in-process run of
            # the same repeat is adjacent to fastloader's (see run_workloads)
            efficiency[name] = statistics.median(
                value_of(workload, mine) / (value_of(workload, ref) * parallel)
                for mine, ref in zip(runs[name], runs[IN_PROCESS]))
    paired_ratios = ratios[FASTLOADER]
    return WorkloadReport(
        workload=workload,
        value=value,
        first_batch_ms=first_batch_ms,
        # The headline ratio is the median of the per-repeat ratios: each pair
        # ran back to back, so on a shared machine it is far less disturbed by
        # load that comes and goes than the ratio of the two medians.
        ratio=paired_ratios.median,
        paired_ratios=paired_ratios,
        data_agrees=agrees[FASTLOADER] and agrees[TORCH],
        runs=runs,
        workers_cpu_us=workers_cpu_us,
        ratios=ratios,
        agrees=agrees,
        efficiency=efficiency,
        machine_ceiling=ceiling,
        total_cpu_us=total_cpu_us,
        peak_pss_mib=peak_pss_mib,
        peak_with_shm_mib=peak_with_shm_mib,
        arena_mib=arena_mib,
        memory_runs=memory,
        not_run=not_run,
        kinds={name: spec.kind for name, spec in specs.items()},
    )


def skipped_workload_note(workload):
    """Why ``workload`` cannot run in this checkout, or None."""
    return workload.unavailable() if workload.unavailable is not None else None


def _format_rate(value, unit):
    return f"{value:,.0f}" if unit == "samples/s" else f"{value:,.1f}"


def _format_stats(stats, unit):
    return (f"{_format_rate(stats.median, unit)} "
            f"({_format_rate(stats.low, unit)}-{_format_rate(stats.high, unit)})")


def _format_opt_stats(stats):
    return "-" if stats is None else f"{stats.median:.2f} ({stats.low:.2f}-{stats.high:.2f})"


def _format_cpu(workers_cpu_us):
    fast, reference = workers_cpu_us.get(FASTLOADER), workers_cpu_us.get(TORCH)
    if fast is None or reference is None:
        return "-"
    digits = 0 if min(fast.median, reference.median) >= 100 else 1
    return f"{fast.median:,.{digits}f} / {reference.median:,.{digits}f}"


def render_report(reports, args, skipped=None, unavailable=None):
    """The budget table (fastloader vs torch), then every loader per workload."""
    headers = ["workload", "unit", "fastloader median (min-max)", "torch median (min-max)",
               "ratio (per-repeat min-max)", "budget", "result",
               "efficiency (budget)", "machine ceiling", "1st batch ms fastloader / torch",
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
            report.efficiency_verdict,
            _format_opt_stats(report.machine_ceiling),
            f"{report.first_batch_ms[FASTLOADER].median:.0f} / {report.first_batch_ms[TORCH].median:.0f}",
            _format_cpu(report.workers_cpu_us),
        ])
    notes = [
        "",
        f"{args.repeats} alternating repeat{'s' if args.repeats > 1 else ''} per loader, "
        f"{args.num_workers} workers, "
        f"batch {args.batch_size}, start method {args.context}; steady state: persistent "
        f"workers, a first epoch cut after {warmup_batches(args.num_workers)} batches, then a "
        f"whole second epoch timed after {warmup_batches(args.num_workers)} warm-up batches "
        f"({'quick' if args.quick else 'full'} run). 1st batch: the first epoch's, workers "
        "starting.",
        "Ratio = median over repeats of fastloader / torch within the repeat (for us/batch, a "
        "time: torch / fastloader, so higher is better everywhere); in brackets its range. "
        "\"Within noise\": the median misses the budget but some repeat meets it.",
        f"Efficiency = median over repeats of rate / (in-process rate of the same repeat x "
        f"min(workers, usable CPUs) = {min(args.num_workers, usable_cpus())}); in-process: "
        "fastloader.DataLoader(num_workers=0), the same runs. 1.0 = every core does the "
        "dataset's work and nothing else.",
        "Machine ceiling (benchmarks/ceiling.py): the in-process epoch run in one process, then "
        "in that many processes at once with no loader between them: one's time / their mean "
        "time, median (range) over as many repeats. An estimate of what this machine's CPUs "
        "give at that moment (slightly optimistic: one that finishes first leaves the others a "
        "CPU); 1.0 = they scale linearly.",
    ]
    if any(report.workload.lower_is_better for report in reports):
        notes.append(f"next_overhead: median wall time of one next() in the main process while "
                     f"the consumer sleeps {CONSUMER_SLEEP_S * 1e3:g} ms per batch (workers ahead, "
                     f"prefetch_factor 4, tiny samples, non-persistent workers, fastloader and "
                     f"torch only).")
    for report in reports:
        if not report.data_agrees:
            notes.append(f"WARNING: {report.workload.name}: the loaders delivered different data "
                         "(checksums differ), so its throughput does not count.")
    notes.append("Worker CPU us/sample: user+system CPU time of all workers in the timed window "
                 "per sample (medians); unlike wall time it barely depends on the machine's other "
                 "load, so it shows whether a loader adds work or just got fewer cycles.")
    for name, reason in (skipped or {}).items():
        notes.append(f"NOT RUN: workload {name}: {reason}.")
    text = markdown_table(headers, rows, align="llrrrrlrrrr") + "\n" + "\n".join(notes)
    peers = render_loaders_table(reports, args, unavailable or {})
    return text + ("\n\n" + peers if peers else "")


def _fmt_opt(stats, digits=1):
    if stats is None:
        return "-"
    value = stats.median if isinstance(stats, Stats) else stats
    return f"{value:,.{0 if value >= 100 else digits}f}"


def render_loaders_table(reports, args, unavailable):
    """Every loader on every workload, as ratio to torch: the side-by-side view."""
    reports = [r for r in reports if len(r.runs) > 2 or r.not_run]
    if not reports:
        return ""
    headers = ["workload", "loader", "runs in", "median (min-max)", "x torch (per-repeat min-max)",
               "efficiency", "peak PSS MiB main+workers", "+ shm in flight MiB",
               "CPU us/sample all processes",
               "1st batch ms", "data"]
    rows = []
    for report in reports:
        unit = report.workload.unit
        ordered = sorted(report.runs, key=lambda n: (n == IN_PROCESS, -report.ratios[n].median))
        for name in ordered:
            ratio = report.ratios[name]
            pss = report.peak_pss_mib.get(name)
            arena = report.arena_mib.get(name)
            pss_text = "-" if pss is None else f"{pss.median:,.0f}"
            if arena:
                pss_text += f" (arena {'/'.join(f'{a:.2g}' if a < 10 else f'{a:.0f}' for a in arena)})"
            rows.append([
                report.workload.name, name, report.kinds.get(name, "?"),
                f"{_format_stats(report.value[name], unit)} {unit}",
                f"{ratio.median:.2f}x ({ratio.low:.2f}-{ratio.high:.2f})",
                _fmt_opt(report.efficiency.get(name), 2),
                pss_text,
                _fmt_opt(report.peak_with_shm_mib.get(name)),
                _fmt_opt(report.total_cpu_us.get(name)),
                f"{report.first_batch_ms[name].median:.0f}",
                "ok" if report.agrees.get(name) else "INVALID: data differs",
            ])
        for name, reason in report.not_run.items():
            rows.append([report.workload.name, name, "-", "not run", "-", "-", "-", "-", "-", "-",
                         "not run (see below)"])
    notes = ["", "Every loader on the same dataset objects, interleaved in the same repeats "
             "(order flipped every repeat); x torch: the loader's rate / torch's in the same "
             "repeat (median, range). Peak PSS: the main process and every process it "
             "started, sampled every 0.1 s from building the loader to the end of its epoch, "
             "in one more untimed epoch per loader (sampling costs CPU, so no timed epoch is "
             "sampled); fastloader's shared ring arena per worker in brackets. + shm in "
             "flight: the same peak with the shared memory that no process of the tree maps "
             "at that moment added (batches passed as segments between processes; PSS does "
             "not see them), from the system's Shmem growth (benchmarks/pss.py). "
             "CPU: main process (all threads) + workers, per timed sample. 'in-process' is "
             "the efficiency baseline (num_workers=0), not a competitor."]
    for name, reason in unavailable.items():
        notes.append(f"NOT RUN: {name}: {reason}.")
    for report in reports:
        for name, reason in report.not_run.items():
            notes.append(f"NOT RUN: {report.workload.name}: {name} cannot run it: {reason}")
    for report in reports:
        ahead = report.peers_ahead()
        if ahead:
            notes.append(f"PEER WINS: {report.workload.name}: "
                         + ", ".join(f"{n} {report.ratios[n].median:.2f}x" for n in ahead)
                         + f" vs fastloader {report.ratios[FASTLOADER].median:.2f}x torch.")
    if not any(report.peers_ahead() for report in reports):
        notes.append("No peer is ahead of fastloader on any workload in this run.")
    return ("### Every loader, side by side\n\n"
            + markdown_table(headers, rows, align="lllrrrrrrrl") + "\n" + "\n".join(notes))


def environment(fastloader_module):
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fastloader": getattr(fastloader_module, "__version__", None),
        "fastloader_path": getattr(fastloader_module, "__file__", None),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def _stats_json(stats):
    return None if stats is None else asdict(stats)


def report_to_json(reports, args, fastloader_module, skipped=None, unavailable=None):
    return json_record(
        "throughput", environment(fastloader_module), args,
        warmup_batches=warmup_batches(args.num_workers),
        usable_cpus=usable_cpus(),
        skipped_workloads=skipped or {},
        unavailable_loaders=unavailable or {},
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
                "efficiency_budget": report.workload.efficiency_budget,
                "machine_ceiling": _stats_json(report.machine_ceiling),
                "value": {name: asdict(stats) for name, stats in report.value.items()},
                "first_batch_ms": {name: asdict(stats) for name, stats in report.first_batch_ms.items()},
                "workers_cpu_us_per_sample": {
                    name: _stats_json(stats) for name, stats in report.workers_cpu_us.items()
                },
                # every loader that ran: ratio to torch, efficiency, memory, data check
                "loaders": {
                    name: {
                        "kind": report.kinds.get(name),
                        "ratio_to_torch": asdict(report.ratios[name]),
                        "efficiency": report.efficiency.get(name),
                        "peak_pss_mib": _stats_json(report.peak_pss_mib.get(name)),
                        "peak_with_unmapped_shm_mib": _stats_json(
                            report.peak_with_shm_mib.get(name)),
                        "arena_mib_per_worker": report.arena_mib.get(name),
                        "total_cpu_us_per_sample": _stats_json(report.total_cpu_us.get(name)),
                        "data_agrees": report.agrees.get(name),
                    }
                    for name in report.runs
                },
                "not_run": report.not_run,
                "peers_ahead": report.peers_ahead(),
                "runs": {name: [asdict(run) for run in runs] for name, runs in report.runs.items()},
                # the one untimed epoch per loader that peak PSS was sampled in
                "memory_runs": {name: asdict(run) for name, run in report.memory_runs.items()},
            }
            for report in reports
        ],
    )


def run_workloads(args, fastloader_module, fastloader_cls, step_prefix=""):
    """Benchmark ``args.workloads`` in order, a progress line each.

    Returns ``(reports, skipped, unavailable)``: the reports, workload -> why it
    was not run, loader -> why it is not available here.
    """
    specs, unavailable = loader_registry.registry(fastloader_cls, include_peers=args.peers)
    # run first, so that in every repeat (the order reverses each time) it runs right
    # before or right after fastloader: efficiency pairs the two within a repeat
    specs = {IN_PROCESS: loader_registry.in_process_spec(fastloader_cls), **specs}
    progress(f"fastloader {getattr(fastloader_module, '__version__', '?')} "
             f"({fastloader_module.__file__}) vs torch {torch.__version__}"
             f"{' and ' + ', '.join(n for n in specs if n not in (FASTLOADER, TORCH, IN_PROCESS)) if args.peers else ''}; "
             f"{args.num_workers} workers, {args.context}, {args.repeats} repeats")
    for name, reason in unavailable.items():
        progress(f"  {name} not available: {reason}")
    reports, skipped = [], {}
    sampler = PssSampler()
    EXCLUDED_PIDS.add(sampler.pid)
    try:
        for position, name in enumerate(args.workloads, start=1):
            workload = WORKLOADS[name]
            reason = skipped_workload_note(workload)
            if reason is not None:
                skipped[name] = reason
                progress(f"{step_prefix}[{position}/{len(args.workloads)}] {name}: skipped: {reason}")
                continue
            started = time.perf_counter()
            report = benchmark_workload(workload, args, dict(specs), pss_sampler=sampler)
            reports.append(report)
            unit = report.workload.unit
            others = ", ".join(f"{n} {report.ratios[n].median:.2f}x" for n in report.runs
                               if n not in (FASTLOADER, TORCH))
            progress(f"{step_prefix}[{position}/{len(args.workloads)}] {name}: "
                     f"fastloader {_format_rate(report.value[FASTLOADER].median, unit)} {unit}, "
                     f"torch {_format_rate(report.value[TORCH].median, unit)} {unit}, "
                     f"ratio {report.ratio:.2f}x ({report.verdict})"
                     f"{'; ' + others if others else ''} "
                     f"in {time.perf_counter() - started:.0f} s")
    finally:
        sampler.close()
        EXCLUDED_PIDS.discard(sampler.pid)
    return reports, skipped, unavailable


def main(argv=None):
    args = parse_args(argv)
    fastloader_module, fastloader_cls = import_fastloader()
    reports, skipped, unavailable = run_workloads(args, fastloader_module, fastloader_cls)
    print(render_report(reports, args, skipped, unavailable))
    if args.json:
        write_json(args.json, report_to_json(reports, args, fastloader_module, skipped,
                                             unavailable))
    if args.check and any(report.clearly_missed for report in reports):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
