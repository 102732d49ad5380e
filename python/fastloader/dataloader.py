"""fastloader.DataLoader: torch's DataLoader with fastloader's worker transport."""
from __future__ import annotations

import inspect
import os
import warnings
from typing import TypeVar

from torch.utils.data import DataLoader as _TorchDataLoader

from . import forkserver, spawn_server
from . import resume as _resume
from . import sampler_generators
from . import torch_sites
from .install import (FastLoaderWarning, read_by_accelerate_skip_first_batches,
                      warn_if_rebuilt_by_accelerate)
from .iterator import FastMultiProcessingIter
from .session import session_of
from .sharing import DEFAULT_STRATEGY as _DEFAULT_STRATEGY
from .sharing import check_strategy as _check_strategy
from .single import SingleProcessIter

# torch's DataLoader is Generic[T_co]; re-parameterising keeps `DataLoader[Batch]`
# valid in annotations after the import swap (a plain subclass is not generic).
T_co = TypeVar("T_co", covariant=True)


class DataLoader(_TorchDataLoader[T_co]):
    """Drop-in replacement for :class:`torch.utils.data.DataLoader`.

    Takes every argument torch's DataLoader takes, in the same order, plus
    ``sharing_strategy`` (keyword only): ``"file_descriptor"`` (default; anonymous
    memfd segments passed by fd, nothing in /dev/shm) or ``"file_system"`` (named
    segments in /dev/shm, mode 0600, unlinked as soon as both sides mapped them).
    It only concerns fastloader's own segments and never changes torch's global
    sharing strategy. With ``num_workers=0`` it is torch's DataLoader exactly.

    ``state_dict()`` / ``load_state_dict()`` save and restore where an epoch
    stands, so a restarted job yields exactly the batches the interrupted one
    would have (see resume.py). ``snapshot_every_n_steps`` (keyword only,
    default 0): workers also snapshot their RNGs every n batches, so a resume
    replays at most n batches per worker instead of everything since the epoch
    began.
    """

    def __init__(self, *args, sharing_strategy: str = _DEFAULT_STRATEGY,
                 snapshot_every_n_steps: int = 0, **kwargs):
        _check_strategy(sharing_strategy)
        if not isinstance(snapshot_every_n_steps, int) or snapshot_every_n_steps < 0:
            raise ValueError("snapshot_every_n_steps should be a non-negative integer, "
                             f"but got {snapshot_every_n_steps!r}")
        super().__init__(*args, **kwargs)
        self.sharing_strategy = sharing_strategy
        self.snapshot_every_n_steps = snapshot_every_n_steps
        # under 'forkserver' (or 'spawn' with FASTLOADER_SPAWN_SERVER=1), start a
        # server now, with torch preloaded
        forkserver.warm_up(self.multiprocessing_context, self.num_workers)
        spawn_server.warm_up(self.multiprocessing_context, self.num_workers)

    def __setattr__(self, attr, val):
        if attr == "sharing_strategy":
            _check_strategy(val)
        super().__setattr__(attr, val)

    # accelerate's prepare() reads this flag on every loader it is given, then
    # rebuilds the loader as its own torch DataLoader: the one moment at which the
    # loss of fastloader's transport can be reported (install.py).
    @property
    def _is_accelerate_prepared(self):
        prepared = self.__dict__.get("_fastloader_accelerate_prepared", False)
        if not prepared:
            warn_if_rebuilt_by_accelerate(self)
        return prepared

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value):
        self.__dict__["_fastloader_accelerate_prepared"] = value

    # accelerate's skip_first_batches() (the HF Trainer's on resuming) copies the
    # arguments of a loader that was not prepared into a new torch DataLoader; this
    # is the first of them it reads that torch makes a property
    @_TorchDataLoader.multiprocessing_context.getter
    def multiprocessing_context(self):
        if read_by_accelerate_skip_first_batches():
            warn_if_rebuilt_by_accelerate(self, by="skip_first_batches()",
                                          as_what="a torch DataLoader")
        return _TorchDataLoader.multiprocessing_context.fget(self)

    def __iter__(self):
        it = self.__dict__.get("_iterator")
        pool = getattr(it, "_pool", None)
        if it is not None and (getattr(it, "_shutdown", False) or (
                pool is not None and pool.owner_pid != os.getpid())):
            # persistent workers stopped by an error or Ctrl-C (or by a framework's
            # _shutdown_workers()): the next epoch starts new ones, where torch's
            # iterator would fail on its dead workers. So does a forked child's
            # epoch: the workers it inherited the iterator of are its parent's.
            object.__setattr__(self, "_iterator", None)
        return super().__iter__()

    def _get_iterator(self):
        session = session_of(self)
        pending = session.pending_resume()
        # where the loaded state put the generators (the attempt draws from them)
        rng = _resume.capture_rng(self.generator) if pending is not None else None
        # and, beside a generator, the global RNG, which a resume sets for a
        # sampler that draws from it all the same (sampler_generators.py)
        global_rng = (_resume.capture_rng(None)
                      if pending is not None and self.generator is not None else None)
        own = (sampler_generators.capture(self._index_sampler, self.generator)
               if pending is not None else None)
        epoch = session.epoch
        try:
            if self.num_workers == 0:
                it = SingleProcessIter(self, session)
            else:
                # from torch's lines, so that their warnings point where torch's do
                torch_sites.check_worker_number(self.check_worker_number_rationality)
                it = torch_sites.new_multiprocessing_iter(FastMultiProcessingIter, self, session)
        except BaseException:
            # the epoch did not start (no fds or processes left, Ctrl-C): a state
            # loaded for it is still the next iter()'s, not lost, and its number
            # is the next epoch's
            session.epoch = epoch
            if pending is not None and session.pending_resume() is None:
                session.resume_from(pending)
                if global_rng is not None:
                    _resume.restore_rng(None, global_rng)
                _resume.restore_rng(self.generator, rng)
                sampler_generators.restore(self._index_sampler, self.generator, own)
            raise
        session.started(it)
        return it

    def _live_iterator(self):
        return session_of(self).live_iterator()

    def state_dict(self) -> dict:
        """Where the current epoch stands: the sampler's starting RNG state, the
        batches already yielded, and each worker's RNG snapshot. Pass it to
        load_state_dict() of a fresh loader built with the same arguments."""
        pending = session_of(self).pending_resume()
        if pending is not None:
            # loaded, not yet iterated: a checkpoint now keeps that position (it
            # used to say "fresh", and a resume from it restarted the epoch)
            return dict(pending, fingerprint=_resume.fingerprint(self))
        it = self._live_iterator()
        if it is not None:
            state = it.state_dict()
        elif session_of(self).final_state is not None:
            state = dict(session_of(self).final_state)
        else:
            state = {"version": _resume.VERSION, "fresh": True}
        state["rng_now"] = _resume.capture_rng(self.generator)
        state["sampler_generators_now"] = sampler_generators.capture(self._index_sampler,
                                                                     self.generator)
        if sampler_generators.draws_from_global(state):
            state["global_rng_now"] = _resume.capture_rng(None)
        # whether this loader's next epoch draws no base seed (see the iterators)
        state["persistent"] = bool(self.persistent_workers and self.num_workers > 0)
        state["fingerprint"] = _resume.fingerprint(self)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter(loader)`` continue from ``state``. Raises
        ValueError if a state saved mid-epoch belongs to a different dataset
        length, batch size, drop_last or world size, or (for an IterableDataset,
        whose replicas are split by worker) number of workers; a state outside an
        epoch loads with any of them. A map-style epoch resumed with another
        number of workers skips the batches already yielded, with fresh worker
        RNGs (FastLoaderWarning). An empty dict, as for torchdata's
        StatefulDataLoader, is nothing to load: only the live iterator (and its
        persistent workers) is dropped, and a state loaded before stays."""
        if isinstance(state, dict) and not state:
            # (`load_state_dict(checkpoint.get("loader", {}))`)
            self._drop_iterator()
            return
        if isinstance(state, dict):
            state = _resume.as_epoch_end(self, state)
        if _resume.validate(self, state) and not state.get("fresh") \
                and not state.get("epoch_done"):
            warnings.warn(
                f"fastloader: this state was saved with num_workers "
                f"{state['fingerprint']['num_workers']} and this loader has "
                f"{self.num_workers}: the epoch resumes after the batches already "
                "yielded, but the workers' random streams start afresh, so random "
                "augmentations differ from an uninterrupted run's", FastLoaderWarning,
                stacklevel=2)
            state = _resume.for_other_worker_count(state, self.num_workers)
        # live persistent workers were seeded for another run (a fresh one's too):
        # start afresh
        self._drop_iterator()
        session = session_of(self)
        if state.get("fresh"):
            # the last state loaded wins; state_dict() and stats() now say what a
            # fresh loader's say, and the next epoch is the first
            session.start_afresh()
            return
        if state.get("epoch_done"):
            # the next epoch starts as it would have: same RNG, same base seed
            _resume.restore_rng(self.generator, state["rng_now"])
            sampler_generators.restore_global(self.generator, state, now=True)
            sampler_generators.restore(self._index_sampler, self.generator,
                                       state.get("sampler_generators_now"))
        session.resume_from(state)

    def _drop_iterator(self):
        if getattr(self, "_iterator", None) is not None:
            self._iterator._shutdown_workers()
            object.__setattr__(self, "_iterator", None)

    def stats(self, memory=True):
        """Statistics of this loader's current (or last) epoch with workers: batches
        delivered, time the main process waited for data and its share of the
        epoch (the data stall), and per worker: batches, busy/idle time, ring
        occupancy, overflow segments, USS/PSS. None before the first epoch, or
        with num_workers=0."""
        it = self._live_iterator()
        if it is None or not hasattr(it, "stats") or it._shutdown:
            return session_of(self).final_stats   # the epoch that ended, as it ended
        return it.stats(memory=memory)


def _signature():
    # Frameworks that rebuild a loader (Lightning, accelerate) read the signature:
    # show torch's parameters plus ours, not *args/**kwargs.
    base = inspect.signature(_TorchDataLoader.__init__)
    params = list(base.parameters.values())
    params.append(inspect.Parameter("sharing_strategy", inspect.Parameter.KEYWORD_ONLY,
                                    default=_DEFAULT_STRATEGY, annotation=str))
    params.append(inspect.Parameter("snapshot_every_n_steps", inspect.Parameter.KEYWORD_ONLY,
                                    default=0, annotation=int))
    return base.replace(parameters=params)


DataLoader.__init__.__signature__ = _signature()
