"""FFCV 1.0.2's Loader beside torch's DataLoader and fastloader.DataLoader.

    python -m benchmarks.ffcv_peer                 # full run (`make bench-ffcv`)
    python -m benchmarks.ffcv_peer --quick         # smoke run
    python -m benchmarks.ffcv_peer --workloads tiny --repeats 7 --json out.json

Runs in .venv-ffcv (FFCV needs OpenCV, libturbojpeg and numba, which
`make bench`/`make test` must not depend on); `make bench-ffcv` builds it.

FFCV cannot read a Python dataset: it reads its own .beton file through a
pipeline compiled by numba, with threads instead of worker processes. So each
workload's dataset is first written to a .beton in a temporary directory (not
timed), with the same samples the other two loaders get from the dataset:

    tiny   16 float32 + int label            NDArrayField + IntField
    image  uint8 3x224x224 + int label       NDArrayField + IntField
    jpeg   JPEG decode + random resized      RGBImageField (jpg, quality 90)
           crop to 224x224 + int label       + RandomResizedCropRGBImageDecoder

Method (see also benchmarks/README.md): 2 workers (FFCV: num_workers=2
threads), batch 64, drop_last, sequential order (FFCV: OrderOption.SEQUENTIAL,
os_cache=True), fork. Each loader is built once per workload (torch and
fastloader with persistent workers; FFCV's Loader compiles its pipeline on the
first epoch) and gets one untimed epoch; then every repeat runs each loader
once, in an order that flips every repeat; a run is one or a few epochs back
to back (tiny 3, image 6: FFCV and fastloader get through one in a fraction of
a second), each timed with the harness's ``time_one_epoch`` (first batches of
each epoch untimed, every batch read) and added up.
Ratios are to torch within the same repeat, median over repeats. CPU
us/sample is the CPU time of the main process (all its threads: FFCV's work is
there) plus the worker processes, over the timed window, per sample.

Data check: in sequential order all three loaders must deliver the same
epoch checksum (tiny, image). For jpeg the crops are random and the decoders
differ (PIL vs libjpeg-turbo + OpenCV), so only the labels and the batch
shapes are compared, on the first batches of one epoch.
"""

import argparse
import functools
import gc
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import psutil
import torch
import torch.utils.data

from benchmarks import datasets
from benchmarks.jpeg_dataset import JpegDataset
from benchmarks.harness import (
    RunResult,
    Stats,
    json_record,
    markdown_table,
    progress,
    time_one_epoch,
    wait_for_workers_to_exit,
    write_json,
)

TORCH, FASTLOADER, FFCV = "torch", "fastloader", "ffcv"
LOADERS = (TORCH, FASTLOADER, FFCV)
CHECK_BATCHES = 4  # batches compared by the label/shape check
_KEEP_UNTIL_EXIT = []


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    make_dataset: Callable[[int], torch.utils.data.Dataset]
    # Batches timed per epoch (after the warm-up). image is smaller than in
    # benchmarks.throughput: FFCV needs every sample in the file (150 KiB each),
    # and 150 batches are already a 1.4 GiB .beton.
    timed_batches: int
    quick_timed_batches: int
    exact: bool  # whether every loader must deliver bit-identical data
    # Epochs timed back to back per run, so that even the fastest loader's
    # timed window lasts long enough (~0.5-1 s) to average out scheduler noise.
    epochs_per_run: int = 1
    quick_epochs_per_run: int = 1


WORKLOADS = {
    w.name: w
    for w in (
        Workload("tiny", "16 float32 + int label", datasets.TinyDataset, 2500, 800, True,
                 epochs_per_run=3, quick_epochs_per_run=2),
        # the same samples; torch and fastloader read them through __getitems__
        # (fastloader.CollatedSamples), FFCV from the same .beton as tiny
        Workload("tiny_batched", "tiny, a dataset with __getitems__", datasets.TinyBatchedDataset,
                 2500, 800, True, epochs_per_run=3, quick_epochs_per_run=2),
        Workload("image", "uint8 3x224x224 + int label", datasets.ImageDataset, 150, 60, True,
                 epochs_per_run=6, quick_epochs_per_run=4),
        Workload("jpeg", "JPEG 400x320 decode + random resized crop to 224x224 HWC uint8 + int label",
                 JpegDataset, 40, 12, False),
    )
}


