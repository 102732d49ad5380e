"""The first batch's task, sent to worker 0 while the other workers are forked.

Forked workers start one at a time, each fork of a process that has imported torch
taking milliseconds (copying its page tables), and torch's iterator sends the first
tasks only once all of them run. Worker 0 then sits idle for the other forks while
the training loop waits for batch 0. When batch 0's indices can be known without
running the user's code, worker 0 gets that task as soon as it runs, so batch 0
is built while the main process forks the rest.

Only for torch's own unshuffled sampler (index_batches.sequential_batches): its
batches follow from the dataset's length and the batch size alone, and drawing
one touches no RNG and nothing a worker sees. A user's sampler or a shuffling one
is drawn where torch draws it, after every worker started: its draw could change
state that a worker forked after it would inherit (torch's workers never see it).
The batches, their order and the worker of each are unchanged."""
from __future__ import annotations

import itertools
from typing import Iterator, Optional

from .index_batches import sequential_batches


class EarlyFirstTask:
    """Batch 0's range, drawn before the workers start, and whether it reached
    worker 0's ring. `batches()` is then the epoch's sampler iterator: that range
    followed by the rest of the same generator."""

    def __init__(self, first: range, rest: Iterator[range]):
        self.first = first
        self._rest = rest
        self.sent = False

    @classmethod
    def for_epoch(cls, index_sampler, start_method: str, num_workers: int,
                  in_order: bool, map_style: bool) -> Optional["EarlyFirstTask"]:
        """The early task of a first epoch that can take one, else None."""
        # Only forks start one at a time, and with one worker nothing is forked
        # after it; out of order, the first task's worker is chosen at dispatch.
        if start_method != "fork" or num_workers < 2 or not in_order or not map_style:
            return None
        batches = sequential_batches(index_sampler)
        if batches is None:
            return None
        try:
            first = next(batches)
        except Exception:
            # An empty epoch, or a dataset whose len() fails: the iterator's own
            # draw, where torch draws, meets the same end or raises the same error.
            return None
        return cls(first, batches)

    def send(self, worker_id: int, channel) -> None:
        """The pool's after-start hook: batch 0's task (sequence number 0) into
        worker 0's ring the moment worker 0 runs."""
        if worker_id != 0 or self.sent:
            return
        try:
            self.sent = bool(channel.put_index(0, self.first))
        except (MemoryError, ValueError):
            # the ring's pages could not be reserved: the task goes the usual way
            # after the start, where such a failure is the batch's error in its turn
            self.sent = False

    def batches(self) -> Iterator[range]:
        return itertools.chain((self.first,), self._rest)
