"""Mid-epoch resume: what `DataLoader.state_dict()` captures and how a fresh
loader fast-forwards to it.

The batches of an epoch are fixed by three things, and the state holds each:
  * the main process's RNG where the sampler starts drawing (and the workers'
    base seed), so the restored sampler yields the same index batches;
  * how far the epoch got (the next batch sequence number), so those batches are
    skipped, not fetched;
  * each worker's RNG (random, torch, numpy) and, for an IterableDataset with
    ``state_dict``/``load_state_dict``, its position, as snapshotted before one
    of its tasks, plus the tasks it ran since: a resumed worker restores the
    snapshot and re-runs those tasks without sending them (replay), which puts
    its RNG exactly where the uninterrupted run had it.
Workers snapshot before their first task of each epoch (a stateful iterable's
worker also right after it, see `with_state_after_first_task`), and every
``snapshot_every_n_steps`` tasks when that is > 0 (less replay on resume, a few
tens of microseconds per snapshot).
"""
from __future__ import annotations

import inspect
import random

import numpy as np
import torch
from torch.utils.data import IterableDataset, _DatasetKind

from . import _core
from . import sampler_generators
from .protocol import Replay, Restore
from .seeding import seed_worker

# 2: a worker's first snapshot may be its seeds (seeded_snapshot), which a
# fastloader that wrote 1 cannot restore: it refuses such a state at
# load_state_dict(), not in the worker. Both load here.
VERSION = 2
READABLE_VERSIONS = (1, 2)


# -- main process ------------------------------------------------------------------
class SeqRuns:
    """Increasing batch numbers kept as runs (start, step, count): a worker's
    tasks are mostly every num_workers-th batch, so an epoch of a million
    batches costs a few runs, not a million list entries."""

    __slots__ = ("runs",)

    def __init__(self, runs=()):
        self.runs = [list(r) for r in runs]

    def append(self, seq):
        runs = self.runs
        if runs:
            last = runs[-1]
            start, step, count = last
            if count == 1 and seq > start:
                last[1], last[2] = seq - start, 2
                return
            if seq == start + step * count:
                last[2] = count + 1
                return
        runs.append([seq, 0, 1])

    def __iter__(self):
        for start, step, count in self.runs:
            for k in range(count):
                yield start + step * k

    def export(self):
        return [tuple(r) for r in self.runs]


