"""Timing and reporting shared by the benchmark modules.

Method, and why:

- Every run builds a fresh loader and iterates it once (one epoch). Worker
  start-up is timed separately as "time to first batch"; the throughput window
  opens only after a few warm-up batches, so it measures the steady state that
  dominates a real epoch rather than the start-up cost.
- fastloader and torch runs alternate, and the order flips every repeat
  (A B, B A, A B, ...), so slow drift in the load of a shared machine hits both
  libraries alike instead of always favouring whichever ran first.
- Results are medians with their min-max spread: on a noisy box one stalled run
  must not move the verdict, and the spread shows how far to trust it.
- Before each run the harness waits for the previous loader's worker processes
  to exit, so a lingering worker does not steal a core from the next run.
- Each loader class first gets one short untimed epoch: the first loader in a
  fresh process measurably pays for lazy imports and first-use set-up (about
  10-20% on tiny batches), which would always penalise whichever ran first.
"""

import argparse
import dataclasses
import gc
import json
import math
import mmap
import os
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import psutil
import torch

MIB = 1 << 20

# Tensors below this size are summed whole: that costs microseconds and gives a
# meaningful checksum. Bigger ones are read one element per page, which faults
# in every page (the real cost of a fresh mapping, which is exactly where
# shared-memory designs differ) without adding a full memory pass that would
# dilute the difference between the loaders.
_SMALL_TENSOR_BYTES = 64 * 1024

# How long to wait for a finished loader's workers to exit before warning.
_WORKER_EXIT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RunResult:
    """One epoch of one loader."""

    first_batch_s: float  # iter() to the first batch in hand, worker start-up included
    timed_s: float  # wall time of the batches after the warm-up
    timed_batches: int
    timed_samples: int
    timed_bytes: int  # bytes of every tensor in the timed batches
    main_cpu_s: float  # CPU time the main process spent in the timed window
    checksum: float
    # CPU time all workers together spent in the timed window (None if it could
    # not be read). Unlike wall time it hardly depends on what else the machine
    # runs, so it tells whether a loader adds work or merely got fewer cycles.
    workers_cpu_s: Optional[float] = None
    # Whether the loader had worker processes in the timed window (threads and
    # in-process loaders do their work in the main process: main_cpu_s has it all).
    has_workers: bool = True
    # Peak PSS of the main process + all its children during the run (None if not
    # sampled), and of the main process alone.
    peak_pss_bytes: Optional[int] = None
    peak_main_pss_bytes: Optional[int] = None
    # Peak of that PSS + the shared memory that none of them maps (segments in
    # flight between processes; see benchmarks/pss.py).
    peak_with_unmapped_shm_bytes: Optional[int] = None
    # fastloader's shared ring arena per worker (its stats()), if it reports one.
    arena_bytes_per_worker: Optional[list] = None

    @property
    def samples_per_s(self):
        return self.timed_samples / self.timed_s

    @property
    def mib_per_s(self):
        return self.timed_bytes / MIB / self.timed_s

    @property
    def workers_cpu_us_per_sample(self):
        if self.workers_cpu_s is None:
            return None
        return self.workers_cpu_s / self.timed_samples * 1e6

    @property
    def total_cpu_us_per_sample(self):
        """CPU of the main process (all its threads) + all workers, per timed sample."""
        if self.has_workers and self.workers_cpu_s is None:
            return None
        return (self.main_cpu_s + (self.workers_cpu_s or 0.0)) / self.timed_samples * 1e6


@dataclass(frozen=True)
class Stats:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values):
        values = list(values)
        return cls(statistics.median(values), min(values), max(values))

    def ms(self):
        """'median (low-high)' in milliseconds, for seconds measured."""
        return f"{self.median * 1e3:.1f} ({self.low * 1e3:.1f}-{self.high * 1e3:.1f})"


