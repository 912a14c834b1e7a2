"""The pruner: finished events past the retention, and the bookkeeping rows that age out.

Every worker prunes, about every ``PRUNE_INTERVAL`` seconds (the first pass
at a random point of the first minute, so a fleet started together does not
prune together). ``failed`` events are never pruned: they wait for a person.
"""

from __future__ import annotations

import random
import time
from typing import Any

import psycopg

from conveyor.config import WorkerConfig
from conveyor.db.named_queries import Queries
from conveyor.types import FINISHED_STATES, EventState
from conveyor.worker.connection import MAINTENANCE_STATEMENT_TIMEOUT

PRUNE_INTERVAL = 600.0
PRUNE_BATCH = 5000
DEAD_WORKER_ROW_AGE = 3600.0
# Outcome counts (event_counts) are kept for the dashboard's charts this long.
COUNTS_KEPT = 8 * 86_400.0
# Fired cron slots are kept a day (their keys guard nothing older: the
# schedules' cursors have moved past them); see migration 0011.
CRON_SLOTS_KEPT = 86_400.0


class Pruner:
    """Deletes what has aged out, every ``PRUNE_INTERVAL`` seconds."""

    name = "pruner"

    def __init__(self, queries: Queries, config: WorkerConfig,
                 rng: random.Random | None = None) -> None:
        self._q = queries
        self._retention = config.retention
        # Pruning a large backlog of finished rows may take a while.
        self.timeout: float | None = max(config.query_timeout, MAINTENANCE_STATEMENT_TIMEOUT)
        self._next = time.monotonic() + (rng or random.Random()).uniform(0, 60)

    def due_at(self) -> float:
        return self._next

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        now = time.monotonic()
        await self.prune(conn)
        self._next = now + PRUNE_INTERVAL

    async def prune(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """Delete succeeded and cancelled events older than the retention."""
        await conn.execute(self._q["worker_prune_dead"], {"older_than": DEAD_WORKER_ROW_AGE})
        await conn.execute(self._q["event_counts_prune"], {"keep": COUNTS_KEPT})
        # One batch per pass is plenty: a one-second schedule fires 600 slots per pass.
        await conn.execute(self._q["cron_slots_prune"], {"keep": CRON_SLOTS_KEPT,
                                                          "limit": PRUNE_BATCH})
        if self._retention is None:
            return 0
        states = [s.value for s in FINISHED_STATES if s is not EventState.FAILED]
        total = 0
        while True:
            cur = await conn.execute(self._q["event_prune"], {
                "older_than": self._retention, "states": states, "limit": PRUNE_BATCH})
            total += cur.rowcount
            if cur.rowcount < PRUNE_BATCH:
                return total