class EpochTracker:
    """The main process's resume bookkeeping for one epoch: per worker, the newest
    snapshot delivered with a batch (and the epoch's first), the batches delivered
    since each, and (in_order=False) the batches delivered ahead of the next one
    due. The iterator tells it what it delivered; it answers state_dict()'s
    per-worker part."""

    def __init__(self, num_workers: int):
        self.snap = [None] * num_workers          # (seq, snapshot) newest
        self.epoch_snap = [None] * num_workers    # (seq, snapshot) of the epoch's start
        self.since_snap = [SeqRuns() for _ in range(num_workers)]
        self.epoch_tasks = [SeqRuns() for _ in range(num_workers)]
        self.ahead = set()   # in_order=False: delivered seqs past the next one due
        self._prune_at = 64   # (the seqs the cursor has passed are dropped now and then)

    def delivered(self, worker: int, seq: int, snap) -> None:
        """Batch `seq` came from `worker`, with the snapshot taken before it (or None),
        which may hold the one taken after it (see `with_state_after_first_task`)."""
        if snap is not None:
            after = snap.pop("after", None)
            entry = (seq, snap)
            if self.epoch_snap[worker] is None:
                self.epoch_snap[worker] = entry
            if after is not None:   # nothing to replay from it: seq is done there
                self.snap[worker] = (seq, after)
                self.since_snap[worker] = SeqRuns()
            else:
                self.snap[worker] = entry
                self.since_snap[worker] = SeqRuns([(seq, 0, 1)])
        else:
            self.since_snap[worker].append(seq)
        self.epoch_tasks[worker].append(seq)

    def epoch_started(self, worker: int, snap) -> None:
        """A persistent worker's snapshot as a new epoch began: its RNGs carry on
        from the last epoch, so until its first batch of this epoch arrives (with
        the same snapshot), this is the one a resume must restore."""
        entry = (-1, snap)
        self.snap[worker] = self.epoch_snap[worker] = entry
        self.since_snap[worker] = SeqRuns()

    def delivered_ahead(self, seq: int, next_seq: int) -> None:
        """Batch `seq` was delivered before `next_seq`, the batch due now."""
        self.ahead.add(seq)
        if len(self.ahead) > self._prune_at:
            # the seqs the cursor has passed tell nothing more (ahead_of() skips
            # them); kept, an epoch out of order would hold one per batch
            self.ahead = {s for s in self.ahead if s >= next_seq}
            self._prune_at = max(64, 2 * len(self.ahead))

    def ahead_of(self, next_seq: int) -> list:
        return sorted(s for s in self.ahead if s >= next_seq)

    def worker_states(self, active, dataset) -> list:
        """state_dict()["workers"]: what each worker restores and replays."""
        workers = []
        for wid, is_active in enumerate(active):
            entry = self.snap[wid]
            replay = self.since_snap[wid]
            if entry is None or (not has_position(entry[1], dataset)
                                 and self.epoch_snap[wid] is not None):
                entry = self.epoch_snap[wid]
                replay = self.epoch_tasks[wid]
            workers.append({
                "active": is_active,
                "snapshot": entry[1] if entry else None,
                "snap_entry": entry,
                "epoch_snap_entry": self.epoch_snap[wid],
                "replay": replay.export(),   # runs of (start, step, count)
                "epoch_tasks": self.epoch_tasks[wid].export(),
            })
        return workers

    def restore(self, state: dict) -> None:
        """Continue the bookkeeping of the saved run."""
        for wid, w in enumerate(state["workers"]):
            self.snap[wid] = w.get("snap_entry")
            self.epoch_snap[wid] = w.get("epoch_snap_entry")
            self.since_snap[wid] = SeqRuns(w["replay"])
            self.epoch_tasks[wid] = SeqRuns(w.get("epoch_tasks", ()))
        # a later state_dict() must still tell the batches delivered ahead
        self.ahead = set(state.get("delivered_ahead", ()))


def indices_to_replay(state: dict, next_index, iterable: bool = False) -> dict:
    """Draw the saved run's batches of indices up to its next batch (skipped, not
    fetched) from `next_index`; returns {seq: indices} of those a worker must replay.
    For an IterableDataset also those of the batches delivered ahead of the next
    one (in_order=False): each advanced its worker's stream, so its worker replays
    it too. (Its sampler yields the same thing forever, so drawing past the next
    batch changes nothing that is drawn later; a map-style sampler's would.)"""
    needed = {seq for w in state["workers"] for seq in SeqRuns(w["replay"])}
    last = next_seq(state)
    if iterable and needed:
        last = max(last, max(needed) + 1)
    index_of = {}
    for seq in range(last):
        try:
            index = next_index()
        except StopIteration:
            break
        if seq in needed:
            index_of[seq] = index
    return index_of


def control_messages(worker_state: dict, index_of: dict) -> list:
    """What a resumed worker is sent: restore its snapshot, then replay its tasks."""
    messages = []
    if worker_state["snapshot"] is not None:
        messages.append(Restore(worker_state["snapshot"]))
    for seq in SeqRuns(worker_state["replay"]):
        if seq in index_of:
            messages.append(Replay(index_of[seq]))
    return messages


