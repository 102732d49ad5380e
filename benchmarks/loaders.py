"""The loaders the throughput benchmark compares: a registry, name -> how to build one.

Every entry builds, from the same arguments, something a training loop can
iterate once per epoch and that knows its length in batches::

    spec.build(dataset, batch_size=64, num_workers=2, collate_fn=None,
               persistent=True, context="fork") -> iterable with __len__

- ``fastloader``, ``torch``: the two DataLoaders the budgets compare.
- ``in-process``: fastloader's DataLoader with ``num_workers=0`` (torch's own
  single-process path): the serial baseline of the efficiency column, never a peer.
- peers (``benchmarks.peer_torchdata``, ``benchmarks.peer_spdl``): each
  registered only if its package imports; if not, ``unavailable`` says why and
  the report lists it as not run, with the reason.
- External peers: a module named in ``EXTERNAL_PEER_MODULES`` (e.g.
  ``benchmarks.ffcv_peer``), if present, defines ``loaders() -> (found,
  missing)`` as the peer modules here do (or a ``LOADERS`` dict of name ->
  ``LoaderSpec``); they join the same runs, tables, summary.json and charts.
  A module that is present but fails to import is reported as unavailable. A loader that cannot run some workload returns
  ``LoaderSpec.supports(workload) -> (False, reason)`` and is reported as such.
"""

import importlib

import torch.utils.data

from benchmarks import peer_spdl, peer_torchdata
from benchmarks.loader_spec import LoaderSpec

FASTLOADER = "fastloader"
TORCH = "torch"
IN_PROCESS = "in-process"

# Modules other benchmark files may provide; imported if present (never required).
EXTERNAL_PEER_MODULES = ("benchmarks.ffcv_peer",)


def _dataloader_builder(cls):
    def build(dataset, *, batch_size, num_workers, collate_fn, persistent, context, **extra):
        kwargs = dict(batch_size=batch_size, num_workers=num_workers, **extra)
        if collate_fn is not None:
            kwargs["collate_fn"] = collate_fn
        if num_workers > 0:
            kwargs.update(multiprocessing_context=context, persistent_workers=persistent)
        return cls(dataset, **kwargs)
    return build


def registry(fastloader_cls, include_peers=True):
    """``(loaders, unavailable)``: name -> LoaderSpec in run order, and name ->
    why a known peer is not available in this environment."""
    loaders = {
        FASTLOADER: LoaderSpec(FASTLOADER, _dataloader_builder(fastloader_cls), "processes",
                               "fastloader.DataLoader", is_peer=False),
        TORCH: LoaderSpec(TORCH, _dataloader_builder(torch.utils.data.DataLoader), "processes",
                          "torch.utils.data.DataLoader", is_peer=False),
    }
    unavailable = {}
    if not include_peers:
        return loaders, unavailable
    for module in (peer_torchdata, peer_spdl):
        found, missing = module.loaders()
        loaders.update(found)
        unavailable.update(missing)
    for module_name in EXTERNAL_PEER_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name:
                continue  # that helper's module is not in this checkout: nothing to merge
            unavailable[module_name] = f"does not import: {error}"
            continue
        except Exception as error:  # noqa: BLE001 - reported, never hidden
            unavailable[module_name] = f"does not import: {type(error).__name__}: {error}"
            continue
        if hasattr(module, "loaders"):  # the same protocol as the peer modules here
            found, missing = module.loaders()
            loaders.update(found)
            unavailable.update(missing)
        else:
            loaders.update(getattr(module, "LOADERS", {}))
    return loaders, unavailable


def in_process_spec(fastloader_cls):
    """fastloader's DataLoader without workers: the efficiency column's baseline."""
    return LoaderSpec(IN_PROCESS, _dataloader_builder(fastloader_cls), "in-process",
                      "fastloader.DataLoader(num_workers=0)", is_peer=False)
