"""Helpers for torchrun / DistributedDataParallel jobs, on torch.distributed
itself (no cluster layer of our own).

* ``shard(iterable)`` inside an IterableDataset's ``__iter__`` gives this rank's
  and this worker's share: ranks see disjoint items whose union is the stream.
* ``rank_info()`` says which rank this process is, for error messages.
* ``share_on_node(build)`` builds packed metadata once per node (one segment,
  attached by every rank that can reach its pages) instead of once per rank.
* ``node_key()`` says which ranks count as one node for that."""
from __future__ import annotations

import functools
import hashlib
import itertools
import os
import pickle
import time
import warnings
from datetime import timedelta

import torch
from torch.utils.data import get_worker_info

from ._core import FastLoaderError
from .packed import attach_node_handle


def _dist():
    d = torch.distributed
    return d if d.is_available() and d.is_initialized() else None


def rank_and_world():
    """(rank, world size): torch.distributed's when initialised, else torchrun's
    environment variables, else (0, 1)."""
    d = _dist()
    if d is not None:
        return d.get_rank(), d.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def rank_info() -> str:
    """' on rank R of W' in a distributed job, '' otherwise (for messages)."""
    rank, world = rank_and_world()
    return f" on rank {rank} of {world}" if world > 1 else ""


def shard(iterable, rank=None, world_size=None):
    """Yield the items of `iterable` that belong to this (rank, worker): item i
    goes to shard i mod (world_size * num_workers). Call it in __iter__:

        def __iter__(self):
            yield from fastloader.distributed.shard(self.read_records())
    """
    r, w = rank_and_world()
    rank = r if rank is None else rank
    world_size = w if world_size is None else world_size
    info = get_worker_info()
    wid, nworkers = (info.id, info.num_workers) if info is not None else (0, 1)
    shards = world_size * nworkers
    return itertools.islice(iterable, rank * nworkers + wid, None, shards)


def _read_boot_id():
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def node_key():
    """What decides whether two processes can share a packed array's pages, as
    a string, or None where this process cannot tell (no /proc).

    Ranks attach to the builder's memfd through /proc/<pid>/fd/<n>, which needs
    the same running kernel (its boot id: two machines never share one, even with
    the same hostname) and the same PID namespace (the builder's pid must mean
    the same process: two containers on one machine do not share one). Named
    segments (file_system) also need the same /dev/shm. The hostname decides
    none of this, so it is not part of the key; nor is torchrun's GROUP_RANK,
    which numbers agents, not kernels (ranks of two agents in one container can
    share pages, and torchrun cannot tell two containers apart)."""
    try:
        boot = _read_boot_id()
        pid_ns = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    try:
        shm = os.stat("/dev/shm")
        shm_id = f"{shm.st_dev}:{shm.st_ino}"
    except OSError:
        shm_id = "-"
    return f"{boot}/pidns:{pid_ns.st_dev}:{pid_ns.st_ino}/shm:{shm_id}"


def _builder_name(build, key):
    """What the ranks must agree on having built: the caller's `key`, else the
    builder's qualified name plus a digest of what it is called with (a
    functools.partial's arguments, a function's defaults and closure), so that
    partial(load, "train") and partial(load, "val") are told apart. Never its repr:
    that can differ between processes (addresses) for one and the same builder."""
    if key is not None:
        return str(key)
    func, bound = build, []
    while isinstance(func, functools.partial):   # nested partials: every layer's arguments
        bound.append((func.args, sorted(func.keywords.items())))
        func = func.func
    mod = getattr(func, "__module__", None) or type(func).__module__
    name = f"{mod}.{getattr(func, '__qualname__', None) or type(func).__qualname__}"
    parts = []
    if bound:
        try:
            parts.append(_canonical_pickle(bound))
        except Exception as exc:   # noqa: BLE001 -- any pickling failure means the same
            raise TypeError(
                f"fastloader: share_on_node: the arguments bound to {name} cannot be pickled "
                f"({type(exc).__name__}: {exc}), so the ranks cannot check that they build "
                "the same thing; pass key=... naming what is built (equal on every rank "
                "that must share it)") from None
    # Cheap extras: defaults and closure cells, where they pickle (a closure over an
    # unpicklable object counts by its type only).
    cells = [c.cell_contents for c in (getattr(func, "__closure__", None) or ())
             if _cell_is_set(c)]
    for value in (getattr(func, "__defaults__", None), getattr(func, "__kwdefaults__", None),
                  *cells):
        if value is None:
            continue
        try:
            parts.append(_canonical_pickle(value))
        except Exception:   # noqa: BLE001 -- see above
            parts.append(f"{type(value).__module__}.{type(value).__qualname__}".encode())
    if not parts:
        return name
    return f"{name}[args {hashlib.sha256(b'|'.join(parts)).hexdigest()[:16]}]"


