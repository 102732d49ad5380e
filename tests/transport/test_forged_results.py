"""What the main process does with results it cannot trust: descriptors and fd
messages written by hand into a channel (tests/support/forged_results.py), as a
process that can write the control block or send on the socket could write them.

- A descriptor that fails a check becomes that batch's error, in its turn: raised
  from recv() instead, it was lost, and a caller that went on waited for its seq
  for ever.
- A segment message carrying more than one fd is refused, and no fd of it stays
  open (the extra one used to stay open for good, one per message).
- A string rewritten while it is decoded never comes out as a corrupt str.
"""
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from fastloader import _core
from tests.support.forged_results import SLOT_GRAIN, forged_channel, sealed_segment

BATCH = {"x": list(range(8)), "name": "batch"}


def _overflow(worker, seq, seg, obj):
    """Publish `obj` in an overflow segment of its own, as a worker would."""
    enc = _core.encode(obj)
    size = (len(enc) + 4095) // 4096 * 4096
    fd = sealed_segment(size, enc)
    try:
        worker.send_segment(seg, size, [fd])
    finally:
        os.close(fd)
    worker.push(seq, _core.RES_BATCH, _core.WHERE_OVERFLOW, seg=seg, nbytes=len(enc))


FORGED = {
    "unknown placement": dict(where=9),
    # as a worker sends it: the arena's fd first (it must not be left queued, or
    # every later segment would be paired with the message before its own)
    "slots off the grain, their fd sent": dict(gen=1, slot_size=SLOT_GRAIN + 4096, nslots=2),
    "an arena of no slots": dict(gen=1, slot_size=SLOT_GRAIN, nslots=0),
    "an arena of 2**32 - 1 slots": dict(gen=1, slot_size=SLOT_GRAIN, nslots=2**32 - 1),
    "slots off the grain": dict(gen=1, slot_size=SLOT_GRAIN + 4096, nslots=2),
    "an arena of 2**63 bytes": dict(gen=1, slot_size=2**62, nslots=2),
    "a slot past the arena": dict(gen=1, slot_size=SLOT_GRAIN, nslots=2, slot=2),
}


@pytest.mark.parametrize("case", FORGED)
def test_a_descriptor_that_fails_its_checks_becomes_that_batchs_error(case):
    fields = dict(where=_core.WHERE_SLOT, seg=1, nbytes=64)
    fields.update(FORGED[case])
    with forged_channel("forged") as worker:
        if case in ("a slot past the arena", "slots off the grain, their fd sent"):
            size = fields["slot_size"] * fields["nslots"]
            fd = sealed_segment(size)
            worker.send_segment(1, size, [fd])
            os.close(fd)
        worker.push(7, _core.RES_BATCH, **fields)
        wid, seq, kind, payload, _ = worker.recv()
        assert (wid, seq, kind) == (0, 7, _core.RES_ERROR)
        assert isinstance(payload, RuntimeError), payload
        assert "failed validation" in str(payload)
        # the channel goes on
        for seq, seg in ((8, 2), (9, 3)):
            _overflow(worker, seq, seg, BATCH)
            assert worker.recv()[1:4] == (seq, _core.RES_BATCH, BATCH)


def _open_fds():
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("message", ["two fds", "no bytes"])
def test_a_segment_message_not_as_workers_send_it_is_refused_and_leaves_no_fd_open(message):
    enc = _core.encode(BATCH)
    with forged_channel("twofds") as worker:
        before = _open_fds()
        seg_fd = sealed_segment(4096, enc)
        extra = os.open("/dev/null", os.O_RDONLY)
        if message == "two fds":
            worker.send_segment(3, 4096, [seg_fd, extra])
        else:   # an fd with an empty message (recvmsg returns 0 and installs it)
            socket.send_fds(worker.sock, [b""], [seg_fd])
        os.close(seg_fd)
        os.close(extra)
        worker.push(9, _core.RES_BATCH, _core.WHERE_OVERFLOW, seg=3, nbytes=len(enc))
        wid, seq, kind, payload, _ = worker.recv()
        leaked = _open_fds() - before
        assert not leaked, f"fds left open by the refused message: {leaked}"
        assert (seq, kind) == (9, _core.RES_ERROR), (seq, kind, payload)
        assert isinstance(payload, OSError), payload
        # the channel goes on
        _overflow(worker, 10, 4, BATCH)
        assert worker.recv()[1:4] == (10, _core.RES_BATCH, BATCH)


