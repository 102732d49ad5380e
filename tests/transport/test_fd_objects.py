"""Objects that hold a file descriptor (a socket, a multiprocessing Connection)
in a batch arrive as torch's queue delivers them: each with its own duplicate of
the worker's fd, usable in the main process. Plain pickle refused a socket, and
rebuilt a Connection around the worker's fd *number*, which in the main process
names another file: reading it read that file, and its __del__ closed it."""
import gc
import os

import pytest

from fastloader import DataLoader
from tests.support import datasets as ds
from tests.support.helpers import deadline


@pytest.mark.parametrize("what", [("socket",), ("connection",), ("socket", "connection")])
@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_sockets_and_connections_in_a_batch_work_in_the_main_process(what, ctx):
    sentinel_r, sentinel_w = os.pipe()   # a file of the main process's own
    try:
        loader = DataLoader(ds.FdObjectsDataset(n=6, what=what), batch_size=2, num_workers=2,
                            collate_fn=ds.list_collate, multiprocessing_context=ctx,
                            timeout=60)
        seen = []
        with deadline(120):
            for batch in loader:
                for sample in batch:
                    i, objs = sample[0], list(sample[1:])
                    if "socket" in what:
                        sock = objs.pop(0)
                        assert sock.recv(16) == b"sock %d" % i
                        assert sock.fileno() not in (sentinel_r, sentinel_w)
                        sock.close()
                    if "connection" in what:
                        conn = objs.pop(0)
                        assert conn.recv() == i
                        assert conn.fileno() not in (sentinel_r, sentinel_w)
                        del conn
                    seen.append(i)
            del batch, sample
            gc.collect()
        assert sorted(seen) == list(range(6))
        # nothing of the batches closed or read the main process's own files
        os.write(sentinel_w, b"!")
        assert os.read(sentinel_r, 1) == b"!"
    finally:
        os.close(sentinel_r)
        os.close(sentinel_w)
