"""Measure, in a fresh interpreter, what one forked worker copies of a dataset's
metadata over a full epoch: `python -m tests.support.cow_epoch N_ROWS` prints JSON.

It runs apart from the test session on purpose: anything the main process writes
to the heap it shares with a worker (a full garbage collection walking a large
heap, objects freed by earlier tests) becomes that worker's private copy too, so
inside a long session the figure also measured the session (15 MiB more in CI).
The same holds for this process's own writes during the epoch: see
helpers.release_free_heap_pages, called before each fork."""
import gc
import json
import sys
import warnings

import numpy as np
import pandas as pd
import psutil

import fastloader
from fastloader import DataLoader
from fastloader.metadata_warning import HeavyMetadataWarning, find_heavy_metadata
from tests.support import dropin_datasets as dd
from tests.support.helpers import release_free_heap_pages


def _uss(pid):
    return psutil.Process(pid).memory_full_info().uss


def epoch_growth(dataset):
    """USS growth of one forked worker from its first batch to the end of a full
    shuffled epoch (a persistent worker stays alive to be measured), and the sum
    of what the epoch read."""
    release_free_heap_pages()
    loader = DataLoader(dataset, batch_size=4096, shuffle=True, num_workers=1,
                        multiprocessing_context="fork", persistent_workers=True,
                        collate_fn=dd.sum_collate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeavyMetadataWarning)
        it = iter(loader)
        total = int(next(it))
        (pid,) = it.worker_pids
        # The worker (already forked) still collects; this process does not, so
        # its collector's writes are not counted as the worker's copy.
        gc.disable()
        try:
            start = _uss(pid)
            for batch in it:
                total += int(batch)
            end = _uss(pid)
        finally:
            gc.enable()
    it._shutdown_workers()
    return end - start, total


def main(rows):
    paths = [f"images/train/{i:07d}.jpg" for i in range(rows)]
    frame = pd.DataFrame({"path": pd.Series(paths, dtype=object),
                          "label": np.arange(rows) % 1000})
    del paths
    (finding,) = find_heavy_metadata(dd.PathsFrame(frame))
    objects, objects_total = epoch_growth(dd.PathsFrame(frame))
    packed, packed_total = epoch_growth(
        dd.PackedPaths(fastloader.PackedStringArray(frame["path"])))
    return {"estimate": finding.nbytes, "expected_total": int(frame["path"].str.len().sum()),
            "objects": objects, "objects_total": objects_total,
            "packed": packed, "packed_total": packed_total}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
