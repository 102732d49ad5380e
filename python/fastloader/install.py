"""Give every torch DataLoader in this process fastloader's worker transport.

Frameworks build their own loaders: HF accelerate's ``Accelerator.prepare()``
rebuilds each loader from torch's argument list inside its ``DataLoaderShard``,
and transformers' ``Trainer`` builds ``torch.utils.data.DataLoader`` itself. A
``fastloader.DataLoader`` handed to them is replaced, and loaders they build are
torch's. ``install()`` routes the multi-process iterator of every
``torch.utils.data.DataLoader`` (and of every subclass that keeps torch's
``_get_iterator``) to fastloader's: the loader object stays torch's, with every
attribute and method; only the workers and the way batches travel change.
``num_workers=0`` stays torch's own single-process path.

Opt-in, from the training script (every rank of ``torchrun`` / ``accelerate
launch`` runs it)::

    import fastloader
    fastloader.install()            # before the loaders are iterated

or, without editing the script, ``python -m fastloader.launch train.py ARGS``
(also ``torchrun ... -m fastloader.launch train.py`` and ``accelerate launch -m
fastloader.launch train.py``; see launch.py), or ``FASTLOADER_INSTALL=1`` in the
environment of a program that imports fastloader (frameworks import torch, not
fastloader: the variable alone does nothing there; a ``sitecustomize.py`` with
``import fastloader`` makes it apply to every interpreter).

Limits: a subclass that overrides ``_get_iterator`` with its own iterator
(torchdata's ``StatefulDataLoader``) keeps it; loaders that torch builds get
``install()``'s ``sharing_strategy`` (default "file_descriptor"), not one given
to a ``fastloader.DataLoader`` that a framework rebuilt.
"""
from __future__ import annotations

import os
import sys
import threading
import warnings

from torch.utils.data import DataLoader as _TorchDataLoader

from . import torch_sites
from .iterator import FastMultiProcessingIter
from .session import session_of
from .sharing import DEFAULT_STRATEGY, STRATEGIES, check_strategy
from .warn_site import stacklevel_outside

__all__ = ["install", "uninstall", "installed", "FastLoaderWarning", "ENV_VAR"]

ENV_VAR = "FASTLOADER_INSTALL"

_lock = threading.Lock()
_original = None            # torch's DataLoader._get_iterator while installed
# what a call that raced with uninstall() falls back to
_TORCH_GET_ITERATOR = _TorchDataLoader.__dict__["_get_iterator"]
_strategy = DEFAULT_STRATEGY


class FastLoaderWarning(UserWarning):
    """fastloader's transport is not in use where the user expects it."""


def _fast_get_iterator(self):
    """torch's _get_iterator with the multi-process branch routed to fastloader."""
    if self.num_workers == 0:
        return (_original or _TORCH_GET_ITERATOR)(self)
    # from torch's lines, so that their warnings point where torch's do
    torch_sites.check_worker_number(self.check_worker_number_rationality)
    # the loader's session (session.py) numbers its epochs across its iterators
    session = session_of(self)
    it = torch_sites.new_multiprocessing_iter(FastMultiProcessingIter, self,
                                              session=session, strategy=_strategy)
    session.started(it)
    return it


def install(sharing_strategy: str = "file_descriptor") -> None:
    """Make every ``torch.utils.data.DataLoader`` with ``num_workers > 0`` use
    fastloader's workers, from its next ``iter()`` on. Idempotent (a second call
    only changes the strategy); undone by ``uninstall()``. ``sharing_strategy``
    applies to loaders that are not ``fastloader.DataLoader`` (those keep their
    own)."""
    global _original, _strategy
    check_strategy(sharing_strategy)
    with _lock:
        _strategy = sharing_strategy
        if _original is not None:
            return
        _original = _TorchDataLoader.__dict__["_get_iterator"]
        _TorchDataLoader._get_iterator = _fast_get_iterator