# ---- FFCV: writing the .beton and building its Loader ----------------------------------------

def import_ffcv():
    try:
        import ffcv  # noqa: F401
    except ImportError as error:
        sys.exit(f"cannot import ffcv ({error}); run `make bench-ffcv`, which builds .venv-ffcv")
    return sys.modules["ffcv"]


class _WriterView:
    """The dataset as FFCV's writer wants it: a tuple of NumPy values per sample.

    The writer forks its processes (no pickling), so a plain class is enough.
    """

    def __init__(self, workload, dataset):
        self.workload, self.dataset = workload, dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        if self.workload.name == "jpeg":
            return self.dataset.decoded(index), self.dataset.label(index)
        features, label = self.dataset[index]
        return features.numpy(), int(label)


def _fields(workload):
    from ffcv.fields import IntField, NDArrayField, RGBImageField

    if workload.name in ("tiny", "tiny_batched"):
        data = NDArrayField(dtype=np.dtype("float32"), shape=(datasets.TinyDataset.FEATURES,))
    elif workload.name == "image":
        data = NDArrayField(dtype=np.dtype("uint8"), shape=datasets.ImageDataset.SHAPE)
    else:
        data = RGBImageField(write_mode="jpg", jpeg_quality=JpegDataset.QUALITY)
    return {"data": data, "label": IntField()}


def write_beton(workload, dataset, path):
    from ffcv import writer as ffcv_writer

    # Silence the writer's progress bar (a tqdm per file) on stderr.
    if not isinstance(ffcv_writer.tqdm, functools.partial):
        ffcv_writer.tqdm = functools.partial(ffcv_writer.tqdm, disable=True)
    writer = ffcv_writer.DatasetWriter(path, _fields(workload), num_workers=2)
    writer.from_indexed_dataset(_WriterView(workload, dataset))


def build_ffcv_loader(workload, path, batch_size, num_workers):
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.decoders import NDArrayDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import ToTensor

    if workload.name == "jpeg":
        decoder = RandomResizedCropRGBImageDecoder((JpegDataset.OUTPUT, JpegDataset.OUTPUT),
                                                   scale=JpegDataset.SCALE, ratio=JpegDataset.RATIO)
    else:
        decoder = NDArrayDecoder()
    return Loader(path, batch_size=batch_size, num_workers=num_workers,
                  order=OrderOption.SEQUENTIAL, os_cache=True, drop_last=True,
                  pipelines={"data": [decoder, ToTensor()], "label": [IntDecoder(), ToTensor()]})


# ---- measuring -------------------------------------------------------------------------------

def warmup_batches(num_workers):
    """As benchmarks.throughput: the batches an epoch starts with, untimed."""
    return 4 * num_workers


def cpu_us_per_sample(result):
    """Main process (every thread) + workers CPU in the timed window, per sample."""
    cpu = result.main_cpu_s + (result.workers_cpu_s or 0.0)
    return cpu / result.timed_samples * 1e6


def time_epochs(loader, warmup, epochs):
    """``epochs`` epochs of ``time_one_epoch``, added up into one result (each
    epoch's first ``warmup`` batches stay untimed)."""
    results = [time_one_epoch(loader, warmup) for _ in range(epochs)]
    workers = [r.workers_cpu_s for r in results]
    return RunResult(
        first_batch_s=results[0].first_batch_s,
        timed_s=sum(r.timed_s for r in results),
        timed_batches=sum(r.timed_batches for r in results),
        timed_samples=sum(r.timed_samples for r in results),
        timed_bytes=sum(r.timed_bytes for r in results),
        main_cpu_s=sum(r.main_cpu_s for r in results),
        checksum=sum(r.checksum for r in results),
        workers_cpu_s=None if None in workers else sum(workers),
    )


