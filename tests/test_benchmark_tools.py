"""The benchmark's own tools, where their failure would cost a whole `make bench`."""
import time

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
    started = time.monotonic()
    sampler.close()
    assert sampler.process.returncode == 0
    assert time.monotonic() - started < 5
    assert sum(1 for _ in loader) == 8   # the loader is untouched
