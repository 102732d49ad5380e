"""Per-worker private memory over an epoch, fastloader against torch.

    python -m benchmarks.memory                  # 3,000 tiny batches, a sample every 50
    python -m benchmarks.memory --quick          # 1,000 batches, a sample every 25
    python -m benchmarks.memory --context spawn --json out.json

One epoch of the tiny workload (16 float32 + int label, batch 64, 2 workers)
per loader. Every ``--every`` batches (and after the first and the last) the
main process reads each worker's USS (unique set size: the pages only that
worker maps, i.e. what it really costs) and PSS through psutil. A worker whose
USS keeps growing over an epoch is copying pages it shares with the parent
(copy-on-read under fork) or leaking; a flat line is the goal.

Reading a worker's memory (``/proc/<pid>/smaps``) takes ~10 ms and pauses the
consumer, so nothing here is timed. Progress goes to stderr, the Markdown
report to stdout.
"""

import argparse
import sys
import time
from dataclasses import asdict, dataclass

import psutil
import torch
import torch.utils.data

from benchmarks import datasets
from benchmarks.harness import (
    MIB,
    iterator_worker_pids,
    json_record,
    markdown_table,
    positive_int,
    progress,
    touch,
    wait_for_workers_to_exit,
    warm_up,
    write_json,
)
from benchmarks.throughput import FASTLOADER, TORCH, environment, import_fastloader, warmup_batches


@dataclass(frozen=True)
class MemoryTrace:
    """Worker memory sampled over one epoch of one loader."""

    loader: str
    worker_pids: list
    batches: list  # batches consumed when each sample was taken
    seconds: list  # time since iter() when each sample was taken
    uss_mib: list  # [sample][worker]
    pss_mib: list  # [sample][worker]
    checksum: float

    def per_worker(self, values):
        return [list(column) for column in zip(*values)]

    @property
    def start_uss_mib(self):
        return self.uss_mib[0]

    @property
    def end_uss_mib(self):
        return self.uss_mib[-1]

    @property
    def peak_uss_mib(self):
        return [max((v for v in column if v is not None), default=None)
                for column in self.per_worker(self.uss_mib)]

    @property
    def growth_uss_mib(self):
        return [None if start is None or end is None else end - start
                for start, end in zip(self.start_uss_mib, self.end_uss_mib)]


def _read_memory(pids):
    uss, pss = [], []
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
        except psutil.Error:  # the worker is gone: a finding, recorded as None
            uss.append(None)
            pss.append(None)
            continue
        uss.append(info.uss / MIB)
        pss.append(info.pss / MIB if hasattr(info, "pss") else None)
    return uss, pss


def trace_epoch(name, loader, every):
    """Iterate ``loader`` once, sampling its workers' memory every ``every`` batches."""
    total = len(loader)
    batches, seconds, uss_mib, pss_mib = [], [], [], []
    checksum = 0.0
    iterator = iter(loader)
    pids = iterator_worker_pids(iterator)
    if not pids:
        raise RuntimeError(f"{name}: no worker pids found on its iterator ({type(iterator).__name__})")
    start = time.perf_counter()
    for index in range(total):
        batch = next(iterator)
        checksum += touch(batch)
        del batch
        consumed = index + 1
        if consumed == 1 or consumed % every == 0 or consumed == total:
            # Read before the last batch's StopIteration: that shuts the workers down.
            uss, pss = _read_memory(pids)
            batches.append(consumed)
            seconds.append(time.perf_counter() - start)
            uss_mib.append(uss)
            pss_mib.append(pss)
    if next(iterator, None) is not None:
        raise ValueError(f"{name}: the loader yielded more than its len() of {total} batches")
    del iterator
    return MemoryTrace(name, pids, batches, seconds, uss_mib, pss_mib, checksum)