class GlobalRngAfterResume:
    """Where a mid-epoch resume leaves the process's global RNG once the resumed
    epoch's own draws are made: where the saved run had it when the state was
    taken. Without a generator, the iterator (its base seed) and the sampler (its
    own seed) draw from the global RNG, which the training loop moves too (dropout,
    augmentation): the uninterrupted run made those draws at the epoch's start, and
    the resumed one makes them again from the epoch's starting RNG (to shuffle the
    same way), which left the global RNG rewound there, so the loop's draws after
    a resume repeated the epoch's first ones (and the next epoch shuffled as that
    one). With a generator of the loader's, the same holds for a sampler that drew
    from the global RNG all the same (sampler_generators.draws_from_global).
    Nothing where neither draws from it, or for no state or a state outside an
    epoch (which sets the generator itself, see load_state_dict). Set once, by the
    iterator that resumes; put in place once, by apply()."""

    __slots__ = ("_rng",)

    def __init__(self, generator, state):
        rng = None
        if state is not None and not state.get("fresh") and not state.get("epoch_done"):
            rng = (state["rng_now"] if generator is None
                   else sampler_generators.global_rng_now(state))
        self._rng = None if rng is None else rng.clone()

    def apply(self) -> None:
        """Put the global RNG where the saved run had it (once; nothing where
        there is nothing to put)."""
        rng, self._rng = self._rng, None
        if rng is not None:
            torch.set_rng_state(rng)


def sampler_had_drawn(state) -> bool:
    """Whether the saved epoch's sampler had drawn from its RNGs: once a batch was
    taken, and from the start with workers (iter() draws the batches of the tasks
    it hands out first); without workers, the first batch draws them. One that had
    not draws, resumed, from the RNGs as the saved run had them when saved. The
    iterators say so in the state ("sampler_drawn", which a loaded state saved
    again keeps); a state saved before that key tells by its number of workers."""
    if next_seq(state):
        return True
    drawn = state.get("sampler_drawn")
    if drawn is None:
        drawn = state.get("fingerprint", {}).get("num_workers")
    return bool(drawn)


def rng_before_base_seed(generator, state, persistent=None):
    """The loader's RNG before a new iterator draws its base seed, where that draw
    must be undone: a state taken at the end of an epoch of persistent workers,
    whose saving run drew no seed for its next epoch. Taken then, not the state's
    own RNG, so that a draw the job made since loading it (validation dropout
    without a generator) stays. None elsewhere."""
    if state is None or not state.get("epoch_done"):
        return None
    if not state.get("persistent", persistent):
        return None
    return capture_rng(generator)


def capture_rng(generator):
    return (generator.get_state() if generator is not None else torch.get_rng_state()).clone()


def restore_rng(generator, state):
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)


def _sampler_of(loader):
    # not `or`: bool() of a sampler calls its __len__, which an endless one may
    # not have (it raises)
    sampler = getattr(loader.batch_sampler, "sampler", None)
    return sampler if sampler is not None else loader.sampler


def _attribute(obj, name, default):
    """obj.name, or `default` where it has none or it raises (a property of a
    dynamic batch sampler): torch never reads it, so it must not stop a state."""
    try:
        return getattr(obj, name, default)
    except Exception:
        return default


def fingerprint(loader) -> dict:
    """What must match between the saved run and the resumed one."""
    try:
        length = len(loader.dataset)
    except Exception:   # no length (TypeError), or one unknown (a stream's NotImplementedError)
        length = None
    sampler = _sampler_of(loader)
    world = _attribute(sampler, "num_replicas", None)
    if world is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    return {
        "dataset_len": length,
        "batch_size": _attribute(loader.batch_sampler, "batch_size", loader.batch_size),
        "drop_last": loader.drop_last,
        "world_size": world if world is not None else 1,
        "num_workers": loader.num_workers,
    }