def iter_tensors(batch):
    """Yield every tensor in a (possibly nested) collated batch."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from iter_tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from iter_tensors(value)


def touch(batch):
    """Read the batch as a consumer would start to, and return a checksum.

    Zero-copy loaders hand out views of shared memory, so a benchmark that never
    reads the tensors would not pay for their pages at all.
    """
    checksum = 0.0
    for tensor in iter_tensors(batch):
        flat = tensor.reshape(-1)
        if tensor.nbytes > _SMALL_TENSOR_BYTES:
            flat = flat[:: max(1, mmap.PAGESIZE // tensor.element_size())]
        checksum += float(flat.sum(dtype=torch.float64))
    return checksum


def batch_size_of(batch):
    """Samples in a batch: the leading dimension of its first tensor."""
    first = next(iter_tensors(batch), None)
    return 0 if first is None or first.dim() == 0 else len(first)


def workers_cpu_seconds(pids):
    """User + system CPU time of these processes (all their threads), or None."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            return None
        total += times.user + times.system
    return total


def time_one_epoch(loader, warmup_batches):
    """Iterate ``loader`` once with a plain ``for`` loop, as user code does.

    The last timestamp is taken right after the last batch is consumed, so the
    worker shutdown that follows the end of the epoch is not timed. The
    workers' CPU time is read (from /proc, ~0.1 ms) just before the window
    opens and just after it closes, so reading it is not timed either. The
    workers are looked up when the window opens (some loaders start their
    processes lazily, or anew each epoch): the iterator's own list for the
    DataLoaders, else every process this one started for the loader.
    The checksum is the exactly rounded sum (math.fsum) of per-batch checksums,
    so it does not depend on the order in which batches arrive.
    """
    batch_checksums = []
    timed_batches = timed_samples = timed_bytes = 0
    first_batch_s = timed_start = last_batch_end = cpu_start = cpu_end = None
    workers_cpu_start = workers_cpu_end = None
    pids = []
    arena = None
    index = -1
    start = time.perf_counter()
    iterator = iter(loader)
    try:
        last_index = len(loader) - 1
    except TypeError:  # an IterableDataset without __len__: no worker CPU figure
        last_index = -1
    # Not enumerate(): its reused result tuple keeps the previous batch alive
    # while the next one is being fetched.
    for batch in iterator:
        index += 1
        batch_checksums.append(touch(batch))
        if index >= warmup_batches:
            timed_batches += 1
            timed_samples += batch_size_of(batch)
            timed_bytes += sum(t.nbytes for t in iter_tensors(batch))
        # Drop the batch before asking for the next one: holding it would pin
        # a buffer (a ring slot, for fastloader) that a real training loop
        # would have released by then.
        del batch
        if index == warmup_batches - 1:
            pids = iterator_worker_pids(iterator) or loader_child_pids()
            arena = arena_bytes_per_worker(iterator)
            if pids:
                workers_cpu_start = workers_cpu_seconds(pids)
        now = time.perf_counter()
        if index == 0:
            first_batch_s = now - start
        if index == warmup_batches - 1:
            timed_start, cpu_start = now, time.process_time()
        last_batch_end, cpu_end = now, time.process_time()
        if index == last_index:  # before the end of the epoch stops the workers
            if pids:
                workers_cpu_end = workers_cpu_seconds(pids)
            arena = _max_per_worker(arena, arena_bytes_per_worker(iterator))
    del iterator
    if timed_batches == 0:
        raise ValueError(f"the epoch had no batches after {warmup_batches} warm-up batches")
    workers_cpu_s = None
    if workers_cpu_start is not None and workers_cpu_end is not None:
        workers_cpu_s = workers_cpu_end - workers_cpu_start
    return RunResult(
        first_batch_s=first_batch_s,
        timed_s=last_batch_end - timed_start,
        timed_batches=timed_batches,
        timed_samples=timed_samples,
        timed_bytes=timed_bytes,
        main_cpu_s=cpu_end - cpu_start,
        checksum=math.fsum(batch_checksums),
        workers_cpu_s=workers_cpu_s,
        has_workers=bool(pids),
        arena_bytes_per_worker=arena,
    )


