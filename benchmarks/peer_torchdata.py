"""torchdata 0.11 as a peer: StatefulDataLoader, and torchdata.nodes pipelines.

The nodes pipelines are built as torchdata's migration guide recommends for a
map-style dataset: a batch sampler wrapped as the source node, a ParallelMapper
whose function fetches the batch's samples and collates them (in order, with
``num_workers`` threads or processes), a Prefetcher, and a Loader that makes the
graph re-iterable once per epoch. No PinMemory node: the benchmark has no GPU.

Measured behaviour worth knowing when reading the results: a process
ParallelMapper starts new worker processes every epoch (there is no persistent
option), so "persistent" does not apply to it.
"""

from benchmarks.batch_fetch import FetchAndCollate, batch_sampler
from benchmarks.loader_spec import LoaderSpec

STATEFUL = "torchdata.SDL"
NODES_PROCESSES = "nodes.process"
NODES_THREADS = "nodes.thread"
PREFETCH_FACTOR = 2


class NodesLoader:
    """A torchdata.nodes Loader over sampler -> ParallelMapper -> Prefetcher, with len()."""

    def __init__(self, dataset, *, batch_size, num_workers, collate_fn, persistent, context,
                 method):
        import torchdata.nodes as tn

        del persistent  # not an option of ParallelMapper (see the module docstring)
        self._batches = batch_sampler(dataset, batch_size)
        node = tn.SamplerWrapper(self._batches)
        node = tn.ParallelMapper(node, map_fn=FetchAndCollate(dataset, collate_fn),
                                 num_workers=num_workers, method=method, in_order=True,
                                 multiprocessing_context=context if method == "process" else None)
        node = tn.Prefetcher(node, prefetch_factor=PREFETCH_FACTOR)
        self._loader = tn.Loader(node)

    def __len__(self):
        return len(self._batches)

    def __iter__(self):
        return iter(self._loader)


def _stateful(dataset, *, batch_size, num_workers, collate_fn, persistent, context):
    from torchdata.stateful_dataloader import StatefulDataLoader

    kwargs = dict(batch_size=batch_size, num_workers=num_workers)
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    if num_workers > 0:
        kwargs.update(multiprocessing_context=context, persistent_workers=persistent)
    return StatefulDataLoader(dataset, **kwargs)


def _nodes(method):
    def build(dataset, **kwargs):
        return NodesLoader(dataset, method=method, **kwargs)
    return build


def loaders():
    """``(found, missing)``: name -> LoaderSpec, and name -> why not available."""
    names = (STATEFUL, NODES_PROCESSES, NODES_THREADS)
    try:
        import torchdata
        import torchdata.nodes  # noqa: F401
        import torchdata.stateful_dataloader  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means "not available"
        return {}, {name: f"torchdata does not import: {error}" for name in names}
    version = getattr(torchdata, "__version__", "?")
    return {
        STATEFUL: LoaderSpec(STATEFUL, _stateful, "processes",
                             f"torchdata {version} StatefulDataLoader"),
        NODES_PROCESSES: LoaderSpec(NODES_PROCESSES, _nodes("process"), "processes",
                                    f"torchdata {version} nodes, ParallelMapper(method='process')"),
        NODES_THREADS: LoaderSpec(NODES_THREADS, _nodes("thread"), "threads",
                                  f"torchdata {version} nodes, ParallelMapper(method='thread')"),
    }, {}
