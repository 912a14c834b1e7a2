"""This worker's leases and registry row (the heartbeat), and the database clock.

The heartbeat renews the registry row and the lease of every event this
worker holds; an event whose lease it no longer holds (rescued by another
worker after this one stalled) is dropped from the running set, so its late
outcome is never written. Each beat also measures the database clock against
this machine's, so a due time announced by the database fires the local
timer on time.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import psycopg

from conveyor.config import WorkerConfig
from conveyor.db.named_queries import Queries
from conveyor.worker.running import Key, RunningSet
from conveyor.worker.stats import WorkerStats

log = logging.getLogger(__name__)

CLOCK_SKEW_WARNING = 60.0
# The clock readings the offset is chosen from: a few minutes of heartbeats.
CLOCK_SAMPLES = 8
# An early heartbeat asked for by a notification comes at most this often.
LEASE_CHECK_GAP = 0.1


class Lease:
    """The heartbeat service: registry row and leases, every ``heartbeat_interval``.

    ``decided``: (event id, attempt) of outcomes decided but not yet written:
    a lease missing for one of them is not a lost event.
    """

    name = "lease"
    timeout: float | None = None

    def __init__(self, queries: Queries, config: WorkerConfig, owner: str, name: str,
                 topics: list[str], running: RunningSet, decided: Callable[[], set[Key]],
                 stats: WorkerStats) -> None:
        self._q = queries
        self._interval = config.heartbeat_interval
        self._lease_ttl = config.lease_ttl
        self._owner = owner
        self._running = running
        self._decided = decided
        self._stats = stats
        self._next = 0.0
        self._last = -LEASE_CHECK_GAP
        self.registration = {
            "id": owner, "name": name, "host": socket.gethostname(), "pid": os.getpid(),
            "topics": topics, "concurrency": config.concurrency,
            "tenants": list(config.tenants) if config.tenants is not None else None,
        }

    def due_at(self) -> float:
        return self._next

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """One heartbeat; the events whose lease was lost or cancelled leave the running set."""
        now = self._last = time.monotonic()
        lost = await self.heartbeat(conn)
        if lost:
            cur = await conn.execute(self._q["event_cancelled_among"],
                                     {"ids": sorted({event_id for event_id, _ in lost})})
            cancelled = {row[0] for row in await cur.fetchall()}
            stopped = {key for key in lost if key[0] in cancelled}
            decided = self._decided()
            self._stats.cancelled += self._running.lose(stopped, decided, cancelled=True)
            self._stats.lost += self._running.lose(lost - stopped, decided)
        self._next = now + self._interval

    def check_soon(self) -> None:
        """Heartbeat at the next pass (a ``!leases`` notification: a running event was
        cancelled), but not more than once per :data:`LEASE_CHECK_GAP`: any role may
        send that notification, and a flood of them must not become a flood of queries."""
        self._next = min(self._next, self._last + LEASE_CHECK_GAP)

    async def register(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(self._q["worker_register"], self.registration)

    async def unregister(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(self._q["worker_unregister"], {"id": self._owner})

    async def heartbeat(self, conn: psycopg.AsyncConnection[Any]) -> set[Key]:
        """Refresh the registry row and this worker's leases; returns the (id, attempt) it lost."""
        await conn.execute(self._q["worker_heartbeat"], self.registration)
        owned = set(self._running.keys())
        if not owned:
            return set()
        cur = await conn.execute(self._q["event_extend_leases"], {
            "ids": sorted({event_id for event_id, _ in owned}), "owner": self._owner,
            "lease_ttl": self._lease_ttl})
        kept = {(r[0], r[1]) for r in await cur.fetchall()}
        missing = owned - kept
        if missing:
            # Skipped because locked elsewhere is not lost; look without locking.
            cur = await conn.execute(self._q["event_owned"], {
                "ids": sorted({event_id for event_id, _ in missing}), "owner": self._owner})
            missing -= {(r[0], r[1]) for r in await cur.fetchall()}
        # Pairs acknowledged while the queries ran are not lost; the caller re-checks.
        return missing


class DatabaseClock:
    """Measures the database clock minus this machine's, every ``heartbeat_interval``.

    A reading of the database's clock was taken at some moment of its round
    trip: ``offset`` takes the middle, ``wake_offset`` the end, the smallest
    offset the reading allows. A timer for a due time in the database's clock
    set with ``wake_offset`` never fires before that time has come there (on a
    loaded machine a round trip of a second made the middle half a second
    early: the claim found nothing due, and the event waited for the poll).
    Of the last :data:`CLOCK_SAMPLES` readings the one with the shortest round
    trip counts: it bounds the offset most tightly; a reading no offset of the
    best one's allows (a clock was set) starts the count again.
    """

    name = "clock"
    timeout: float | None = None

    def __init__(self, queries: Queries, interval: float) -> None:
        self._q = queries
        self._interval = interval
        self._next = 0.0
        self.offset = 0.0
        self.wake_offset = 0.0
        # (round trip, then the offset at its middle, its smallest and its largest).
        self._samples: deque[tuple[float, float, float, float]] = deque(maxlen=CLOCK_SAMPLES)

    def due_at(self) -> float:
        return self._next

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        now = time.monotonic()
        before = time.time()
        cur = await conn.execute(self._q["clock_now"])
        row = await cur.fetchone()
        after = time.time()
        self._next = now + self._interval
        if row is None:
            return
        self.measured(float(row[0]), before, after)

    def measured(self, database: float, before: float, after: float) -> None:
        """A reading ``database`` of its clock, taken between ``before`` and ``after`` here."""
        low, high = database - after, database - before
        if self._samples:
            _, _, best_low, best_high = min(self._samples)
            if low > best_high or high < best_low:
                self._samples.clear()   # no offset fits both: a clock was set meanwhile
        self._samples.append((high - low, (low + high) / 2, low, high))
        _, offset, self.wake_offset, _ = min(self._samples)
        if abs(offset) > CLOCK_SKEW_WARNING and abs(self.offset) <= CLOCK_SKEW_WARNING:
            log.warning("this machine's clock is %.1fs off the database's; schedules follow the "
                        "database", offset, extra={"action": "clock_skew", "offset_s": offset})
        self.offset = offset