# The main process decodes the string of a slot in place; a process that can write
# the slot rewrites its bytes between "A" and 0xC3 meanwhile. CPython's decoder
# reads its input twice where it is not 8-byte aligned (an ASCII check, then a
# copy), so a str marked ASCII came out holding 0xC3 bytes; using it (max(s))
# indexes past CPython's 128-entry table. Run in a child: that was a segfault.
STR_RACE = r"""
import json, os, subprocess, sys, time
from fastloader import _core
from tests.support.forged_results import SLOT_GRAIN, forged_channel, sealed_segment
n = 1 << 16
enc = _core.encode("A" * n)
start = enc.index(b"A" * 64)
assert start % 8 != 0, start
size = (len(enc) + SLOT_GRAIN - 1) // SLOT_GRAIN * SLOT_GRAIN
flip = '''
import mmap, os, sys, time
fd, size, start, n, parent = map(int, sys.argv[1:6])
m = mmap.mmap(fd, size)
ascii_, other = b"A" * n, bytes([0xC3]) * n
print("ready", flush=True)
deadline = time.monotonic() + 120
while time.monotonic() < deadline and os.getppid() == parent:   # until the reader ends
    for _ in range(64):
        m[start:start + n] = other
        m[start:start + n] = ascii_
'''
with forged_channel("strrace") as worker:
    fd = sealed_segment(size, enc)
    worker.send_segment(1, size, [fd])
    flipper = subprocess.Popen([sys.executable, "-c", flip, str(fd), str(size), str(start),
                                str(n), str(os.getpid())], pass_fds=[fd],
                               stdout=subprocess.PIPE, text=True)
    assert flipper.stdout.readline().strip() == "ready"
    reads = mixed = errors = 0
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        worker.push(1, _core.RES_BATCH, _core.WHERE_SLOT, gen=1, slot=0, seg=1,
                    nbytes=len(enc), slot_size=size, nslots=1)
        _, _, kind, s, _ = worker.recv()
        if kind != _core.RES_BATCH:   # invalid UTF-8 seen: its batch's error
            errors += 1
            continue
        reads += 1
        if s.isascii() and max(s.encode("ascii")) >= 0x80:
            print(json.dumps({"corrupt_at": reads}), flush=True)
            flipper.kill()
            sys.exit(3)
        mixed += not s.isascii()
    flipper.kill()
    flipper.wait()
print(json.dumps({"reads": reads, "mixed": mixed, "errors": errors}))
"""


def test_a_string_rewritten_while_it_is_decoded_never_comes_out_corrupt(subprocess_env):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(STR_RACE)],
                          env=subprocess_env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, (f"a str marked ASCII holds non-ASCII bytes, or the "
                                  f"process died (rc {done.returncode}):\n"
                                  f"{done.stdout[-500:]}{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["reads"] + result["errors"] > 0
    assert result["errors"] > 0 or result["mixed"] > 0, (
        "never saw the writer's bytes: the test proved nothing")


# A worker publishes one result no task asked for, through its own channel, from
# inside the dataset (what memory corruption in a worker, or another process that
# can write the ring, leaves there), then goes on as usual.
_UNASKED = """
    import faulthandler, json, sys
    import psutil, torch
    import fastloader
    from fastloader import _core

    faulthandler.dump_traceback_later(60, exit=True)
    seq, kind, payload = json.loads(sys.argv[1])

    class Unasked(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            if i == 4:   # batch 2, worker 0's
                frame = sys._getframe(1)
                while "chan" not in frame.f_locals:
                    frame = frame.f_back
                frame.f_locals["chan"].publish(kind, seq, payload)
            return torch.tensor([i])

    loader = fastloader.DataLoader(Unasked(), batch_size=2, num_workers=2,
                                   multiprocessing_context="fork")
    out = []
    try:
        for batch in loader:
            out.append(batch.tolist())
    except Exception as e:
        out.append([type(e).__name__, str(e)])
    out.append(len(psutil.Process().children()))
    print(json.dumps(out))
"""


@pytest.mark.parametrize("seq, kind, payload", [
    (10**6, _core.RES_BATCH, [1]),          # a batch never asked for: KeyError
    (3, _core.RES_BATCH, [1]),              # another worker's pending task: a hang
    (2, _core.RES_RESUMED, None),           # a resume's answer mid-epoch: a hang
    (2, _core.RES_ITER_END, None),          # a map-style worker's end: batches lost
    (2, 6, [1]),                            # a kind that does not exist: handed out
    (2, _core.RES_ERROR, [1]),              # an error that is no error: AttributeError
    (2, _core.RES_BATCH_SNAP, [1]),         # a snapshot batch that is not a pair
], ids=["never-sent", "another-workers", "resumed", "iter-end", "kind-6",
        "error-payload", "snap-payload"])
def test_a_result_no_task_asked_for_stops_the_epoch_with_a_clear_error(seq, kind, payload):
    """The main process trusted a result's seq and kind: a KeyError, a wait for ever
    (timeout=0), batches silently dropped, or the payload handed out as a batch.
    Now the epoch stops as for a worker's death: WorkerError naming the worker and
    what it sent, the batches before it delivered, and no worker left running."""
    code = textwrap.dedent(_UNASKED)
    run = subprocess.run([sys.executable, "-c", code, json.dumps([seq, kind, payload])],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    *batches, error, children = json.loads(run.stdout.strip().splitlines()[-1])
    assert batches == [[[0], [1]], [[2], [3]]][:len(batches)], batches
    assert error[0] == "WorkerError", error
    assert "DataLoader worker 0 (pid" in error[1] and f"kind {kind}, batch {seq}" in error[1]
    assert children == 0
