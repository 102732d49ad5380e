"""A loader's state across epochs, in one owner.

A DataLoader outlives its iterators: ``state_dict()`` and ``stats()`` must answer
after an epoch ended or a loop broke out, and ``load_state_dict()`` leaves a
state for the next ``iter()``. The loader's session holds all of it; the loader
hands it to each iterator it makes, and the iterator reports to it (``ended``).
Iterators never import the loader, and the loader never reads an iterator's
private fields.

Sessions live outside the loader's ``__dict__`` (one map by id, here), so pickling,
copying or deep-copying a loader behaves exactly as with torch: a copy starts
with no session of its own."""
from __future__ import annotations

import weakref
from typing import Any, Optional

__all__ = ["LoaderSession", "session_of"]


class LoaderSession:
    """What one loader keeps between its iterators."""

    __slots__ = ("_iterator", "_current", "_pending_resume", "final_state", "final_stats",
                 "epoch")

    def __init__(self):
        self._iterator: Optional[weakref.ref] = None
        # the token given to the current iterator: ended() takes only its report.
        # (Not the weak reference: the garbage collector clears that before it
        # runs the finalizer of an iterator caught in a cycle, whose report
        # counts. Not its id(): an iterator that failed to start may have the
        # address of the one just freed.)
        self._current: Optional[object] = None
        self._pending_resume: Optional[dict] = None
        self.final_state: Optional[dict] = None   # state_dict() of the last ended iterator
        self.final_stats: Optional[dict] = None   # stats() of the last ended epoch
        # the number of the loader's latest epoch (1 for the first): counted here,
        # not by an iterator, since without persistent workers each epoch has its own
        self.epoch = 0

    # -- iterators ------------------------------------------------------------------
    def started(self, iterator) -> None:
        """`iterator` is the loader's current one (held weakly)."""
        self._iterator = weakref.ref(iterator)
        self._current = iterator._session_token = object()

    def live_iterator(self) -> Any:
        return self._iterator() if self._iterator is not None else None

    def ended(self, iterator, state: dict, stats: Optional[dict] = None) -> None:
        """`iterator`'s epoch ended or it went away: what it leaves for
        ``state_dict()`` and ``stats()``, if it is the current one. An older
        iterator dropped later (kept past the next epoch, or past a
        load_state_dict) leaves nothing: its epoch is not where the loader is."""
        token = getattr(iterator, "_session_token", None)
        if token is None or token is not self._current:
            return
        self.final_state = state
        if stats is not None:
            self.final_stats = stats

    def begin_epoch(self) -> int:
        """An iterator starts the loader's next epoch: its number."""
        self.epoch += 1
        return self.epoch

    def start_afresh(self) -> None:
        """A fresh state was loaded: as a loader that never iterated (its live
        iterator, if any, was dropped by the loader)."""
        self._iterator = self._current = None
        self._pending_resume = None
        self.final_state = self.final_stats = None
        self.epoch = 0

    # -- resume ---------------------------------------------------------------------
    def resume_from(self, state: dict) -> None:
        """The next iterator continues from `state` (load_state_dict)."""
        self._pending_resume = state

    def pending_resume(self) -> Optional[dict]:
        """The state the next iterator continues from, if one was loaded."""
        return self._pending_resume

    def take_resume(self) -> Optional[dict]:
        state, self._pending_resume = self._pending_resume, None
        return state


# Keyed by id(), not by the loader: a DataLoader subclass may define __eq__ (and
# so be unhashable, as a dataclass is) or make two loaders equal, and neither may
# change what a loader iterates or whose state it reports. The entry goes when the
# loader does (finalize runs before its id can be reused).
_SESSIONS: "dict[int, LoaderSession]" = {}


def session_of(loader) -> LoaderSession:
    """The session of `loader`, made on first use."""
    key = id(loader)
    session = _SESSIONS.get(key)
    if session is None:
        session = _SESSIONS[key] = LoaderSession()
        weakref.finalize(loader, _SESSIONS.pop, key, None)
    return session
