"""The benchmark's own tools, where their failure would cost a whole `make bench`."""
import os
import time

import pytest

from benchmarks.pss import PssSampler
from fastloader import DataLoader
from tests.support.datasets import TensorLabelDataset


def test_pss_sampler_closes_while_a_persistent_fork_loader_is_alive():
    """Fork workers inherit the sampler's stdin pipe: closing it alone never reached
    the sampler while they lived (close() waited 10 s, then raised)."""
    sampler = PssSampler(interval_s=0.01)
    loader = DataLoader(TensorLabelDataset(64), batch_size=8, num_workers=2,
                        persistent_workers=True, multiprocessing_context="fork")
    sampler.start()
    assert sum(1 for _ in loader) == 8
    got = sampler.stop()
    assert got["peak_bytes"] >= got["peak_main_bytes"] > 0
    with_shm = got["peak_with_unmapped_shm_bytes"]   # None: no Pss_Shmem in smaps_rollup
    assert with_shm is None or with_shm >= got["peak_bytes"]
    started = time.monotonic()
    sampler.close()
    assert sampler.process.returncode == 0
    assert time.monotonic() - started < 5
    assert sum(1 for _ in loader) == 8   # the loader is untouched


def test_pss_sampler_counts_shared_memory_that_no_process_maps():
    """A batch passed as a segment (torch's transport) is memory while its fd is in
    flight, though no process maps it then and PSS cannot see it: the sampler's
    second peak adds it."""
    size = 64 << 20
    chunk = b"\1" * (1 << 20)
    sampler = PssSampler(interval_s=0.01)
    try:
        sampler.start()
        fd = os.memfd_create("fastloader-test-unmapped")
        try:
            for _ in range(size // len(chunk)):
                os.write(fd, chunk)   # written through the fd: never mapped
            time.sleep(0.3)
            got = sampler.stop()
        finally:
            os.close(fd)
    finally:
        sampler.close()
    if got["peak_with_unmapped_shm_bytes"] is None:
        pytest.skip("this kernel's smaps_rollup has no Pss_Shmem")
    assert got["peak_with_unmapped_shm_bytes"] >= got["peak_bytes"] + size * 3 // 4
