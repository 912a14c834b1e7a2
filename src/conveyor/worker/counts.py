"""The outcome counts of the dashboard's charts (event_counts, migration 0008).

The worker tallies its written outcomes by minute and topic in memory
(:class:`~conveyor.worker.stats.OutcomeTally`); this service adds them to
``event_counts`` with every heartbeat, one statement for all of them.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from conveyor.db.named_queries import Queries
from conveyor.worker.stats import OutcomeTally


class CountsFlush:
    """Adds the tally to ``event_counts`` every ``interval`` seconds."""

    name = "counts"
    timeout: float | None = None

    def __init__(self, queries: Queries, tally: OutcomeTally | None, interval: float) -> None:
        self._q = queries
        self.tally = tally
        self._interval = interval
        self._next = 0.0

    def due_at(self) -> float:
        return self._next

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        now = time.monotonic()
        await self.flush(conn)
        self._next = now + self._interval

    async def flush(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Add the outcomes tallied since the last flush to ``event_counts``.

        On any error the counts go back into the tally for the next heartbeat:
        a chart may lag, but no count is added twice or dropped while the
        worker lives.
        """
        tally = self.tally
        if not tally:
            return
        taken = tally.take()
        try:
            await conn.execute(self._q["event_counts_add"], OutcomeTally.params(taken))
        except BaseException:
            tally.put_back(taken)
            raise