def _cell_is_set(cell):
    try:
        cell.cell_contents
    except ValueError:   # a free variable not bound yet
        return False
    return True


def _canonical(value):
    """`value` with sets and dicts put in a fixed order: their iteration order can
    differ between processes (string hashing is randomised per process)."""
    if isinstance(value, (set, frozenset)):
        return ("<set>", sorted((_canonical(v) for v in value), key=pickle.dumps))
    if isinstance(value, dict):
        items = [(_canonical(k), _canonical(v)) for k, v in value.items()]
        return ("<dict>", sorted(items, key=lambda kv: pickle.dumps(kv[0])))
    if isinstance(value, (list, tuple)):
        return type(value)(_canonical(v) for v in value)
    return value


def _canonical_pickle(value):
    return pickle.dumps(_canonical(value), protocol=4)


def _group_store(d, group):
    """The c10d store behind `group` (a private but long-stable torch API), or
    None where this torch has none to give."""
    try:
        c10d = d.distributed_c10d
        if group is None:
            return c10d._get_default_store()
        return c10d._get_process_group_store(group)
    except Exception:   # noqa: BLE001 -- only an optional early check is lost
        return None


_CALLS: dict = {}   # (store, group's ranks) -> share_on_node calls made by this process


def _rank_list(ranks):
    return ", ".join(str(r) for r in ranks)


class _Arrivals:
    """Who has entered this call of share_on_node, kept in the group's store, so
    that a rank that never calls can be named (a collective that times out only
    says that it did). Each rank writes one key on entry; that is all unless a
    `timeout` of its own was asked for or the first exchange fails."""

    def __init__(self, d, group, ranks, rank):
        self.ranks, self.rank = ranks, rank
        self.store = _group_store(d, group)
        if self.store is None:
            return
        ident = (id(self.store), tuple(ranks))
        _CALLS[ident] = call = _CALLS.get(ident, 0) + 1
        self.prefix = f"fastloader/share_on_node/{call}"
        self.store.set(f"{self.prefix}/in/{rank}", b"1")

    def missing(self):
        """The ranks that have not entered, or None if the store cannot say."""
        if self.store is None:
            return None
        try:
            return [r for r in self.ranks if not self.store.check([f"{self.prefix}/in/{r}"])]
        except Exception:   # noqa: BLE001 -- the store's host is gone
            return None

    def error(self, seconds):
        missing = self.missing()
        if not missing:
            return None
        return FastLoaderError(
            f"fastloader: share_on_node on rank {self.rank}: rank(s) {_rank_list(missing)} "
            f"did not reach share_on_node within {seconds:.0f} s (died, or does not call it: "
            "every rank of the group must call it, the same number of times)")

    def wait(self, timeout):
        """Return once every rank has entered; after `timeout`, raise naming the
        ranks that have not (the last to enter marks the call complete)."""
        if self.store is None:
            return
        if self.store.add(f"{self.prefix}/count", 1) == len(self.ranks):
            self.store.set(f"{self.prefix}/all", b"1")
        try:
            self.store.wait([f"{self.prefix}/all"], timeout)
        except Exception as exc:   # noqa: BLE001 -- a store's timeout is a bare RuntimeError
            named = self.error(timeout.total_seconds())
            if named is not None:
                raise named from None
            raise FastLoaderError(f"fastloader: share_on_node on rank {self.rank}: waiting "
                                  f"for the other ranks failed: {exc}") from exc


def _gather(d, group, size, item, rank, what, arrivals=None, started=None):
    out = [None] * size   # one slot per rank of the group, not of the job
    try:
        d.all_gather_object(out, item, group=group)
    except Exception as exc:   # noqa: BLE001 -- gloo reports a lost peer as RuntimeError
        if arrivals is not None:   # timed out because a rank never came? name it
            named = arrivals.error(time.monotonic() - started)
            if named is not None:
                raise named from exc
        raise FastLoaderError(f"fastloader: share_on_node on rank {rank}: {what} "
                              f"failed: {exc}") from exc
    return out


def _as_timedelta(timeout):
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)