def time_steady_epoch(loader, warmup_batches):
    """Steady state: a first, partial epoch starts the (persistent) workers, then a
    whole second epoch is measured as ``time_one_epoch`` measures one.

    The first epoch is cut after ``warmup_batches`` batches (dropping the
    iterator mid-epoch, which every loader must handle); its time to the first
    batch, cold workers included, is what the result reports as ``first_batch_s``.
    """
    start = time.perf_counter()
    iterator = iter(loader)
    first_batch_s = None
    for index in range(warmup_batches):
        batch = next(iterator, None)
        if batch is None:
            break
        if index == 0:
            first_batch_s = time.perf_counter() - start
        touch(batch)
        del batch
    del iterator
    result = time_one_epoch(loader, warmup_batches)
    return dataclasses.replace(result, first_batch_s=first_batch_s)


def _max_per_worker(first, second):
    if first is None or second is None or len(first) != len(second):
        return first if second is None else second
    return [max(a, b) for a, b in zip(first, second)]


def arena_bytes_per_worker(iterator):
    """Shared arena bytes per worker from a fastloader iterator's stats(), if it has them."""
    stats = getattr(iterator, "stats", None)
    if stats is None:
        return None
    try:
        workers = stats(memory=False).get("workers", [])
    except Exception:  # noqa: BLE001 - a missing figure, not a benchmark failure
        return None
    values = [w.get("arena_bytes") for w in workers]
    return None if not values or None in values else values


@dataclass(frozen=True)
class NextCallResult:
    """One epoch of one loader, timing only the main process's ``next()`` calls."""

    first_batch_s: float
    timed_batches: int
    consumer_sleep_s: float  # the simulated training step between batches
    median_us: float  # median wall time of one ``next(iterator)``
    p10_us: float
    p90_us: float
    mean_us: float
    checksum: float
    peak_pss_bytes: Optional[int] = None  # as in RunResult
    peak_main_pss_bytes: Optional[int] = None
    peak_with_unmapped_shm_bytes: Optional[int] = None


def time_next_calls(loader, warmup_batches, consumer_sleep_s):
    """Time each ``next(iterator)`` of one epoch while the consumer is the bottleneck.

    After every batch the consumer sleeps ``consumer_sleep_s`` (a stand-in for
    a training step), long enough for the workers to refill everything they
    prefetch. Each call then finds its batch already produced, and its wall
    time is what the loader itself costs the main process per batch: taking
    the result, turning it into tensors, and dispatching the next task.
    """
    iterator = iter(loader)
    expected = len(loader)
    checksum = 0.0
    first_batch_s = None
    durations = []
    start = time.perf_counter()
    for index in range(expected):
        before = time.perf_counter()
        batch = next(iterator)
        after = time.perf_counter()
        if index == 0:
            first_batch_s = after - start
        elif index >= warmup_batches:
            durations.append(after - before)
        checksum += touch(batch)
        del batch
        time.sleep(consumer_sleep_s)
    if next(iterator, None) is not None:  # also ends the epoch the ordinary way
        raise ValueError(f"the loader yielded more than its len() of {expected} batches")
    del iterator
    if not durations:
        raise ValueError(f"the epoch had no batches after {warmup_batches} warm-up batches")
    ordered = sorted(durations)

    def quantile(q):
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6

    return NextCallResult(
        first_batch_s=first_batch_s,
        timed_batches=len(durations),
        consumer_sleep_s=consumer_sleep_s,
        median_us=statistics.median(durations) * 1e6,
        p10_us=quantile(0.1),
        p90_us=quantile(0.9),
        mean_us=statistics.fmean(durations) * 1e6,
        checksum=checksum,
    )


