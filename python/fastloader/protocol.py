"""The worker protocol, as Python sees it: every task, result and placement kind
that crosses a channel, and the typed control messages of this layer.

The numbers mirror the C core's header (csrc/protocol.h; csrc/ring.h before it)
and must never change independently: tests/transport/test_protocol.py compares them with
the header and with the values the built module exports.

    main --task--> worker:   (kind, seq, payload)
    worker --result--> main: (kind, seq, payload, where)
"""
from __future__ import annotations

import pickle
from typing import Any, NamedTuple, Union

# ---- tasks: main -> worker (the task ring) ---------------------------------------------
TASK_PAD = 0        # filler up to the end of the byte ring (never seen by Python)
TASK_INDICES = 1    # payload: a list of int indices (a map-style batch)
TASK_INDEX = 2      # payload: one int index (batch_size=None)
TASK_NONES = 3      # payload: [None] * n (an IterableDataset's batch)
TASK_PICKLE = 4     # payload: pickle of any other index object
TASK_RESUME = 5     # persistent workers: start a new epoch (payload: pickled shared seed)
TASK_SHUTDOWN = 6   # exit the loop
TASK_CONTROL = 7    # payload: a pickled control message (below)

# ---- results: worker -> main (the result ring) -----------------------------------------
RES_DEAD = 0        # made by the main process's watcher: the worker died
RES_BATCH = 1       # payload: the batch
RES_ERROR = 2       # payload: an ExceptionWrapper (recv(): or the exception rebuilding it raised)
RES_ITER_END = 3    # the worker's IterableDataset replica is exhausted
RES_RESUMED = 4     # acknowledges TASK_RESUME, with the worker's snapshot (resume.py)
RES_BATCH_SNAP = 5  # payload: (batch, worker snapshot) for resuming

# ---- where a result's payload travelled (stats) ----------------------------------------
WHERE_NONE = 0      # no payload bytes (a control result)
WHERE_SLOT = 1      # a slot of the worker's ring arena
WHERE_OVERFLOW = 2  # an overflow segment (no free slot, or a batch larger than one)

TASKS = {name: value for name, value in globals().items() if name.startswith("TASK_")}
RESULTS = {name: value for name, value in globals().items() if name.startswith("RES_")}
WHERES = {name: value for name, value in globals().items() if name.startswith("WHERE_")}


# ---- control messages (TASK_CONTROL), this layer's own ---------------------------------
class Restore(NamedTuple):
    """Restore a worker's RNGs (and an iterable's position) from a snapshot taken
    by resume.take_snapshot (or made by resume.seeded_snapshot); its task count
    restarts from the snapshot's."""
    snapshot: dict


class Replay(NamedTuple):
    """Re-run the task for `index` for its effect on RNGs and iterator position;
    its batch is dropped (resume.py)."""
    index: Any


Control = Union[Restore, Replay]


def encode_control(message: Control) -> bytes:
    if not isinstance(message, (Restore, Replay)):
        raise TypeError(f"not a control message: {type(message).__name__}")
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode_control(payload: bytes) -> Control:
    message = pickle.loads(payload)
    if not isinstance(message, (Restore, Replay)):
        raise TypeError(f"not a control message: {type(message).__name__}")
    return message
