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


TWO_THREADS = textwrap.dedent("""
    import os, sys, threading, time
    import torch
    from fastloader import DataLoader

    assert "numpy.random" not in sys.modules, "the test needs a process without it"

    class SlowNumpyRandom:
        # the first thread's import of numpy.random takes a second, holding its
        # module lock, while the second thread starts its workers
        def find_spec(self, name, path, target=None):
            if name == "numpy.random":
                time.sleep(1.0)
            return None

    sys.meta_path.insert(0, SlowNumpyRandom())
    loaders = [DataLoader(list(range(8)), batch_size=4, num_workers=2,
                          multiprocessing_context="fork") for _ in range(2)]
    got = {}

    def run(k):
        if k:
            time.sleep(0.3)
        got[k] = [b.tolist() for b in loaders[k]]

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    print(sorted(got.items()), flush=True)
    os._exit(0)
""")


def test_loaders_started_in_two_threads_while_numpy_random_loads_do_not_hang(subprocess_env):
    """Two threads start fork workers at once; the first is still importing
    numpy.random (for the workers' seeding) when the second forks. The second's
    workers used to inherit that import's lock held, and hang for ever in their
    own import of it."""
    result = subprocess.run([sys.executable, "-c", TWO_THREADS], env=subprocess_env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[(0, [[0, 1, 2, 3], [4, 5, 6, 7]]), (1, [[0, 1, 2, 3], [4, 5, 6, 7]])]", \
        (result.stdout, result.stderr[-2000:])
