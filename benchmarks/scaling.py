"""How throughput scales with workers and batch size, fastloader against torch.

    python -m benchmarks.scaling                 # 1,2,4 workers x batch 1,16,256 (~1 min)
    python -m benchmarks.scaling --quick         # fewer batches, 1 repeat (~30 s)
    python -m benchmarks.scaling --workers 1,2 --batch-sizes 16 --repeats 5 --json out.json

The tiny workload (16 float32 + int label per sample) for every combination
of ``--workers`` and ``--batch-sizes``: samples/s for both loaders, medians
of alternating repeats with their min-max spread, and the ratio. There is no
budget per cell; a ratio below 1.0 is flagged, since fastloader should never
be slower than torch. Batch 1 shows per-batch overhead almost alone, batch
256 mostly the per-sample work both loaders share (dataset + collate).

More workers than cores (4 on the 2-core reference machine) is measured
anyway: users do it, and it must not make fastloader collapse.
Progress goes to stderr, the Markdown report to stdout.
"""

import argparse
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass

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
    write_json,
)
from benchmarks.throughput import FASTLOADER, TORCH, environment, import_fastloader, warmup_batches

# Timed batches per batch size. Torch's per-batch cost dominates small
# batches (~1-1.5 ms at batch 1 on the reference machine), so they get more
# samples' worth of time: each cell's torch window is ~0.4-2 s, fastloader's
# at least ~0.1 s (full run), and all 9 cells x 3 repeats take ~45 s on a
# quiet 2-core box (2-3x that while other jobs load it).
TIMED_BATCHES = {1: 1500, 16: 800, 256: 300}
QUICK_TIMED_BATCHES = {1: 600, 16: 300, 256: 120}


def timed_batches_for(batch_size, quick):
    """Batches to time for a batch size not in the tables: about the same samples."""
    table = QUICK_TIMED_BATCHES if quick else TIMED_BATCHES
    if batch_size in table:
        return table[batch_size]
    nearest = min(table, key=lambda known: abs(known - batch_size))
    return max(20, table[nearest] * nearest // batch_size)


@dataclass(frozen=True)
class Cell:
    num_workers: int
    batch_size: int
    samples_per_s: dict  # loader name -> Stats
    ratio: float  # fastloader median / torch median
    paired_ratios: Stats
    data_agrees: bool

    @property
    def verdict(self):
        if not self.data_agrees:
            return "INVALID: data differs"
        if self.ratio >= 1.0:
            return "ok"
        return "slower" if self.paired_ratios.high < 1.0 else "slower (within noise)"


def _int_list(text):
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scaling",
        description="Samples/s of fastloader vs torch's DataLoader by worker count and batch size.",
    )
    parser.add_argument("--quick", action="store_true", help="fewer batches, 1 repeat (~30 s)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs per loader per cell (default 3, 1 with --quick)")
    parser.add_argument("--workers", type=_int_list, default=[1, 2, 4],
                        help="comma-separated worker counts (default 1,2,4)")
    parser.add_argument("--batch-sizes", type=_int_list, default=[1, 16, 256],
                        help="comma-separated batch sizes (default 1,16,256)")
    parser.add_argument("--context", choices=("fork", "spawn", "forkserver"), default="fork")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="a progress line per run")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def measure_cell(num_workers, batch_size, args, loader_classes):
    warmup = warmup_batches(num_workers)
    timed = timed_batches_for(batch_size, args.quick)
    dataset = datasets.TinyDataset((warmup + timed) * batch_size)
    loader_kwargs = dict(batch_size=batch_size, num_workers=num_workers,
                         multiprocessing_context=args.context)

    def on_run(repeat, name, result):
        if args.verbose:
            progress(f"  {num_workers} workers, batch {batch_size}, repeat {repeat + 1}/{args.repeats} "
                     f"{name:<10} {result.samples_per_s:>10,.0f} samples/s")

    runs = run_alternating(lambda cls: cls(dataset, **loader_kwargs), loader_classes,
                           args.repeats, warmup, on_run)
    rates = {name: Stats.of(r.samples_per_s for r in rs) for name, rs in runs.items()}
    return Cell(
        num_workers=num_workers,
        batch_size=batch_size,
        samples_per_s=rates,
        ratio=rates[FASTLOADER].median / rates[TORCH].median,
        paired_ratios=Stats.of(fast.samples_per_s / reference.samples_per_s
                               for fast, reference in zip(runs[FASTLOADER], runs[TORCH])),
        data_agrees=checksums_agree(runs),
    )


