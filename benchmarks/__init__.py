"""Benchmarks for fastloader, run as modules (``python -m benchmarks.<name>``).

They are measurements, not tests: every result is a ratio against
``torch.utils.data.DataLoader`` measured in the same run on the same machine,
compared with the budgets in the design document; the peers (torchdata, SPDL)
run in the same runs, side by side.

- ``benchmarks.run``: everything below in one go, plus ``summary.json`` and the
  charts in ``benchmarks/results/`` (what ``make bench`` runs).
- ``benchmarks.throughput``: steady-state throughput, efficiency, peak PSS and
  time to first batch for the tiny / tiny_batched / image / tokens / cpu /
  decode workloads, for fastloader, torch and every peer, and the main
  process's per-batch ``next()`` overhead (next_overhead), against the budgets.
- ``benchmarks.loaders``: the registry of loaders the throughput step runs
  (``loader_spec``: what it holds; ``peer_torchdata``, ``peer_spdl``: the
  peers; ``batch_fetch``: the fetch-a-batch-and-collate step they share).
- ``benchmarks.pss``: the sampler process behind the peak PSS column.
- ``benchmarks.scaling``: samples/s by worker count and batch size.
- ``benchmarks.memory``: per-worker USS over an epoch.
- ``benchmarks.charts``: PNG charts of a ``benchmarks.run`` summary.
- ``benchmarks.harness``: the timing and reporting code the modules share.
- ``benchmarks.datasets``: the synthetic datasets, and the JPEG images of the
  decode workload (a module of their own so that spawned workers can unpickle
  them by an importable name).
"""
