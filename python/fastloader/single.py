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
from .session import LoaderSession


class SingleProcessIter(_SingleProcessDataLoaderIter):
    _epoch = 0

    def __init__(self, loader, session=None):
        # the loader's state across epochs (session.py); a detached one otherwise
        self._session = session if session is not None else LoaderSession()
        self._resume_state = self._session.take_resume()
        self._loader_generator = loader.generator
        self._epoch_done = False
        # before torch's fetcher calls iter(dataset): a stateful iterable goes back
        # where it was (an iterator built before would not see it)
        self._replay = self._put_iterable_back(loader.dataset, self._resume_state)
        super().__init__(loader)
        self._start_epoch()

    @staticmethod
    def _put_iterable_back(dataset, state) -> bool:
        """Whether the batches yielded before `state` must be replayed (fetched and
        dropped): an IterableDataset's stream moves on only by being read, so
        skipping its indices skips nothing. One whose position was saved
        (resume.dataset_position) is loaded instead."""
        if (not isinstance(dataset, IterableDataset) or state is None
                or state.get("epoch_done") or not _resume.next_seq(state)):
            return False
        if "dataset" in state:
            dataset.load_state_dict(state["dataset"])
            return False
        return True

    def _reset(self, loader, first_iter=False):
        super()._reset(loader, first_iter)
        if not first_iter:
            self._start_epoch()

    def _start_epoch(self):
        self._epoch += 1
        self._epoch_done = False
        state, self._resume_state = self._resume_state, None
        if state is not None and state.get("epoch_done") and state.get("persistent"):
            # the saving run's persistent workers drew no seed for this epoch, and
            # torch's iterator here did: undo it, for that run's order
            _resume.restore_rng(self._loader_generator, state["rng_now"])
        if state is not None and not state.get("epoch_done"):
            self._epoch = state["epoch"]
            _resume.restore_rng(self._loader_generator, state["sampler_rng"])
            self._sampler_rng = state["sampler_rng"]
            # skip without fetching: the batches before the next one due, and
            # (from a loader with in_order=False and workers) those it had
            # already yielded past it
            replay, self._replay = self._replay, False
            for _ in range(_resume.next_seq(state)):
                try:
                    index = self._next_index()
                    if replay:
                        self._dataset_fetcher.fetch(index)
                except StopIteration:
                    break
                except Exception:   # it was the user's to catch in the saved run
                    pass
            ahead = set(state.get("delivered_ahead", ()))
            if ahead:
                self._skip = (_resume.next_seq(state), ahead)
                self._next_index = self._next_index_skipping
            self._num_yielded = state["yielded"]
        else:
            self._sampler_rng = _resume.capture_rng(self._loader_generator)

    def _next_index_skipping(self):
        seq, ahead = self._skip
        while True:
            index = super()._next_index()
            self._skip = (seq + 1, ahead)
            if seq not in ahead:
                return index
            ahead.discard(seq)
            if not ahead:   # all skipped: back to torch's own method
                del self.__dict__["_next_index"]
                return super()._next_index()
            seq += 1

    def _next_data(self):
        try:
            return super()._next_data()
        except StopIteration:
            self._epoch_done = True
            self._leave_state_with_loader()
            raise

    def _leave_state_with_loader(self):
        self._session.ended(self.state_dict())

    def __del__(self):
        try:
            self._leave_state_with_loader()
        except Exception:
            pass

    def state_dict(self):
        state = {"version": _resume.VERSION, "epoch": self._epoch,
                 "epoch_done": self._epoch_done, "base_seed": self._base_seed,
                 "sampler_rng": self._sampler_rng, "yielded": self._num_yielded,
                 "workers": []}
        if "_next_index" in self.__dict__:   # still skipping batches delivered ahead
            seq, ahead = self._skip
            state.update(next_seq=seq, delivered_ahead=sorted(ahead))
        if (self._dataset_kind == _DatasetKind.Iterable and not self._epoch_done
                and self._num_yielded):
            # read once the epoch's first batch ran its __iter__'s body (before, a
            # dataset may still tell where its last epoch ended)
            state.update(_resume.dataset_position(self._dataset))
        return state