def run_cells(args, fastloader_cls, step_prefix=""):
    """Measure every (workers, batch size) cell, a progress line each."""
    loader_classes = {FASTLOADER: fastloader_cls, TORCH: torch.utils.data.DataLoader}
    combos = [(w, b) for w in args.workers for b in args.batch_sizes]
    cells = []
    with warnings.catch_warnings():
        # Both loaders warn (once per call site) when num_workers exceeds the
        # cores; here that is the point of the measurement, so say it once.
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        cores = os.cpu_count() or 1
        if max(args.workers) > cores:
            progress(f"note: {max(args.workers)} workers on {cores} cores is oversubscribed on purpose")
        for position, (num_workers, batch_size) in enumerate(combos, start=1):
            started = time.perf_counter()
            cell = measure_cell(num_workers, batch_size, args, loader_classes)
            cells.append(cell)
            progress(f"{step_prefix}[{position}/{len(combos)}] {num_workers} workers, batch {batch_size}: "
                     f"fastloader {cell.samples_per_s[FASTLOADER].median:,.0f} samples/s, "
                     f"torch {cell.samples_per_s[TORCH].median:,.0f} samples/s, "
                     f"ratio {cell.ratio:.2f}x ({cell.verdict}) in {time.perf_counter() - started:.1f} s")
    return cells


def _format_stats(stats):
    return f"{stats.median:,.0f} ({stats.low:,.0f}-{stats.high:,.0f})"


def render_report(cells, args):
    headers = ["workers", "batch", "fastloader samples/s (min-max)", "torch samples/s (min-max)",
               "ratio (per-repeat min-max)", "result"]
    rows = [
        [cell.num_workers, cell.batch_size,
         _format_stats(cell.samples_per_s[FASTLOADER]), _format_stats(cell.samples_per_s[TORCH]),
         f"{cell.ratio:.2f}x ({cell.paired_ratios.low:.2f}-{cell.paired_ratios.high:.2f})",
         cell.verdict]
        for cell in cells
    ]
    notes = [
        "",
        f"Tiny samples (16 float32 + int label), start method {args.context}, "
        f"{args.repeats} alternating repeat{'s' if args.repeats > 1 else ''} per loader and cell "
        f"({'quick' if args.quick else 'full'} run); ratio = fastloader median / torch median.",
    ]
    return markdown_table(headers, rows, align="rrrrrl") + "\n" + "\n".join(notes)


def cells_to_json(cells):
    return [
        {
            "num_workers": cell.num_workers,
            "batch_size": cell.batch_size,
            "samples_per_s": {name: asdict(stats) for name, stats in cell.samples_per_s.items()},
            "ratio": cell.ratio,
            "paired_ratios": asdict(cell.paired_ratios),
            "data_agrees": cell.data_agrees,
            "verdict": cell.verdict,
        }
        for cell in cells
    ]


def main(argv=None):
    args = parse_args(argv)
    fastloader_module, fastloader_cls = import_fastloader()
    progress(f"scaling: fastloader {getattr(fastloader_module, '__version__', '?')} vs torch "
             f"{torch.__version__}; workers {args.workers}, batch sizes {args.batch_sizes}, "
             f"{args.context}, {args.repeats} repeat(s)")
    cells = run_cells(args, fastloader_cls)
    print(render_report(cells, args))
    if args.json:
        write_json(args.json, json_record("scaling", environment(fastloader_module), args,
                                          cells=cells_to_json(cells)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
