"""Module state that belongs to the process that made it: a forked child gets its
own, made the first time the child asks for it.

Why not an at-fork hook that replaces the state in each child, as this package
used to: every hook runs in every child of every fork the process makes (each of
our forked workers, and every fork the user's code or another library makes once
fastloader is imported), and the pages a hook writes are copy-on-write faults
there. Measured in a forked child of a process that imported torch (2-core VM):
the hooks this replaced wrote ~100 pages, ~0.5 ms, on the path of every
non-persistent worker's start in every epoch. Made on first use instead, the
state costs a child that never touches it (a worker, nearly always) nothing.

The one hook left counts forks: a value is kept per fork generation, and a
process's generation differs from that of every process whose memory it
inherited (its parent's is one less), so a child never mistakes its parent's
value for its own. (A pid would not do: a descendant can be given the pid of a
dead ancestor.)"""
from __future__ import annotations

import os
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

_generation = 0   # forks between this process and the one that imported this module


def _count_fork() -> None:
    global _generation
    _generation += 1


os.register_at_fork(after_in_child=_count_fork)

_MISSING = object()


class PerProcess(Generic[T]):
    """`factory()`'s value, made once per process: `get()` in a forked child makes
    the child's own instead of returning its parent's."""

    __slots__ = ("_factory", "_values")

    def __init__(self, factory: Callable[[], T]):
        self._factory = factory
        # generation -> value. A child's copy also holds its ancestors' values,
        # under their generations: left alone, they cost it nothing (dropping them
        # would write to their pages) and are never its own.
        self._values: dict = {_generation: factory()}

    def get(self) -> T:
        values = self._values
        value = values.get(_generation, _MISSING)
        if value is _MISSING:
            # setdefault: threads that miss together all get the one value kept
            value = values.setdefault(_generation, self._factory())
        return value
