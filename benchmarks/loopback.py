"""Both ends of a channel in one process: drives every C path (tasks, slots,
arena growth, overflow, frees, fd passing) without starting a worker, so that
valgrind and the sanitizers can watch all of it in a single process."""
import gc

import numpy as np
import torch

import fastloader  # noqa: F401  (registers the codec hooks)
from fastloader import _core


def make_pair(strategy=_core.STRATEGY_FD, nslots=3, prefix="fastloader-loopback"):
    main = _core.MainChannel(0, strategy, f"{prefix}-{strategy}", 1 << 16, 16)
    h = main.handle()
    worker = _core.WorkerChannel(h, h["ctl_fd"], h["efd_main"], h["efd_worker"],
                                 h["sock"], nslots)
    return main, worker


def exchange(main, worker, seq, index, payload):
    assert main.put_index(seq, index)
    kind, got_seq, got_index = worker.get_task()
    assert (kind, got_seq, got_index) == (_core.TASK_INDICES, seq, index)
    worker.publish(_core.RES_BATCH, seq, payload)
    return _core.recv((main,), 0, 5.0)


def run(rounds=50):
    for strategy in (_core.STRATEGY_FD, _core.STRATEGY_FS):
        main, worker = make_pair(strategy)
        held = []
        for i in range(rounds):
            size = 16 if i < rounds // 2 else 5000   # the second half grows the arena
            z = torch.arange(6).reshape(2, 3) + i
            # in the bigger batches the small pieces (y, z and its transposed view)
            # are copied out of the slot as they arrive (codec.c, copied_out)
            payload = {"x": torch.full((size,), float(i)), "y": np.arange(3) + i,
                       "z": z, "zt": z.t(), "s": f"batch {i}", "o": [None, 1.5]}
            wid, seq, kind, batch, where = exchange(main, worker, i, [i, i + 1], payload)
            assert (wid, seq, kind) == (0, i, _core.RES_BATCH)
            assert torch.equal(batch["x"], payload["x"]) and batch["s"] == payload["s"]
            assert torch.equal(batch["zt"], z.t()) and list(batch["y"]) == list(payload["y"])
            if i % 7 == 0:
                held.append(batch)       # some batches stay alive: overflow later
        assert all(float(b["x"][0]) == float(b["y"][0]) for b in held)
        del held, batch
        gc.collect()
        idle_release(main, worker, rounds)
        main.close()
        del main, worker
        gc.collect()


def idle_release(main, worker, seq):
    """A worker told its epoch is over that waits over 5 s for a task gives its
    free slots' pages back (channel_worker.c, release_idle_slots): wait on a thread
    (get_task releases the GIL) until they are, then send the task."""
    import threading
    import time

    got = []
    assert main.stats()["arena_reserved_bytes"] > 0
    main.between_epochs(True)
    waiter = threading.Thread(target=lambda: got.append(worker.get_task()))
    waiter.start()
    end = time.monotonic() + 60   # valgrind is slow
    while main.stats()["arena_reserved_bytes"] and time.monotonic() < end:
        time.sleep(0.1)
    released = main.stats()["arena_reserved_bytes"]
    main.between_epochs(False)
    assert main.put_index(seq, [0])
    waiter.join(30)
    assert got and got[0][1] == seq, got
    assert released == 0, released


def run_packed(tmpdir):
    """The packed-array C code: build, read, slice, save and load."""
    import os

    from fastloader import PackedArray, PackedStringArray

    names = PackedStringArray(f"img_{i}.jpg" for i in range(2000))
    assert names[-1] == "img_1999.jpg" and names[10:20:3].tolist()[0] == "img_10.jpg"
    records = PackedArray({"id": i, "box": [i, i + 1]} for i in range(500))
    assert records[7] == {"id": 7, "box": [7, 8]}
    # the find behind `in`, index() and count(), both kinds, and a str that
    # cannot be encoded (its error path)
    assert "img_5.jpg" in names and names[::-2].index("img_1.jpg") == 999
    assert names.count("img_7.jpg") == 1 and "\ud800" not in names and 3 not in names
    assert records.index({"id": 9, "box": [9, 10]}, 5) == 9 and records.count(None) == 0
    path = os.path.join(tmpdir, "names.fpk")
    names.save(path)
    again = PackedStringArray.load(path)
    assert again == names
    del again, names, records


if __name__ == "__main__":
    import tempfile

    run()
    with tempfile.TemporaryDirectory() as tmp:
        run_packed(tmp)
    print("loopback ok")
