"""An epoch that ends in a dataset error: how long the training loop is held.

    python -m benchmarks.error_epoch                 # 3 repeats
    python -m benchmarks.error_epoch --quick         # 1 repeat
    python -m benchmarks.error_epoch --repeats 5 --json out.json

A sample raises in a worker (batch 3 of 10, 2 fork workers, batch 64, tiny
samples); the loop catches the exception, as a script that skips a bad shard or
logs and retries does, and goes on. Four times per loader:

- ``raise``: from the failing ``next()`` being called to the ``except`` block
  running (each batch before it is followed by a 20 ms "training step", so
  the error is waiting when it is asked for);
- ``except ends``: the ``except`` block left, the exception dropped. Whatever
  only the exception's traceback held is freed here, by reference counting;
- ``gc``: the next full garbage collection. Where the traceback holds the
  iterator in a reference cycle, it is the collector that frees it (its workers
  and shared memory torn down), at whatever point of training the collector
  next runs;
- ``gc again``: one more full collection right after, with nothing of the
  epoch left to free: what a collection of this process costs anyway (it
  varies by ~10 ms from one to the next).

torch's DataLoader iterator is freed by the collector, and stops its workers
from ``__del__``; by then the collector's weakref callbacks have stopped the
index queues' feeder threads, so the workers never get the message to exit,
and each is joined for torch's 5 s timeout before it is terminated.
torchdata's StatefulDataLoader has an iterator of its own. fastloader's
iterator tells its workers to stop through its rings in shared memory, which
the collector's order does not affect.

Loaders alternate (the order flips every repeat) in one process; medians over
the repeats. The automatic collector is off while timing, so that the
collection happens where it is timed.
"""

import argparse
import gc
import sys
import time
import warnings

import torch

from benchmarks.datasets import TinyDataset
from benchmarks.harness import Stats, markdown_table, positive_int, progress, write_json

WORKERS = 2
BATCH = 64
BATCHES = 10
FAILING_BATCH = 3
PARTS = ("raise", "except ends", "gc", "gc again")
STEP_S = 0.02


class FailingDataset(TinyDataset):
    """TinyDataset whose one sample (the first of batch FAILING_BATCH) raises."""

    def __getitem__(self, index):
        if index == FAILING_BATCH * BATCH:
            raise ValueError(f"sample {index} is corrupt")
        return super().__getitem__(index)


def loader_classes():
    """{name: DataLoader class}: torch, fastloader and, when installed, torchdata's
    StatefulDataLoader."""
    import fastloader
    classes = {"torch": torch.utils.data.DataLoader, "fastloader": fastloader.DataLoader}
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        pass
    else:
        classes["torchdata StatefulDataLoader"] = StatefulDataLoader
    return classes


def _full_collection_s():
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started


def time_failing_epoch(loader):
    """{part: seconds} for one epoch that ends in the dataset's error."""
    clock = time.perf_counter
    got = 0
    try:
        for _batch in loader:
            got += 1
            time.sleep(STEP_S)   # a training step
            called = clock()
    except ValueError:
        caught = clock()
    else:
        raise AssertionError("the dataset's error did not reach the loop")
    left = clock()
    assert got == FAILING_BATCH, got
    return {"raise": caught - called, "except ends": left - caught, "gc": _full_collection_s(),
            "gc again": _full_collection_s()}


def measure(repeats, step_prefix=""):
    """{loader name: {part: [seconds per repeat]}}"""
    classes = loader_classes()
    loaders = {name: cls(FailingDataset(BATCH * BATCHES), batch_size=BATCH,
                         num_workers=WORKERS, multiprocessing_context="fork")
               for name, cls in classes.items()}
    results = {name: {part: [] for part in PARTS} for name in loaders}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for repeat in range(repeats):
                names = list(loaders) if repeat % 2 == 0 else list(loaders)[::-1]
                for name in names:
                    gc.collect()
                    for part, seconds in time_failing_epoch(loaders[name]).items():
                        results[name][part].append(seconds)
                progress(f"{step_prefix}repeat {repeat + 1}/{repeats}: " + ", ".join(
                    f"{name} gc {results[name]['gc'][-1] * 1e3:.0f} ms" for name in loaders))
    finally:
        if was_enabled:
            gc.enable()
    return results


def render_report(results, repeats):
    headers = ["loader", "error reaches the loop, ms", "except block left, ms",
               "next full gc, ms", "one more full gc, ms"]
    rows = [[name] + [Stats.of(parts[part]).ms() for part in PARTS] for name, parts in results.items()]
    note = (f"\nTiny samples, batch {BATCH}, {WORKERS} fork workers; a sample of batch "
            f"{FAILING_BATCH} raises and the loop catches it. Medians (min-max) over {repeats} "
            f"alternating repeat(s) in one process, a {STEP_S * 1e3:.0f} ms step after each batch. One more "
            "full collection, with nothing of the epoch left to free, is what any "
            "collection costs here.")
    return markdown_table(headers, rows, align="lrrrr") + note


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.error_epoch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="default 3 (1 with --quick)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    results = measure(args.repeats)
    print(render_report(results, args.repeats))
    if args.json:
        write_json(args.json, {"repeats": args.repeats, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
