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
"""
from __future__ import annotations

import torch

__all__ = ["capture", "own_generators", "restore"]


def _generator(obj):
    try:
        g = getattr(obj, "generator", None)
    except Exception:   # a property that raises: torch never reads it
        return None
    return g if isinstance(g, torch.Generator) else None


def own_generators(index_sampler, loader_generator) -> list:
    """The generators of `index_sampler` and of the sampler it wraps, in that
    order, other than the loader's (saved as sampler_rng) and each once."""
    found = []
    try:
        inner = getattr(index_sampler, "sampler", None)
    except Exception:
        inner = None
    for obj in (index_sampler, inner):
        g = _generator(obj) if obj is not None else None
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
