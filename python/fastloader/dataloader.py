"""fastloader.DataLoader: torch's DataLoader with fastloader's worker transport."""
from __future__ import annotations

import inspect
import weakref

from torch.utils.data import DataLoader as _TorchDataLoader

from .iterator import FastMultiProcessingIter
from .pool import STRATEGIES

_DEFAULT_STRATEGY = "file_descriptor"


def _check_strategy(value):
    if value not in STRATEGIES:
        valid = ", ".join(repr(s) for s in STRATEGIES)
        raise ValueError(f"sharing_strategy should be one of {valid}, but got {value!r}")
    return value


class DataLoader(_TorchDataLoader):
    """Drop-in replacement for :class:`torch.utils.data.DataLoader`.

    Takes every argument torch's DataLoader takes, in the same order, plus
    ``sharing_strategy`` (keyword only): ``"file_descriptor"`` (default; anonymous
    memfd segments passed by fd, nothing in /dev/shm) or ``"file_system"`` (named
    segments in /dev/shm, mode 0600, unlinked as soon as both sides mapped them).
    It only concerns fastloader's own segments and never changes torch's global
    sharing strategy. With ``num_workers=0`` it is torch's DataLoader exactly.
    """

    def __init__(self, *args, sharing_strategy: str = _DEFAULT_STRATEGY, **kwargs):
        _check_strategy(sharing_strategy)
        super().__init__(*args, **kwargs)
        self.sharing_strategy = sharing_strategy

    def __setattr__(self, attr, val):
        if attr == "sharing_strategy":
            _check_strategy(val)
        super().__setattr__(attr, val)

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        self.check_worker_number_rationality()
        it = FastMultiProcessingIter(self)
        # torch's __setattr__ guards some names after init; this one is ours
        object.__setattr__(self, "_fl_last_iterator", weakref.ref(it))
        return it

    def stats(self, memory=True):
        """Statistics of this loader's current (or last) epoch with workers: batches
        delivered, time the main process waited for data and its share of the
        epoch (the data stall), and per worker: batches, busy/idle time, ring
        occupancy, overflow segments, USS/PSS. None before the first epoch, or
        with num_workers=0."""
        ref = self.__dict__.get("_fl_last_iterator")
        it = ref() if ref is not None else None
        return None if it is None else it.stats(memory=memory)


def _signature():
    # Frameworks that rebuild a loader (Lightning, accelerate) read the signature:
    # show torch's parameters plus ours, not *args/**kwargs.
    base = inspect.signature(_TorchDataLoader.__init__)
    params = list(base.parameters.values())
    params.append(inspect.Parameter("sharing_strategy", inspect.Parameter.KEYWORD_ONLY,
                                    default=_DEFAULT_STRATEGY, annotation=str))
    return base.replace(parameters=params)


DataLoader.__init__.__signature__ = _signature()