def validate(loader, state) -> bool:
    """Raise ValueError unless `state` can resume `loader`. Returns True where only
    the number of workers differs, for a map-style dataset or a state taken
    outside an epoch (see for_other_worker_count)."""
    if not isinstance(state, dict) or state.get("version") not in READABLE_VERSIONS:
        got = (f"a dict of version {state.get('version')!r}" if isinstance(state, dict)
               else type(state).__name__)
        raise ValueError("fastloader: load_state_dict() expects a state from "
                         "fastloader.DataLoader.state_dict() (version "
                         f"{' or '.join(map(str, READABLE_VERSIONS))}), got {got}")
    saved, now = state["fingerprint"], fingerprint(loader)
    names = {"dataset_len": "dataset length", "batch_size": "batch size",
             "drop_last": "drop_last", "world_size": "world size",
             "num_workers": "num_workers"}
    if state.get("fresh") or state.get("epoch_done"):
        # outside an epoch (before the first, between two) nothing is continued:
        # the next epoch starts from the saved RNG with this loader's settings, so
        # any of them may differ (as torchdata's StatefulDataLoader allows)
        return False
    other_workers = False
    for key, label in names.items():
        if saved.get(key) != now.get(key):
            # a map-style epoch's batches do not depend on the workers
            if key == "num_workers" and not isinstance(loader.dataset, IterableDataset):
                other_workers = True
                continue
            raise ValueError(
                f"fastloader: cannot resume: the state was saved with {label} "
                f"{saved.get(key)!r} but this loader has {label} {now.get(key)!r}; "
                "resuming would silently yield different batches")
    return other_workers


def yielded_every_batch(dataset_kind, index_sampler, next_seq: int, ahead=(),
                        sent=None) -> bool:
    """Whether a map-style epoch has yielded as many batches as its length though
    its iterator has not raised StopIteration yet (a loop that counts its steps,
    Lightning stopping at `max_steps`): every batch before the length is behind
    `next_seq` or among those delivered `ahead` of it (in_order=False), and no task
    was `sent` past the length (a sampler longer than its length has not ended).
    See as_epoch_end. (An IterableDataset's length is only a hint, and an endless
    sampler has none.)"""
    if dataset_kind != _DatasetKind.Map or next_seq <= 0:
        return False
    try:
        length = len(index_sampler)
    except Exception:   # no length, or one unknown
        return False
    if sent is not None and sent > length:
        return False
    return next_seq + sum(1 for seq in set(ahead) if next_seq <= seq < length) >= length


def as_epoch_end(loader, state: dict) -> dict:
    """A state saved without workers once its epoch yielded all its batches, as
    the state of that epoch's end: resumed, the next iter() starts the next epoch,
    as torchdata's StatefulDataLoader does, not an empty one that would put the
    caller's count of epochs one ahead. (With workers, each batch taken asked the
    sampler for the next, so it had ended and the state says so already.)

    Here the sampler was not asked again (state_dict() must change nothing in the
    saving run), and a RandomSampler given the loader's generator draws from it
    once more on its way out, which the next epoch's shuffle depends on: the
    generator is taken where the sampler leaves it by running this loader's
    sampler once from the epoch's start (with other settings than the saving
    run's, that is this loader's sampler; it costs what a mid-epoch resume's
    fast-forward costs). Without a generator the sampler draws only its seed from
    the global RNG, at its start: the state's own RNG, which holds every draw the
    training loop made since, stays. A sampler that yields more than its length
    had not ended: the state stays a mid-epoch one."""
    if (state.get("epoch_done") or not state.get("yielded_all")
            or isinstance(loader.dataset, IterableDataset)):
        return state
    sampler = loader._index_sampler
    try:
        length = len(sampler)
    except Exception:   # (this loader's sampler may be another one, an endless one)
        return state
    generator = loader.generator
    before = capture_rng(generator)
    global_before = capture_rng(None) if generator is not None else None
    own_before = sampler_generators.capture(sampler, generator)
    restore_rng(generator, state["sampler_rng"])
    sampler_generators.restore_global(generator, state)
    own = sampler_generators.restore(sampler, generator, state.get("sampler_generators"))
    drawn = 0
    try:
        for _ in sampler:
            drawn += 1
            if drawn > length:
                break
        at_end = capture_rng(generator)
        own_at_end = sampler_generators.capture(sampler, generator) if own else []
    finally:
        restore_rng(generator, before)
        if global_before is not None:   # a sampler that draws from it moved it
            restore_rng(None, global_before)
        sampler_generators.restore(sampler, generator, own_before)
    if drawn > length:
        return state
    return dict(state, epoch_done=True,
                rng_now=at_end if generator is not None else state["rng_now"],
                sampler_generators_now=own_at_end)