def labels_and_shapes(loader, batches):
    """What the data check compares when the pixels cannot be: the labels of
    the first ``batches`` batches, in order, and the shape and dtype of the data."""
    labels, shapes = [], []
    iterator = iter(loader)
    for _ in range(batches):
        data, label = next(iterator)
        labels.extend(int(value) for value in label.reshape(-1).tolist())
        shapes.append((tuple(data.shape), str(data.dtype)))
    for _ in iterator:  # finish the epoch the ordinary way
        pass
    del iterator
    return labels, shapes


@dataclass
class WorkloadResult:
    workload: Workload
    samples_per_s: dict  # loader -> Stats
    ratio_to_torch: dict  # loader -> Stats of per-repeat ratios
    cpu_us_per_sample: dict  # loader -> Stats
    workers_cpu_us_per_sample: dict  # loader -> Stats or None (FFCV has no worker processes)
    data_agrees: bool
    data_check: str
    beton_write_s: float
    beton_mib: float
    epochs_per_run: int
    timed_batches: int  # per epoch
    runs: dict


def benchmark_workload(workload, args, fastloader_cls, tmpdir):
    warmup = warmup_batches(args.num_workers)
    timed = workload.quick_timed_batches if args.quick else workload.timed_batches
    epochs = workload.quick_epochs_per_run if args.quick else workload.epochs_per_run
    dataset = workload.make_dataset((warmup + timed) * args.batch_size)

    path = os.path.join(tmpdir, f"{workload.name}.beton")
    started = time.perf_counter()
    write_beton(workload, dataset, path)
    write_s = time.perf_counter() - started
    beton_mib = os.path.getsize(path) / (1 << 20)
    progress(f"  {workload.name}: wrote {len(dataset):,} samples to a {beton_mib:,.1f} MiB .beton "
             f"in {write_s:.1f} s")

    children_before = {child.pid for child in psutil.Process().children(recursive=True)}
    common = dict(batch_size=args.batch_size, num_workers=args.num_workers,
                  multiprocessing_context=args.context, persistent_workers=True, drop_last=True)
    loaders = {
        TORCH: torch.utils.data.DataLoader(dataset, **common),
        FASTLOADER: fastloader_cls(dataset, **common),
        FFCV: build_ffcv_loader(workload, path, args.batch_size, args.num_workers),
    }
    lengths = {name: len(loader) for name, loader in loaders.items()}
    if len(set(lengths.values())) != 1:
        raise RuntimeError(f"{workload.name}: the loaders disagree on the epoch length: {lengths}")

    # One untimed epoch each: worker start-up, FFCV's numba compilation, page cache.
    checks = {}
    for name, loader in loaders.items():
        started = time.perf_counter()
        checks[name] = labels_and_shapes(loader, CHECK_BATCHES)
        progress(f"  {workload.name}: {name} warm-up epoch {time.perf_counter() - started:.1f} s")

    runs = {name: [] for name in LOADERS}
    for repeat in range(args.repeats):
        for name in (LOADERS if repeat % 2 == 0 else LOADERS[::-1]):
            result = time_epochs(loaders[name], warmup, epochs)
            runs[name].append(result)
            if name != FFCV and result.workers_cpu_s is None:
                # cpu_us_per_sample would then count the main process only
                progress(f"  warning: {workload.name}: {name}'s worker CPU time could not be read")
            if args.verbose:
                progress(f"  {workload.name} repeat {repeat + 1}/{args.repeats} {name:<10} "
                         f"{result.samples_per_s:>12,.0f} samples/s, "
                         f"CPU {cpu_us_per_sample(result):.1f} us/sample")
    # numba's finalizers raise (and print) a KeyError when an FFCV Loader's
    # compiled pipeline is collected mid-run; keep it until the process exits.
    _KEEP_UNTIL_EXIT.append(loaders.pop(FFCV))
    del loaders
    gc.collect()
    wait_for_workers_to_exit(children_before)

    reference_labels, reference_shapes = checks[TORCH]
    labels_agree = all(labels == reference_labels for labels, _ in checks.values())
    shapes_agree = all(shapes == reference_shapes for _, shapes in checks.values())
    if workload.exact:
        checksums = {run.checksum for rs in runs.values() for run in rs}
        data_agrees = labels_agree and shapes_agree and len(checksums) == 1
        data_check = "epoch checksums equal" if data_agrees else "DIFFERS"
    else:
        data_agrees = labels_agree and shapes_agree
        data_check = ("labels + shapes equal (random crops)" if data_agrees
                      else f"DIFFERS (shapes: {[s[0] for _, s in checks.values()]})")

    def per_loader(value):
        return {name: Stats.of(value(r) for r in rs) for name, rs in runs.items()}

    workers_cpu = {}
    for name, rs in runs.items():
        values = [r.workers_cpu_us_per_sample for r in rs]
        workers_cpu[name] = None if None in values else Stats.of(values)
    return WorkloadResult(
        workload=workload,
        samples_per_s=per_loader(lambda r: r.samples_per_s),
        ratio_to_torch={
            name: Stats.of(r.samples_per_s / t.samples_per_s for r, t in zip(rs, runs[TORCH]))
            for name, rs in runs.items()
        },
        cpu_us_per_sample=per_loader(cpu_us_per_sample),
        workers_cpu_us_per_sample=workers_cpu,
        data_agrees=data_agrees,
        data_check=data_check,
        beton_write_s=write_s,
        beton_mib=beton_mib,
        epochs_per_run=epochs,
        timed_batches=timed,
        runs=runs,
    )