def trace_loaders(args, fastloader_cls, step_prefix=""):
    """One traced epoch per loader; returns ``{name: MemoryTrace}``."""
    loader_classes = {FASTLOADER: fastloader_cls, TORCH: torch.utils.data.DataLoader}
    dataset = datasets.TinyDataset(args.batches * args.batch_size)
    loader_kwargs = dict(batch_size=args.batch_size, num_workers=args.num_workers,
                         multiprocessing_context=args.context)
    children_before = {child.pid for child in psutil.Process().children(recursive=True)}
    # The same untimed first epoch per class as the throughput runs get: lazy
    # imports and first-use set-up then happen before either traced fork, so
    # neither loader's workers inherit (or miss) them alone.
    for cls in loader_classes.values():
        warm_up(cls(dataset, **loader_kwargs), 2 * warmup_batches(args.num_workers))
        wait_for_workers_to_exit(children_before)
    traces = {}
    for position, (name, cls) in enumerate(loader_classes.items(), start=1):
        started = time.perf_counter()
        trace = trace_epoch(name, cls(dataset, **loader_kwargs), args.every)
        wait_for_workers_to_exit(children_before)
        traces[name] = trace
        progress(f"{step_prefix}[{position}/{len(loader_classes)}] memory, {name}: worker USS "
                 f"{_format_mib_list(trace.start_uss_mib)} -> {_format_mib_list(trace.end_uss_mib)} MiB "
                 f"over {args.batches} batches ({len(trace.batches)} samples) "
                 f"in {time.perf_counter() - started:.1f} s")
    if len({trace.checksum for trace in traces.values()}) != 1:
        progress("WARNING: memory: the loaders delivered different data (checksums differ)")
    return traces


def _format_mib_list(values, signed=False):
    return "/".join("gone" if value is None else f"{value:{'+' if signed else ''}.1f}"
                    for value in values)


def render_report(traces, args):
    headers = ["loader", "workers", "USS at 1st batch MiB", "USS at end MiB", "peak USS MiB",
               "growth MiB", "PSS at end MiB"]
    rows = [
        [name, len(trace.worker_pids), _format_mib_list(trace.start_uss_mib),
         _format_mib_list(trace.end_uss_mib), _format_mib_list(trace.peak_uss_mib),
         _format_mib_list(trace.growth_uss_mib, signed=True),
         _format_mib_list(trace.pss_mib[-1])]
        for name, trace in traces.items()
    ]
    note = (f"\n\nPer worker (w0/w1/...), one epoch of {args.batches} tiny batches (batch "
            f"{args.batch_size}, {args.num_workers} workers, {args.context}), sampled every "
            f"{args.every} batches; USS = memory only that worker maps.")
    return markdown_table(headers, rows, align="lrrrrrr") + note


def traces_to_json(traces):
    return {name: asdict(trace) for name, trace in traces.items()}


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.memory",
        description="Per-worker USS over an epoch, fastloader vs torch.utils.data.DataLoader.",
    )
    parser.add_argument("--quick", action="store_true", help="1,000 batches, a sample every 25")
    parser.add_argument("--batches", type=positive_int, default=None,
                        help="batches in the epoch (default 3000, 1000 with --quick)")
    parser.add_argument("--every", type=positive_int, default=None,
                        help="sample every N batches (default 50, 25 with --quick)")
    parser.add_argument("--context", choices=("fork", "spawn", "forkserver"), default="fork")
    parser.add_argument("--num-workers", type=positive_int, default=2)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--json", metavar="PATH", help="also write the traces as JSON")
    args = parser.parse_args(argv)
    if args.batches is None:
        args.batches = 1000 if args.quick else 3000
    if args.every is None:
        args.every = 25 if args.quick else 50
    return args


def main(argv=None):
    args = parse_args(argv)
    fastloader_module, fastloader_cls = import_fastloader()
    traces = trace_loaders(args, fastloader_cls)
    print(render_report(traces, args))
    if args.json:
        write_json(args.json, json_record("memory", environment(fastloader_module), args,
                                          traces=traces_to_json(traces)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
