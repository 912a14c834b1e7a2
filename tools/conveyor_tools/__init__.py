"""Conveyor's tooling, kept out of the library: the benchmark, the demo, chaos runs.

* :mod:`conveyor_tools.bench`: ``conveyor bench``, Conveyor against a raw-SQL
  baseline in one run;
* :mod:`conveyor_tools.demo`: ``conveyor demo``, the guided tour;
* :mod:`conveyor_tools.chaos`: the execution ledger and the total-queue
  checker that ``benchmarks/chaos.py`` and the chaos tests use.

The two commands reach the ``conveyor`` CLI through the ``conveyor.commands``
entry points declared in tools/pyproject.toml.
"""