def uninstall() -> None:
    """Give torch's DataLoader its own iterator back, for iterators created from
    now on (a running epoch, and a loader's persistent workers, stay fastloader's
    until that iterator ends). Idempotent."""
    global _original
    with _lock:
        if _original is None:
            return
        if _TorchDataLoader.__dict__.get("_get_iterator") is not _fast_get_iterator:
            # someone patched it after us: restoring torch's would drop their patch
            warnings.warn("fastloader.uninstall(): torch.utils.data.DataLoader._get_iterator "
                          "was replaced by someone else after fastloader.install(); left "
                          "as it is", FastLoaderWarning, stacklevel=2)
        else:
            _TorchDataLoader._get_iterator = _original
        _original = None


def installed() -> bool:
    """Whether install() is in effect."""
    return _original is not None


def install_from_environment() -> None:
    """``FASTLOADER_INSTALL=1`` (or ``file_system``/``file_descriptor`` to also
    choose the strategy) installs at ``import fastloader``; empty, ``0``, ``false``,
    ``no`` and ``off`` (any case) do not. Any other value installs, with a warning."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value.lower() in _OFF:
        return
    if value not in STRATEGIES and value.lower() not in _ON:
        warnings.warn(f"fastloader: {ENV_VAR}={value!r} is not one of "
                      f"{', '.join(sorted(_ON | set(STRATEGIES)))} (on) or "
                      f"{', '.join(repr(v) for v in sorted(_OFF))} (off); installing with "
                      f"the {DEFAULT_STRATEGY} strategy", RuntimeWarning, stacklevel=2)
    install(value if value in STRATEGIES else DEFAULT_STRATEGY)


_OFF = frozenset({"", "0", "false", "no", "off"})
_ON = frozenset({"1", "true", "yes", "on"})


def warn_if_rebuilt_by_accelerate(loader, by="Accelerator.prepare()",
                                  as_what="its own torch DataLoader (DataLoaderShard)") -> None:
    """accelerate's prepare() reads ``_is_accelerate_prepared`` on a loader, then
    rebuilds it as its own torch DataLoader from torch's arguments (its
    skip_first_batches() too, when the loader was not prepared): without install()
    the rebuilt loader runs torch's workers; with it, fastloader's, but with
    install()'s sharing strategy. Say so when that changes anything."""
    if getattr(loader, "num_workers", 0) == 0:
        return   # no workers either way
    own = getattr(loader, "sharing_strategy", _strategy)
    if not installed():
        message = (
            f"fastloader: accelerate's {by} rebuilds this fastloader.DataLoader as "
            f"{as_what}, which runs torch's workers instead of fastloader's and drops "
            "sharing_strategy. Call fastloader.install() before it (or set "
            "FASTLOADER_INSTALL=1 before importing fastloader) to give every torch "
            "DataLoader fastloader's workers.")
    elif own != _strategy:
        message = (
            f"fastloader: accelerate's {by} rebuilds this fastloader.DataLoader as "
            f"{as_what}, with fastloader's workers (install() is active) but install()'s "
            f"sharing_strategy={_strategy!r}, not this loader's {own!r}; call "
            f"fastloader.install(sharing_strategy={own!r}) to keep it.")
    else:
        return
    # at the user's call
    warnings.warn(message, FastLoaderWarning,
                  stacklevel=stacklevel_outside("fastloader", "accelerate"))


def read_by_accelerate_skip_first_batches() -> bool:
    """Whether the attribute being read (by the caller of this function's caller)
    is read by accelerate's skip_first_batches(), which copies an unprepared
    loader's arguments into a new torch DataLoader. (It reads them in a dict
    comprehension: its own frame before Python 3.12.)"""
    frame = sys._getframe(2)
    for _ in range(2):
        if frame is None:
            return False
        if (frame.f_code.co_name == "skip_first_batches"
                and frame.f_globals.get("__name__", "").startswith("accelerate")):
            return True
        frame = frame.f_back
    return False