def next_seq(state: dict) -> int:
    """The sequence number of the first batch `state`'s epoch has not yielded: its
    count of batches yielded, unless a loader with in_order=False had yielded some
    past it (states saved before next_seq existed have only the count)."""
    return state.get("next_seq", state["yielded"])


def for_other_worker_count(state: dict, num_workers: int) -> dict:
    """`state` for a loader with another num_workers, over a map-style dataset: its
    index batches do not depend on the workers, so the batches already yielded are
    skipped as ever; the workers' snapshots cannot be mapped onto other workers
    and are dropped, so the new workers' random streams start as a fresh epoch's.
    (An IterableDataset's replicas are split by worker: validate() refuses it
    mid-epoch.)"""
    return dict(state, workers=[], next_seq=next_seq(state),
                next_worker=state.get("next_worker", 0) % max(1, num_workers),
                delivered_ahead=state.get("delivered_ahead", []))


# -- worker process ----------------------------------------------------------------
_NO_ARGUMENTS = {}   # function -> whether it can be called with none (snapshots ask often)


def _takes_no_arguments(method) -> bool:
    key = getattr(method, "__func__", method)
    try:
        return _NO_ARGUMENTS[key]
    except (KeyError, TypeError):   # TypeError: an unhashable callable
        pass
    try:
        inspect.signature(method).bind()
        answer = True
    except TypeError:
        answer = False
    except ValueError:   # no signature to read (some builtins): assume the protocol's
        answer = True
    try:
        _NO_ARGUMENTS[key] = answer
    except TypeError:
        pass
    return answer


def _stateful(dataset) -> bool:
    """An IterableDataset that keeps its position through torchdata's Stateful
    protocol: `state_dict()` with no arguments, and `load_state_dict(state)`.
    Datasets whose `state_dict` needs arguments (MosaicML streaming's
    `state_dict(num_samples, from_beginning)`, litdata's) follow a protocol of
    their own, for their own loaders: they resume as plain iterables do."""
    if not isinstance(dataset, IterableDataset):
        return False
    state_dict = getattr(dataset, "state_dict", None)
    return (callable(state_dict) and callable(getattr(dataset, "load_state_dict", None))
            and _takes_no_arguments(state_dict))


def _numpy_state():
    # np.random.get_state() holds an ndarray, which torch.load(weights_only=True)
    # (its default, and Lightning's for checkpoints) refuses: keep its keys as a
    # tensor, so a checkpoint holding the loader's state loads with the defaults
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
            float(cached))


def _set_numpy_state(state):
    name, keys, pos, has_gauss, cached = state
    # keys: a tensor, or an ndarray in states saved before it was one
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos,
                         has_gauss, cached))