def share_on_node(build, group=None, *, key=None, timeout=None):
    """Build an object once per node and share it with every rank of that node.

    `build()` runs on the lowest rank of each node only and must return a
    fastloader packed array; the node's other ranks attach to its shared
    segment, so a node with 8 ranks holds the data once. Every rank of `group`
    (default: the whole job) must call it. A node is what ``node_key()`` says
    (same kernel boot, PID namespace and /dev/shm), not a hostname; a rank that
    still cannot attach builds its own copy and warns.

    The ranks must agree on what is built: by `key` when given, else by the
    builder's qualified name and a digest of its bound arguments (a
    functools.partial's args and kwargs, which must then pickle; a function's
    defaults and closure where they pickle). Errors name the rank at fault: ranks that called
    with different builders, a builder that failed or died before publishing, a
    rank that never calls (after `timeout` seconds when given, else when the
    process group's timeout ends the exchange; a rank that dies is seen at once
    where the backend sees it, as gloo does).
    Without torch.distributed it just calls build()."""
    d = _dist()
    if d is None:
        return build()
    rank = d.get_rank()
    ranks = list(range(d.get_world_size())) if group is None else \
        d.get_process_group_ranks(group)
    if rank not in ranks:   # torch returns None lists to a non-member: a cryptic TypeError
        raise ValueError(f"fastloader: share_on_node: rank {rank} is not in the group "
                         f"(ranks {_rank_list(ranks)})")
    size = len(ranks)
    started = time.monotonic()
    arrivals = _Arrivals(d, group, ranks, rank)
    if timeout is not None:
        arrivals.wait(_as_timedelta(timeout))

    mine = (node_key(), _builder_name(build, key))
    calls = _gather(d, group, size, (rank, *mine), rank, "exchanging node keys",
                    arrivals, started)
    _check_same_builder(calls, rank)
    peers = sorted(r for r, node, _ in calls if node is not None and node == mine[0])
    leader = peers[0] if peers else rank   # no node key: this rank is a node of its own

    obj, error = None, None
    if rank == leader:
        try:
            obj = build()
            if not callable(getattr(obj, "node_handle", None)):
                raise TypeError("fastloader: share_on_node: build() must return a fastloader "
                                f"packed array, got {type(obj).__name__}")
            handle = obj.node_handle()
        except Exception as exc:   # noqa: BLE001 -- published to the peers, then re-raised
            error, handle = exc, None
        item = (rank, handle, None if error is None else f"{type(error).__name__}: {error}")
    else:
        item = (rank, None, None)
    waiting = "exchanging the nodes' arrays (a rank died?)" if rank == leader else \
        (f"waiting for rank {leader}, the builder for this node (it died or left "
         "before publishing its array?)")
    published = _gather(d, group, size, item, rank, waiting)
    if error is not None:
        raise error
    # a failed builder fails every rank of the group, not only its node's: the
    # other nodes would otherwise wait for it in the exchange below
    _raise_failures(published, rank, leader)
    if obj is None:
        handle = next(p[1] for p in published if p[0] == leader)
        try:
            obj = _attach_or_build(handle, build, rank, leader)
        except Exception as exc:   # noqa: BLE001 -- published to the peers, then re-raised
            error = exc
    # this exchange also keeps every builder's segment alive until its node's
    # ranks have attached
    done = _gather(d, group, size,
                   (rank, None, None if error is None else f"{type(error).__name__}: {error}"),
                   rank, "the final exchange (a rank died?)")
    if error is not None:
        raise error
    _raise_failures(done, rank, None)
    return obj


def _raise_failures(published, rank, leader):
    """Raise naming the first rank whose part failed (leader None: the last stage,
    where a rank failed to build its own copy)."""
    failed = [(r, failure) for r, _, failure in published if failure is not None]
    if not failed:
        return
    r, failure = failed[0]
    role = ("building its own copy" if leader is None else
            "the builder for this node" if r == leader else "the builder for another node")
    raise FastLoaderError(f"fastloader: share_on_node on rank {rank}: rank {r} ({role}) "
                          f"failed: {failure}")


def _check_same_builder(calls, rank):
    names: dict = {}
    for r, _, name in calls:
        names.setdefault(name, []).append(r)
    if len(names) > 1:
        listing = "; ".join(f"rank(s) {_rank_list(rs)}: {n}" for n, rs in names.items())
        raise FastLoaderError(f"fastloader: share_on_node on rank {rank}: the ranks called "
                              f"it with different builders ({listing})")


def _attach_or_build(handle, build, rank, leader):
    try:
        return attach_node_handle(handle)
    except (OSError, FastLoaderError) as exc:
        # e.g. /proc/<pid>/fd hidden by ptrace rules or another /proc: the pages
        # cannot be shared from here, but the data can still be had
        warnings.warn(f"fastloader: share_on_node: rank {rank} cannot attach to the array "
                      f"of rank {leader} ({exc}); building a copy on this rank",
                      RuntimeWarning, stacklevel=3)
        return build()