# ---- reporting -------------------------------------------------------------------------------

def _stats_text(stats, digits=0):
    return f"{stats.median:,.{digits}f} ({stats.low:,.{digits}f}-{stats.high:,.{digits}f})"


def render_report(results, args):
    headers = ["workload", "loader", "samples/s median (min-max)", "ratio to torch (per-repeat min-max)",
               "CPU us/sample (main + workers)", "of which workers", "data"]
    rows = []
    for result in results:
        for name in LOADERS:
            ratio = result.ratio_to_torch[name]
            rows.append([
                result.workload.name if name == TORCH else "",
                name,
                _stats_text(result.samples_per_s[name]),
                "1.00x" if name == TORCH else
                f"{ratio.median:.2f}x ({ratio.low:.2f}-{ratio.high:.2f})",
                f"{result.cpu_us_per_sample[name].median:,.1f}",
                "-" if result.workers_cpu_us_per_sample[name] is None
                else f"{result.workers_cpu_us_per_sample[name].median:,.1f}",
                result.data_check if name == TORCH else "",
            ])
    notes = [
        "",
        f"{args.repeats} repeats, loader order flipped every repeat; {args.num_workers} workers "
        f"(FFCV: {args.num_workers} threads), batch {args.batch_size}, drop_last, sequential order, "
        f"{args.context} ({'quick' if args.quick else 'full'} run). Each loader built once per "
        "workload (persistent workers; FFCV os_cache=True) and given one untimed epoch; a run "
        "times one or more epochs back to back (see below), "
        f"{warmup_batches(args.num_workers)} untimed batches at the start of every epoch.",
        "Ratio: loader / torch within each repeat, median (range). CPU us/sample: CPU time of the "
        "main process (all threads: FFCV's pipeline runs there) plus the workers over the timed "
        "window, per sample, median; \"of which workers\": the worker processes alone (FFCV has "
        "none: its threads count as the main process).",
    ]
    for result in results:
        notes.append(f"{result.workload.name}: {result.workload.description}; "
                     f"{result.epochs_per_run} epoch(s) of {result.timed_batches} timed batches per run; .beton "
                     f"{result.beton_mib:,.1f} MiB, written in {result.beton_write_s:.1f} s (untimed).")
        if not result.data_agrees:
            notes.append(f"WARNING: {result.workload.name}: the loaders delivered different data.")
    return markdown_table(headers, rows, align="llrrrrl") + "\n" + "\n".join(notes)