def take_snapshot(dataset, tasks_done: int) -> dict:
    """A worker's state before one of its tasks. torch's DataLoader never calls the
    dataset's `state_dict()`: if it fails here, or returns what cannot be sent,
    the batch is not lost, the snapshot only goes without the dataset's position
    (see `has_position`)."""
    snap = {"k": tasks_done, "random": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": _numpy_state()}
    snap.update(dataset_position(dataset))
    return snap


def seeded_snapshot(base_seed: int, worker_id: int) -> dict:
    """take_snapshot(dataset, 0) of a worker whose RNGs are exactly as its seeding
    (seeding.seed_worker) left them, and whose map-style dataset has no position:
    the seeds instead of the states, and restoring seeds again. Reading the three
    states in a freshly forked worker takes ~160 copy-on-write faults (~1 ms,
    NumPy's ~0.5 ms; 2-core VM), every epoch with non-persistent workers, and
    sending them makes the first batch's slot larger. (A change to seed_worker's
    result must change VERSION: a saved state restores with the seeding of the
    fastloader that loads it.)"""
    return {"k": 0, "seeded": (base_seed, worker_id)}


def copy_state(state):
    """A copy of a dataset's state that no later change to it reaches, made by the
    codec (which raises for what cannot travel with a batch)."""
    return _core.decode(_core.encode(state))


def dataset_position(dataset) -> dict:
    """{"dataset": its state_dict()} for a stateful IterableDataset,
    {"dataset_error": why} where that failed or cannot be sent, {} otherwise."""
    if not _stateful(dataset):
        return {}
    try:
        # A copy, made by the codec: a state_dict() may return its live state,
        # which would be read only once the batch is sent, after the fetch moved
        # it on (or, kept by the user, move on with the loop). Encoding also
        # checks that it can travel with a batch: one that cannot (a lock, an
        # open file) must not take the batch down with it. (About a third of a
        # deepcopy's time for a list of a million ints, and both in one pass.)
        return {"dataset": copy_state(dataset.state_dict())}
    except Exception as exc:
        return {"dataset_error": f"{type(exc).__name__}: {exc}"}


def with_state_after_first_task(dataset, snapshot: dict, tasks_done: int) -> dict:
    """The snapshot taken before a worker's first task of an epoch, with (for a
    stateful IterableDataset) one taken after it under "after".

    Many such datasets put their position back to the start only once their
    ``__iter__``'s body runs, i.e. at the first batch: before it, at a persistent
    worker's later epoch, ``state_dict()`` still says where the last epoch ended,
    and resuming from that lost the whole epoch. Later snapshots fall between two
    batches, with the iterator running, so they are right; this one makes the
    epoch resumable from each worker's first batch on (as torchdata's
    StatefulDataLoader, which snapshots after each batch, resumes it; before a
    worker's first batch neither loader has a better state to go by)."""
    if not _stateful(dataset):
        return snapshot
    return dict(snapshot, after=take_snapshot(dataset, tasks_done))


def has_position(snap, dataset) -> bool:
    """Whether resuming from `snap` can put the worker's dataset where it was:
    not for a plain IterableDataset (its workers replay the epoch from its
    start), nor when the dataset's `state_dict()` failed at that snapshot."""
    return not needs_epoch_start(dataset) and "dataset_error" not in snap


def restore_snapshot(dataset, snap, start_iteration) -> int:
    """Put an iterable back where `snap` was taken (`start_iteration()` then calls
    its __iter__), and then the RNGs; returns the task count. The RNGs come last:
    every snapshot is taken with the dataset's iterator already made, so an
    __iter__ that draws when it is called (a shard shuffle) has drawn before it,
    and restoring the RNGs first made it draw once more."""
    if "dataset" in snap and _stateful(dataset):
        dataset.load_state_dict(snap["dataset"])
    start_iteration()
    if "seeded" in snap:   # seeded_snapshot()
        base_seed, worker_id = snap["seeded"]
        seed_worker(base_seed, worker_id)
    else:
        random.setstate(_as_random_state(snap["random"]))
        torch.set_rng_state(snap["torch"])
        _set_numpy_state(snap["numpy"])
    return snap["k"]


def _as_random_state(state):
    # random.setstate wants (version, tuple-of-ints, gauss_next); the codec may
    # hand back lists
    version, internal, gauss = state
    return version, tuple(internal), gauss


def needs_epoch_start(dataset) -> bool:
    """A plain IterableDataset cannot be positioned mid-epoch: its workers resume
    from the epoch's first snapshot and replay everything since."""
    return isinstance(dataset, IterableDataset) and not _stateful(dataset)
