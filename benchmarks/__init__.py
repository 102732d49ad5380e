"""Benchmarks for fastloader, run as modules (``python -m benchmarks.<name>``).

They are measurements, not tests: every result is a ratio against
``torch.utils.data.DataLoader`` measured in the same run on the same machine,
compared with the budgets in the design document.

- ``benchmarks.throughput``: steady-state throughput and time to first batch
  for the tiny / image / cpu workloads.
- ``benchmarks.harness``: the timing and reporting code the modules share.
- ``benchmarks.datasets``: the synthetic datasets (a module of their own so that
  spawned workers can unpickle them by an importable name).
"""