def environment(fastloader_module):
    ffcv = sys.modules.get("ffcv")
    import numba

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fastloader": getattr(fastloader_module, "__version__", None),
        "ffcv": getattr(ffcv, "__version__", None) or "1.0.2",
        "numba": numba.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def to_json(results, args, fastloader_module):
    return json_record(
        "ffcv_peer", environment(fastloader_module), args,
        warmup_batches=warmup_batches(args.num_workers),
        loaders=list(LOADERS),
        workloads=[
            {
                "name": r.workload.name,
                "description": r.workload.description,
                "unit": "samples/s",
                "loaders": list(LOADERS),
                "data_agrees": r.data_agrees,
                "data_check": r.data_check,
                "beton_mib": r.beton_mib,
                "beton_write_s": r.beton_write_s,
                "epochs_per_run": r.epochs_per_run,
                "timed_batches_per_epoch": r.timed_batches,
                "value": {name: asdict(stats) for name, stats in r.samples_per_s.items()},
                "ratio_to_torch": {name: asdict(stats) for name, stats in r.ratio_to_torch.items()},
                "cpu_us_per_sample": {name: asdict(s) for name, s in r.cpu_us_per_sample.items()},
                "workers_cpu_us_per_sample": {
                    name: None if s is None else asdict(s)
                    for name, s in r.workers_cpu_us_per_sample.items()
                },
                "runs": {name: [asdict(run) for run in rs] for name, rs in r.runs.items()},
            }
            for r in results
        ],
    )


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ffcv_peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer batches, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (3 with --quick)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)}")
    parser.add_argument("--context", choices=("fork", "spawn", "forkserver"), default="fork")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="a progress line per run")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown or not names:
        parser.error(f"unknown workload(s) {unknown}; choose from {','.join(WORKLOADS)}")
    args.workloads = names
    return args


def main(argv=None):
    args = parse_args(argv)
    import_ffcv()
    import fastloader

    progress(f"ffcv vs fastloader {fastloader.__version__} ({fastloader.__file__}) vs torch "
             f"{torch.__version__}; {args.num_workers} workers, {args.context}, {args.repeats} repeats")
    results = []
    with tempfile.TemporaryDirectory(prefix="ffcv-bench-") as tmpdir:
        for position, name in enumerate(args.workloads, start=1):
            started = time.perf_counter()
            result = benchmark_workload(WORKLOADS[name], args, fastloader.DataLoader, tmpdir)
            results.append(result)
            os.unlink(os.path.join(tmpdir, f"{name}.beton"))  # the image file is 1.4 GiB
            ratios = ", ".join(f"{n} {result.ratio_to_torch[n].median:.2f}x" for n in LOADERS[1:])
            progress(f"[{position}/{len(args.workloads)}] {name}: {ratios} ({result.data_check}) "
                     f"in {time.perf_counter() - started:.0f} s")
    print(render_report(results, args))
    if args.json:
        write_json(args.json, to_json(results, args, fastloader))
    return 0 if all(r.data_agrees for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())


def loaders():
    """The throughput benchmark's peer protocol (benchmarks.loaders): FFCV reads a
    .beton written from the dataset, not the dataset itself, and builds in its own
    venv, so it is never run inside `make bench`; the report says where it is."""
    return {}, {FFCV: "measured by `make bench-ffcv` (FFCV reads a .beton and builds in "
                      "its own venv .venv-ffcv), see benchmarks/README.md"}