def iterator_worker_pids(iterator):
    """Pids of a multi-process iterator's workers, for either loader.

    fastloader's iterator has a public ``worker_pids``; torch's keeps its
    ``multiprocessing.Process`` objects in the private ``_workers``.
    """
    pids = getattr(iterator, "worker_pids", None)
    if pids is None:
        pids = [worker.pid for worker in getattr(iterator, "_workers", ())]
    return list(pids)


# Processes that live for the whole benchmark (the PSS sampler): never a
# loader's worker, never waited for.
EXCLUDED_PIDS = set()
# Children that existed before the loaders ran (set by run_alternating).
_children_before = set()


def loader_child_pids():
    """Every live process below this one that a loader started: all descendants
    but the multiprocessing helpers, the PSS sampler and what ran before."""
    expected = _children_before | _multiprocessing_helper_pids() | EXCLUDED_PIDS
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    return [child.pid for child in children if child.pid not in expected]


def _multiprocessing_helper_pids():
    """The forkserver and resource tracker: started once, they live until exit.

    Workers started by the forkserver are its children, so they are still
    found (and waited for) through the recursive child search.
    """
    helpers = (
        getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
    )
    return {pid for pid in helpers if pid is not None}


def wait_for_workers_to_exit(children_before):
    """Wait until the child processes a loader started have exited.

    Only waits (never kills): a worker that outlives its loader is a finding
    to report, not something for the benchmark to hide.
    """
    gc.collect()  # an iterator caught in a reference cycle would keep its workers
    expected = set(children_before) | _multiprocessing_helper_pids() | EXCLUDED_PIDS
    lingering = [
        child
        for child in psutil.Process().children(recursive=True)
        if child.pid not in expected
    ]
    _, alive = psutil.wait_procs(lingering, timeout=_WORKER_EXIT_TIMEOUT_S)
    if alive:
        pids = ", ".join(str(p.pid) for p in alive)
        progress(f"warning: loader worker(s) still running {_WORKER_EXIT_TIMEOUT_S:.0f} s after the epoch: {pids}")


def warm_up(loader, batches):
    """Consume the first ``batches`` batches untimed, then drop the iterator."""
    iterator = iter(loader)
    for _ in range(batches):
        batch = next(iterator, None)
        if batch is None:  # an epoch shorter than the warm-up
            break
        touch(batch)
        del batch
    # Dropping a live iterator mid-epoch is part of the DataLoader contract:
    # it must stop the workers, which the caller then waits for.
    del iterator


def run_alternating(build_loader, loader_classes, repeats, warmup_batches, on_run=None,
                    measure=time_one_epoch, warm=True):
    """Time ``repeats`` epochs per loader class, alternating the classes.

    ``build_loader(cls)`` returns a fresh loader; ``loader_classes`` maps a
    display name to a DataLoader class. ``measure(loader, warmup_batches)``
    runs one epoch and returns its result (``time_one_epoch`` by default).
    Returns ``{name: [result, ...]}``.
    ``on_run(repeat, name, result)`` is called after every run (for progress).
    ``warm=False`` skips the untimed epoch per loader class (for a caller that
    already ran one). Nothing samples memory here: see ``run_memory_epochs``.
    """
    names = list(loader_classes)
    results = {name: [] for name in names}
    children_before = {child.pid for child in psutil.Process().children(recursive=True)}
    _children_before.clear()
    _children_before.update(children_before)
    for name in names if warm else ():  # warm=False: the caller warmed them up
        warm_up(build_loader(loader_classes[name]), 2 * warmup_batches)
        wait_for_workers_to_exit(children_before)
    for repeat in range(repeats):
        order = names if repeat % 2 == 0 else names[::-1]
        for name in order:
            loader = build_loader(loader_classes[name])
            result = measure(loader, warmup_batches)
            del loader
            wait_for_workers_to_exit(children_before)
            results[name].append(result)
            if on_run is not None:
                on_run(repeat, name, result)
    return results


