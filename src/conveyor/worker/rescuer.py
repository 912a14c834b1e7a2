"""The rescuer: events whose lease expired go back to pending (or are parked).

Rescue runs on every worker, so events of a dead worker come back as long as
any worker is alive; ``FOR UPDATE SKIP LOCKED`` keeps concurrent rescuers
from fighting over the same rows.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import psycopg

from conveyor.db.named_queries import Queries
from conveyor.notify import WAKE_ALL
from conveyor.types import EventState
from conveyor.worker.stats import WorkerStats

log = logging.getLogger(__name__)

RESCUE_BATCH = 1000
# A claim window's record older than this names events long since claimed
# again (or finished, or cancelled): no window lasts more than seconds.
WINDOW_RECORD_TTL = 86_400.0


class Rescuer:
    """Rescues expired leases about every ``interval`` seconds (up to 20 % sooner).

    ``windows``: this worker holds claim windows (worker/window.py), and its
    passes also drop the windows' records no claim will meet again.
    """

    name = "rescuer"
    timeout: float | None = None

    def __init__(self, queries: Queries, interval: float, stats: WorkerStats,
                 rng: random.Random | None = None, *, windows: bool = False) -> None:
        self._q = queries
        self._windows = windows
        self._interval = interval
        self._stats = stats
        self._rng = rng or random.Random()
        self._next = 0.0

    def due_at(self) -> float:
        return self._next

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        now = time.monotonic()
        requeued, parked = await self.rescue(conn)
        self._stats.rescued += requeued + parked
        if self._windows:
            await conn.execute(self._q["claim_window_prune"], {"older_than": WINDOW_RECORD_TTL})
        self._next = now + self._interval * (1 - 0.2 * self._rng.random())

    async def rescue(self, conn: psycopg.AsyncConnection[Any]) -> tuple[int, int]:
        """Return expired leases to pending (or park them); returns (requeued, parked)."""
        requeued = parked = 0
        while True:
            cur = await conn.execute(self._q["event_rescue_expired"], {"limit": RESCUE_BATCH})
            rows = await cur.fetchall()
            for event_id, state, topic in rows:
                if state == EventState.PENDING:
                    requeued += 1
                else:
                    parked += 1
                log.warning("event %s rescued from a lost worker -> %s", event_id, state,
                            extra={"action": "rescued", "event_id": event_id, "topic": topic})
            if requeued:
                await conn.execute(self._q["event_notify"],
                                   {"channel": self._q.channel, "payload": WAKE_ALL})
            if len(rows) < RESCUE_BATCH:
                return requeued, parked
