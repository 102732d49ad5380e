"""SPDL 0.8 as a peer: its thread pipeline, and the same pipeline in a subprocess
with its shared-memory transport.

Built as SPDL's documentation recommends for batch loading: the source is a
batch sampler (batches of indices, not one task per sample), one ``pipe`` stage
fetches a batch's samples and collates them (``concurrency`` = num_workers,
output in input order so batches arrive as torch's DataLoader delivers them),
and a sink buffers the results.

- ``spdl.thread``: ``PipelineBuilder(...).build(num_threads=num_workers)`` in
  the main process; rebuilt per epoch (threads are cheap to start).
- ``spdl.subprocess``: ``run_pipeline_in_subprocess`` runs that pipeline in one
  subprocess (the pattern SPDL documents for taking the work off the main
  process; the subprocess is reused across epochs), with a
  ``SharedMemorySegmentPool`` arena so the tensors of each batch come back as
  zero-copy views of a pre-allocated shared segment. One process: its
  ``num_workers`` threads share one GIL, so pure-Python sample work gets at most
  one core there (that is SPDL's design, and the report says so).
"""

from benchmarks.batch_fetch import FetchAndCollate, batch_sampler
from benchmarks.harness import iter_tensors
from benchmarks.loader_spec import LoaderSpec

THREADS = "spdl.thread"
SUBPROCESS = "spdl.subprocess"
SINK_BUFFER = 4
# The arena's segments must each hold the biggest batch; the first batch is
# measured and this much room is added for batches that come out larger (token
# batches are padded to their longest sequence).
_ARENA_HEADROOM = 2.0
_ARENA_EXTRA_BYTES = 1 << 20

_batch_bytes_cache = {}


def _builder(dataset, batch_size, num_workers, collate_fn):
    from spdl.pipeline import PipelineBuilder

    return (PipelineBuilder()
            .add_source(batch_sampler(dataset, batch_size))
            .pipe(FetchAndCollate(dataset, collate_fn), concurrency=num_workers,
                  output_order="input")
            .add_sink(buffer_size=SINK_BUFFER))


class SpdlThreadLoader:
    def __init__(self, dataset, *, batch_size, num_workers, collate_fn, persistent, context):
        del persistent, context  # threads: nothing to keep or to start
        self._args = (dataset, batch_size, max(1, num_workers), collate_fn)
        self._length = len(batch_sampler(dataset, batch_size))

    def __len__(self):
        return self._length

    def __iter__(self):
        pipeline = _builder(*self._args).build(num_threads=self._args[2])
        with pipeline.auto_stop():
            yield from pipeline


def _batch_bytes(dataset, batch_size, collate_fn):
    """Bytes of the tensors of the dataset's first batch (cached per dataset)."""
    key = (id(dataset), batch_size, id(collate_fn))
    if key not in _batch_bytes_cache:
        first = FetchAndCollate(dataset, collate_fn)(list(range(min(batch_size, len(dataset)))))
        _batch_bytes_cache[key] = sum(t.nbytes for t in iter_tensors(first))
    return _batch_bytes_cache[key]


class SpdlSubprocessLoader:
    def __init__(self, dataset, *, batch_size, num_workers, collate_fn, persistent, context):
        from spdl.pipeline import SharedMemorySegmentPool, run_pipeline_in_subprocess

        threads = max(1, num_workers)
        segment = int(_batch_bytes(dataset, batch_size, collate_fn) * _ARENA_HEADROOM
                      + _ARENA_EXTRA_BYTES)
        config = _builder(dataset, batch_size, threads, collate_fn).get_config()
        self._make = lambda: run_pipeline_in_subprocess(
            config, num_threads=threads, mp_context=context,
            # the sink's batches, the one being handed over and the one the
            # consumer holds
            arena=SharedMemorySegmentPool(segment, SINK_BUFFER + 3))
        self._persistent = persistent
        self._source = self._make() if persistent else None
        self._length = len(batch_sampler(dataset, batch_size))

    def __len__(self):
        return self._length

    def __iter__(self):
        source = self._source if self._persistent else self._make()
        yield from source


def loaders():
    """``(found, missing)``: name -> LoaderSpec, and name -> why not available."""
    try:
        import spdl.pipeline  # noqa: F401
        from spdl.pipeline import SharedMemorySegmentPool, run_pipeline_in_subprocess  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means "not available"
        return {}, {name: f"spdl does not import: {error}" for name in (THREADS, SUBPROCESS)}
    try:
        from importlib.metadata import version
        spdl_version = version("spdl")
    except Exception:  # noqa: BLE001
        spdl_version = "?"
    return {
        THREADS: LoaderSpec(THREADS, SpdlThreadLoader, "threads",
                            f"SPDL {spdl_version} thread pipeline (num_threads = workers)"),
        SUBPROCESS: LoaderSpec(SUBPROCESS, SpdlSubprocessLoader, "processes",
                               f"SPDL {spdl_version} pipeline in a subprocess, "
                               "SharedMemorySegmentPool arena"),
    }, {}
