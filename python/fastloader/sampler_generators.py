"""The generators a sampler shuffles with besides the loader's, for resume.

A resumed epoch draws its batches of indices again from the epoch's start, so
every RNG the sampler draws from must be where it was then. The loader's
generator (or the global RNG) is saved as ``sampler_rng``; a sampler given a
generator of its own (``RandomSampler(ds, generator=g)``, which a restarted job
makes afresh, seeded as at its start) draws from that one, which had moved on
by one permutation per epoch: without it in the state, a resumed epoch shuffled
as the job's first epoch did, and yielded some samples twice and others never.

Found where torch's samplers keep one: ``.generator`` of the index sampler and
of the sampler a batch sampler wraps (RandomSampler, SubsetRandomSampler,
WeightedRandomSampler). A state saved with none, or with another number of them
(another sampler), restores none.

A loader given a ``generator`` hands it only to the samplers it makes itself: a
sampler the user made without one (``DataLoader(ds, sampler=RandomSampler(ds),
generator=g)``, or a custom sampler calling ``torch.randperm(n)``) draws from the
global RNG, which the training loop moves too. Where the sampler drew from it, the
global RNG at the epoch's start is saved as ``global_rng`` (and at save time as
``global_rng_now``, see DataLoader.state_dict); without a loader generator the
global RNG is ``sampler_rng`` itself.
"""
from __future__ import annotations

import torch

__all__ = ["capture", "draws_from_global", "global_rng_drawn", "global_rng_now",
           "global_rng_start", "own_generators", "restore", "restore_global"]


def _generator(obj):
    try:
        g = getattr(obj, "generator", None)
    except Exception:   # a property that raises: torch never reads it
        return None
    return g if isinstance(g, torch.Generator) else None


def _samplers(index_sampler):
    """`index_sampler` and the sampler it wraps (a batch sampler's), if any."""
    try:
        inner = getattr(index_sampler, "sampler", None)
    except Exception:   # a property that raises: torch never reads it
        inner = None
    return [obj for obj in (index_sampler, inner) if obj is not None]


def own_generators(index_sampler, loader_generator) -> list:
    """The generators of `index_sampler` and of the sampler it wraps, in that
    order, other than the loader's (saved as sampler_rng) and each once."""
    found = []
    for obj in _samplers(index_sampler):
        g = _generator(obj)
        if g is not None and g is not loader_generator and all(g is not f for f in found):
            found.append(g)
    return found


def capture(index_sampler, loader_generator) -> list:
    """Their states now (copies), for the state."""
    return [g.get_state().clone() for g in own_generators(index_sampler, loader_generator)]


def restore(index_sampler, loader_generator, states) -> bool:
    """Put them back where `states` (from capture) has them: whether it did (not
    if the state has none or names another number of them)."""
    generators = own_generators(index_sampler, loader_generator)
    if not states or len(states) != len(generators):
        return False
    for g, state in zip(generators, states):
        g.set_state(state)
    return True


def global_rng_start(loader_generator):
    """The global RNG now, where the sampler is about to start drawing, while the
    loader has a generator of its own; None without one (sampler_rng is it)."""
    return torch.get_rng_state() if loader_generator is not None else None


def _torch_sampler_without_generator(index_sampler) -> bool:
    """Whether the sampler, or the one a batch sampler wraps, is one of torch's
    shuffling samplers (a `generator` attribute) given none: they draw from the
    global RNG."""
    for obj in _samplers(index_sampler):
        try:
            if hasattr(obj, "generator") and obj.generator is None:
                return True
        except Exception:   # a property that raises: torch never reads it
            continue
    return False


def global_rng_drawn(start, index_sampler, drawn=True):
    """`start` (from global_rng_start) where the sampler draws from the global RNG,
    else None. Once it `drawn` its first batch: whether the global RNG moved since
    `start` (nothing else in the loader draws from it there), which finds a custom
    sampler's draws too. Before: whether it is one of torch's shuffling samplers
    without a generator."""
    if start is None:
        return None
    if drawn:
        return None if torch.equal(start, torch.get_rng_state()) else start
    return start if _torch_sampler_without_generator(index_sampler) else None


def draws_from_global(state) -> bool:
    """Whether the state's sampler drew from the global RNG beside a loader
    generator: only then do its global RNGs (``global_rng``, ``global_rng_now``)
    count."""
    return state.get("global_rng") is not None


def global_rng_now(state):
    """The global RNG as the saved run had it when the state was taken, where the
    state's sampler draws from it beside a loader generator; else None."""
    return state.get("global_rng_now") if draws_from_global(state) else None


def restore_global(loader_generator, state, now=False) -> None:
    """Where the state's sampler drew from the global RNG beside the loader's
    generator: that RNG where the saved epoch's sampler started (before a resumed
    epoch draws again), or with `now` where it was at save time (an epoch-end
    state: the next epoch draws from it)."""
    rng = global_rng_now(state) if now else state.get("global_rng")
    if loader_generator is not None and rng is not None:
        torch.set_rng_state(rng)
