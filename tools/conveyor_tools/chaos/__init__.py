"""Chaos tooling: a ledger of what handlers did, and a checker of what the queue lost.

* :mod:`conveyor_tools.chaos.ledger` records every handler call (start and
  finish, with a snapshot of the event's row) over a connection of its own;
  ``--app conveyor_tools.chaos:chaos_router`` serves ``chaos.*`` with a
  recorded sleeper steered by the payload.
* :mod:`conveyor_tools.chaos.checker` holds the ledger against the events
  table: lost, unexpected, duplicated and overlapping executions.

``benchmarks/chaos.py`` runs worker processes under faults and checks them
with these; see docs/reliability.md.
"""

from conveyor_tools.chaos.checker import (
    CheckReport,
    Execution,
    check,
    check_records,
    percentile,
    read_executions,
)
from conveyor_tools.chaos.ledger import (
    CANCELLED,
    LEDGER_URL_ENV,
    RAISED,
    SUCCEEDED,
    LedgerWriter,
    chaos_router,
    create_ledger,
    default_writer,
    ledger_ddl,
    ledger_router,
    recorded,
)

__all__ = [
    "CANCELLED",
    "LEDGER_URL_ENV",
    "RAISED",
    "SUCCEEDED",
    "CheckReport",
    "Execution",
    "LedgerWriter",
    "chaos_router",
    "check",
    "check_records",
    "create_ledger",
    "default_writer",
    "ledger_ddl",
    "ledger_router",
    "percentile",
    "read_executions",
    "recorded",
]
