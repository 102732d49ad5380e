"""Helpers for torchrun / DistributedDataParallel jobs, on torch.distributed
itself (no cluster layer of our own).

* ``shard(iterable)`` inside an IterableDataset's ``__iter__`` gives this rank's
  and this worker's share: ranks see disjoint items whose union is the stream.
* ``rank_info()`` says which rank this process is, for error messages.
Node-level sharing of packed metadata is in ``share_on_node`` (one segment per
node, attached by every local rank)."""
from __future__ import annotations

import itertools
import os
import socket

import torch
from torch.utils.data import get_worker_info


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


def share_on_node(build, group=None):
    """Build an object once per node and share it with every local rank.

    `build()` runs on the first rank of each host only and must return a
    fastloader packed array; the others attach to its shared segment through a
    handle exchanged with torch.distributed.all_gather_object, so a node with 8
    ranks holds the data once. Without torch.distributed it just calls build()."""
    d = _dist()
    if d is None:
        return build()
    host = socket.gethostname()
    rank = d.get_rank()
    hosts = [None] * d.get_world_size()
    d.all_gather_object(hosts, (host, rank), group=group)
    leader = min(r for h, r in hosts if h == host)
    obj = build() if rank == leader else None
    handle = obj.node_handle() if obj is not None else None
    handles = [None] * d.get_world_size()
    d.all_gather_object(handles, (host, rank, handle), group=group)
    if obj is None:
        mine = next(hd for h, r, hd in handles if h == host and r == leader)
        from .packed import attach_node_handle

        obj = attach_node_handle(mine)
    # the leader must keep its segment until every local rank has attached
    d.barrier(group=group)
    return obj
