"""num_workers=0: torch's own single-process iterator, plus the little it needs
for state_dict()/load_state_dict(): where the sampler started, how many
batches were yielded and, for an IterableDataset, where the dataset stands
(its own state_dict(), or else a resume replays the batches yielded).
(Randomness inside __getitem__ runs in the main process there, on the user's
own RNGs; a resume re-seeds nothing of it.)"""
from __future__ import annotations

from torch.utils.data import IterableDataset
from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter

from . import resume as _resume
from . import sampler_generators
from .session import LoaderSession


class SingleProcessIter(_SingleProcessDataLoaderIter):
    _epoch = 0
    # batches drawn from the sampler this epoch, i.e. the number of the next one:
    # a batch whose fetch raised (and the user caught) counts, as it does for the
    # workers' iterator; torch's count of batches yielded does not
    _draws = 0
    # a stateful iterable's position loaded for a resume, until its first batch
    # runs its __iter__'s body (until then the dataset may not tell it)
    _loaded_position = None
    # the global RNG where the epoch's sampler started, while the loader has a
    # generator: _global_start until its first draw, then (kept) if the sampler
    # drew from it (sampler_generators.py)
    _global_start = None
    _global_sampler_rng = None
    # (index,): the epoch's first batch of indices, drawn in iter() (see _prime)
    _primed = None

    def __init__(self, loader, session=None):
        # the loader's state across epochs (session.py); a detached one otherwise
        self._session = session if session is not None else LoaderSession()
        self._resume_state = self._session.take_resume()
        # put in place once the resumed epoch's skipped indices are drawn
        self._global_rng_kept = _resume.GlobalRngAfterResume(loader.generator,
                                                             self._resume_state)
        self._loader_generator = loader.generator
        self._before_base_seed = _resume.rng_before_base_seed(loader.generator,
                                                              self._resume_state)
        self._epoch_done = False
        self._ahead = set()
        # before torch's fetcher calls iter(dataset): a stateful iterable goes back
        # where it was (an iterator built before would not see it)
        self._replay = self._put_iterable_back(loader.dataset, self._resume_state)
        super().__init__(loader)
        # the profiler event torch's iterator records (named after its class)
        self._profile_name = (f"enumerate(DataLoader)#"
                              f"{_SingleProcessDataLoaderIter.__name__}.__next__")
        self._start_epoch()

    def _put_iterable_back(self, dataset, state) -> bool:
        """Whether the batches drawn before `state` must be replayed (fetched and
        dropped): an IterableDataset's stream moves on only by being read, so
        skipping its indices skips nothing. One whose position was saved
        (resume.dataset_position) is loaded instead."""
        if (not isinstance(dataset, IterableDataset) or state is None
                or state.get("epoch_done") or not _resume.next_seq(state)):
            return False
        if "dataset" in state:
            # a copy: a dataset may keep what it is given and move it on, which
            # must not change the user's state (workers get theirs through a pipe)
            dataset.load_state_dict(_resume.copy_state(state["dataset"]))
            self._loaded_position = state["dataset"]
            return False
        return True

    def _reset(self, loader, first_iter=False):
        super()._reset(loader, first_iter)
        if not first_iter:
            self._start_epoch()

    def _start_epoch(self):
        self._epoch = self._session.begin_epoch()
        self._epoch_done = False
        self._draws = 0
        self._primed = None
        state, self._resume_state = self._resume_state, None
        if state is not None and state.get("epoch_done"):
            # the one after the saved run's
            self._epoch = self._session.epoch = state["epoch"] + 1
        before, self._before_base_seed = self._before_base_seed, None
        if state is not None and before is not None:
            # the saving run's persistent workers drew no seed for this epoch, and
            # torch's iterator here did: undo it (only it), for that run's order
            _resume.restore_rng(self._loader_generator, before)
        if state is not None and not state.get("epoch_done"):
            self._epoch = self._session.epoch = state["epoch"]
            # without a generator and nothing drawn yet in the saved epoch, its
            # sampler draws its seed at the first batch, from the global RNG as the
            # saved run had it then (set below), not as the epoch found it; unless
            # the saved run had workers, whose sampler draws at iter()
            drawn = _resume.sampler_had_drawn(state)
            if drawn or self._loader_generator is not None:
                _resume.restore_rng(self._loader_generator, state["sampler_rng"])
            sampler_generators.restore_global(self._loader_generator, state)
            self._global_start = None
            self._global_sampler_rng = state.get("global_rng")
            self._sampler_gens = state.get("sampler_generators", [])
            sampler_generators.restore(self._index_sampler, self._loader_generator,
                                       self._sampler_gens)
            self._sampler_rng = state["sampler_rng"]
            # skip the batches before the next one due without fetching them (an
            # iterable's are replayed, see _put_iterable_back), and (from a loader
            # with in_order=False and workers) those it had yielded past it
            replay, self._replay = self._replay, False
            for _ in range(_resume.next_seq(state)):
                try:
                    index = self._next_index()
                except StopIteration:
                    break
                if replay:
                    try:
                        self._dataset_fetcher.fetch(index)
                    except Exception:   # it was the user's to catch in the saved run
                        pass
            if drawn and not self._draws:
                self._prime()
            self._global_rng_kept.apply()   # the skipped indices are drawn
            self._ahead = set(state.get("delivered_ahead", ()))
            if self._ahead:
                self._next_index = self._next_index_skipping
            self._num_yielded = state["yielded"]
        else:
            self._capture_sampler_start()

    def _prime(self):
        """Resumed from a state whose sampler had drawn its first batch in iter()
        (the saved run had workers) and nothing yielded: draw it now too, from
        the RNGs as that run's sampler found them, before the global RNG is put
        where that run had it when saved (so that a draw the loop makes before
        the first next() comes from there, as it did in that run)."""
        try:
            self._primed = (self._first_draw(),)
        except StopIteration:   # an empty epoch: the first next() ends it
            pass

    def _capture_sampler_start(self):
        """The RNGs the sampler draws from (the loader's generator or the global
        RNG, and its own generators), where its epoch starts, for state_dict()."""
        self._sampler_rng = _resume.capture_rng(self._loader_generator)
        self._sampler_gens = sampler_generators.capture(self._index_sampler,
                                                        self._loader_generator)
        self._global_start = sampler_generators.global_rng_start(self._loader_generator)
        self._global_sampler_rng = None

    def _first_draw(self):
        # where the sampler starts drawing: a generator-less one draws its seed
        # from the global RNG now, not at iter() (the loop may draw between)
        self._capture_sampler_start()
        try:
            return super()._next_index()
        finally:
            start, self._global_start = self._global_start, None
            self._global_sampler_rng = sampler_generators.global_rng_drawn(
                start, self._index_sampler)

    def _next_index(self):
        if self._primed is not None:
            (index,), self._primed = self._primed, None
        elif not self._draws:
            index = self._first_draw()
        else:
            index = super()._next_index()
        self._draws += 1
        return index

    def _next_index_skipping(self):
        while True:
            seq = self._draws
            index = SingleProcessIter._next_index(self)
            if seq not in self._ahead:
                return index
            self._ahead.discard(seq)
            if not self._ahead:   # all skipped: back to the plain method
                del self.__dict__["_next_index"]

    def _next_data(self):
        try:
            data = super()._next_data()
        except StopIteration:
            self._epoch_done = True
            self._leave_state_with_loader()
            raise
        finally:
            if self._draws:   # its __iter__'s body has run: the dataset knows
                self._loaded_position = None
        return data

    def _leave_state_with_loader(self):
        self._session.ended(self, self.state_dict())

    def __del__(self):
        try:
            self._leave_state_with_loader()
        except Exception:
            pass

    def state_dict(self):
        state = {"version": _resume.VERSION, "epoch": self._epoch,
                 "epoch_done": self._epoch_done,
                 # the sampler is not asked for its end here (see resume.as_epoch_end)
                 "yielded_all": _resume.yielded_every_batch(
                     self._dataset_kind, self._index_sampler, self._draws, self._ahead),
                 "base_seed": self._base_seed,
                 "sampler_rng": self._sampler_rng, "sampler_generators": self._sampler_gens,
                 # before the first draw, whether the sampler is one that will (a
                 # flag then: a resume draws from global_rng_now, see the iterators)
                 "global_rng": (self._global_sampler_rng if self._global_start is None
                                else sampler_generators.global_rng_drawn(
                                    self._global_start, self._index_sampler, drawn=False)),
                 "sampler_drawn": bool(self._draws) or self._primed is not None,
                 "yielded": self._num_yielded,
                 "next_seq": self._draws, "workers": []}
        if self._ahead:   # still skipping batches delivered ahead
            state["delivered_ahead"] = sorted(self._ahead)
        if (self._dataset_kind == _DatasetKind.Iterable and not self._epoch_done
                and self._draws):
            if self._loaded_position is not None:   # resumed, and nothing read since
                state["dataset"] = _resume.copy_state(self._loaded_position)
            else:
                # read once the epoch's first batch ran its __iter__'s body (before,
                # a dataset may still tell where its last epoch ended)
                state.update(_resume.dataset_position(self._dataset))
        return state