def run_memory_epochs(build_loader, loader_classes, warmup_batches, pss_sampler,
                      measure=time_one_epoch):
    """One more epoch per loader class, untimed, with ``pss_sampler`` (a
    ``benchmarks.pss.PssSampler``) sampling the PSS of the process tree from
    before the loader is built until its epoch ends. Returns ``{name: result}``,
    the result carrying the peaks.

    Memory is sampled in epochs of its own, never in the timed ones: reading
    smaps_rollup walks every page table of every process of the tree, about
    10 ms of kernel CPU per torch process, so sampling every 0.1 s takes a
    quarter to a third of a core. On a 2-core box that is CPU a multi-process
    loader needs and an in-process one does not, so it would bias both the
    ratios and the efficiency figure.
    """
    children_before = {child.pid for child in psutil.Process().children(recursive=True)}
    results = {}
    for name, cls in loader_classes.items():
        pss_sampler.start()
        loader = build_loader(cls)
        result = measure(loader, warmup_batches)
        peak = pss_sampler.stop()
        del loader
        wait_for_workers_to_exit(children_before)
        results[name] = dataclasses.replace(
            result, peak_pss_bytes=peak["peak_bytes"], peak_main_pss_bytes=peak["peak_main_bytes"],
            peak_with_unmapped_shm_bytes=peak["peak_with_unmapped_shm_bytes"])
    return results


def checksums_agree(results):
    """True if every run of every loader delivered the same data."""
    checksums = {run.checksum for runs in results.values() for run in runs}
    return len(checksums) == 1


def loaders_agreeing(results, reference):
    """name -> whether every run of that loader delivered what every run of
    ``reference`` did (the reference: only if all its own runs agree)."""
    expected = {run.checksum for run in results[reference]}
    if len(expected) != 1:
        return {name: False for name in results}
    return {name: {run.checksum for run in runs} == expected for name, runs in results.items()}


def markdown_table(headers, rows, align=None):
    """A Markdown table padded so it also reads well in a terminal.

    ``align`` is a string with one ``l`` or ``r`` per column (default: first
    column left, the rest right).
    """
    align = align or "l" + "r" * (len(headers) - 1)
    # zip() below would drop extra columns silently
    if len(align) != len(headers) or any(len(row) != len(headers) for row in rows):
        raise ValueError(f"{len(headers)} headers, {len(align)} alignments, rows of "
                         f"{sorted({len(row) for row in rows})} cells")
    cells = [list(map(str, headers))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[col]) for row in cells) for col in range(len(headers))]

    def line(row):
        padded = (
            cell.ljust(width) if how == "l" else cell.rjust(width)
            for cell, width, how in zip(row, widths, align)
        )
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(
        "-" * (width + 1) + (":" if how == "r" else "-") for width, how in zip(widths, align)
    ) + "|"
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def progress(message):
    """Progress goes to stderr so stdout holds only the report."""
    print(message, file=sys.stderr, flush=True)


def json_record(benchmark, environment, settings, **data):
    """The JSON document of one benchmark: what ran, when, on what, with which
    settings (an argparse namespace or a dict), then its data."""
    if not isinstance(settings, dict):
        settings = {key: value for key, value in vars(settings).items() if key != "json"}
    return {"benchmark": benchmark, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "environment": environment, "settings": settings, **data}


def write_json(path, document):
    with open(path, "w") as stream:
        json.dump(document, stream, indent=2)
        stream.write("\n")


def run_child(module, spec, timeout=600):
    """Run ``<module>.py --child <spec as JSON>`` in a fresh interpreter (so no
    measurement inherits another's heap or forkserver); the child prints its
    result as JSON on its last stdout line.

    The module runs as a script, by path, as a training script does: Python's
    forkserver preloads the main module only when it has a path (not under
    ``python -m``), and a script importing torch at the top thereby gives every
    forkserver, torch's DataLoader's too, torch preloaded."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, *module.split(".")) + ".py"
    cmd = [sys.executable, script, "--child", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root,
                          env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{module} with {spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def positive_int(text):
    """argparse type of the benchmarks' counts (--repeats, --batches, ...)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
