"""What the loader registry (``benchmarks.loaders``) holds per loader.

A module of its own so that the peer modules, which the registry imports, can
build specs without importing the registry back.
"""

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class LoaderSpec:
    name: str
    # (dataset, *, batch_size, num_workers, collate_fn, persistent, context) -> iterable
    build: Callable
    kind: str  # "processes", "threads" or "in-process": where the per-sample work runs
    description: str = ""
    is_peer: bool = True
    # workload name -> reason it cannot run it (reported, never silently dropped)
    unsupported: dict = field(default_factory=dict)

    def supports(self, workload_name):
        reason = self.unsupported.get(workload_name)
        return (reason is None), reason
