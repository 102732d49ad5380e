"""Benchmarks for fastloader, run as modules (``python -m benchmarks.<name>``).

They are measurements, not tests: every result is a ratio against
``torch.utils.data.DataLoader`` measured in the same run on the same machine,
compared with the budgets in the design document.

- ``benchmarks.run``: everything below in one go, plus ``summary.json`` and the
  charts in ``benchmarks/results/`` (what ``make bench`` runs).
- ``benchmarks.throughput``: steady-state throughput and time to first batch
  for the tiny / image / tokens / cpu workloads, and the main process's
  per-batch ``next()`` overhead (next_overhead), against their budgets.
- ``benchmarks.scaling``: samples/s by worker count and batch size.
- ``benchmarks.memory``: per-worker USS over an epoch.
- ``benchmarks.charts``: PNG charts of a ``benchmarks.run`` summary.
- ``benchmarks.harness``: the timing and reporting code the modules share.
- ``benchmarks.datasets``: the synthetic datasets (a module of their own so that
  spawned workers can unpickle them by an importable name).
"""
