"""fork_prep.py: what a forked worker would load at every start (numpy.random for
torch's seeding, the source lines torch's lazy CUDA seeding formats) is loaded once
in the main process before the first fork, and the workers still seed NumPy exactly
as torch's do."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import linecache, sys
    import numpy as np
    import torch
    from torch.utils.data import DataLoader as TorchDataLoader
    from fastloader import DataLoader
    from tests.support.datasets import RandomDataset
    from tests.support.helpers import assert_same_batch_lists

    assert "numpy.random" not in sys.modules, "the test needs a process without it"
    def batches(cls):
        torch.manual_seed(0)
        return [b for b in cls(RandomDataset(n=16), batch_size=4, num_workers=2,
                               multiprocessing_context="fork")]
    ours = batches(DataLoader)
    loaded = "numpy.random" in sys.modules
    cached = sys.modules["torch.cuda"].__file__ in linecache.cache
    theirs = batches(TorchDataLoader)
    assert_same_batch_lists(theirs, ours)
    print(loaded, cached)
""")


def test_forked_workers_inherit_what_seeding_loads(subprocess_env):
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=subprocess_env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"], result.stdout
