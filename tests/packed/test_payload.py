"""Sending the dataset once under spawn/forkserver (payload.py): one pickle for
all workers, the same batches as torch's DataLoader, a per-worker pickle where
one pickle cannot serve every child, and nothing left behind."""
import multiprocessing
import os

import pytest
import torch

from fastloader import DataLoader
from fastloader import payload
from tests.support import payload_datasets as pd

METHODS = ["spawn", "forkserver"]
# three workers on a two-core machine: torch warns, rightly, but on purpose here
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _batches_without_pids(loader):
    return [b[:, :3].clone() for b in loader]


def _reference(dataset):
    return [b[:, :3] for b in torch.utils.data.DataLoader(dataset, batch_size=8)]


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("method", METHODS)
def test_dataset_is_pickled_once_for_all_workers(method):
    dataset = pd.CountedDataset()
    loader = DataLoader(dataset, batch_size=8, num_workers=3, multiprocessing_context=method)
    pd.PICKLES["count"] = 0
    got = [b.clone() for b in loader]
    assert pd.PICKLES["count"] == 1, "the dataset was pickled once per worker"
    _same([b[:, :3] for b in got], _reference(dataset))
    assert len({int(p) for b in got for p in b[:, 3]}) == 3, "all three workers served"


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_tensor_inside_falls_back_to_a_pickle_per_worker(strategy):
    # torch shares a tensor by reference per pickle: one pickle for three
    # children would count too few references
    dataset = pd.CountedDataset(tensor=torch.arange(5))
    loader = DataLoader(dataset, batch_size=8, num_workers=3, multiprocessing_context="spawn",
                        sharing_strategy=strategy)
    pd.PICKLES["count"] = 0
    got = _batches_without_pids(loader)
    assert pd.PICKLES["count"] == 1 + 3, "expected the probe, then one pickle per worker"
    _same(got, _reference(dataset))


def test_pickle_once_refuses_what_only_one_child_could_use():
    reader, writer = multiprocessing.Pipe(duplex=False)
    try:
        assert payload.pickle_once(["x", reader]) is None          # an fd to pass on
        assert payload.pickle_once(["x", torch.zeros(3)]) is None  # torch's shared tensor
        assert payload.pickle_once(["x", lambda: 1]) is None       # does not pickle at all
        blob = payload.pickle_once(["x", b"y" * 10])
        assert blob is not None and payload.ForkingPickler.loads(blob) == ["x", b"y" * 10]
    finally:
        reader.close()
        writer.close()


def _memfd_links(pid):
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return [link for link in links if "fastloader-payload" in link]


@pytest.mark.parametrize("method", METHODS)
def test_the_shared_pickle_is_let_go_everywhere(method):
    # persistent workers outlive the epoch; once both have served a batch, both
    # have unpickled the dataset (a worker does that before its first task)
    loader = DataLoader(pd.CountedDataset(n=64), batch_size=8, num_workers=2,
                        multiprocessing_context=method, persistent_workers=True)
    it = iter(loader)
    served = {int(b[0, 3]) for b in it}
    assert served == set(it._pool.pids), "both workers should have served"
    assert _memfd_links(os.getpid()) == []
    for pid in it._pool.pids:
        assert _memfd_links(pid) == [], "a worker kept the payload's fd"
        with open(f"/proc/{pid}/maps") as f:
            assert "fastloader-payload" not in f.read(), "a worker kept the payload mapped"
    del it


def test_a_worker_that_cannot_unpickle_the_dataset_is_reported():
    loader = DataLoader(pd.UnpicklableInWorker(), batch_size=8, num_workers=2,
                        multiprocessing_context="spawn")
    with pytest.raises(RuntimeError, match=r"DataLoader worker \d+ \(pid \d+\) exited unexpectedly"):
        next(iter(loader))


def test_no_room_for_the_shared_pickle_is_a_memory_error_naming_the_size():
    """memfds live on the kernel's internal tmpfs: a file-size limit (as a memory
    cgroup limit would) makes reserving one fail. That must be a MemoryError at
    creation naming the size, not an OSError half-way through writing."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        "import json, resource\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "from fastloader import payload\n"
        "try:\n"
        "    payload.SharedPickle(b'x' * (4 << 20))\n"
        "except BaseException as exc:\n"
        "    print(json.dumps([type(exc).__name__, str(exc)]))\n"
        "else:\n"
        "    print(json.dumps([None, 'no exception']))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), os.path.join(root, "python"), root) if p]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kind, message = json.loads(proc.stdout.strip().splitlines()[-1])
    assert kind == "MemoryError", (kind, message)
    assert f"creating a {4 << 20}-byte payload segment" in message, message
