"""The pruner: finished events past the retention, and the bookkeeping rows that age out.

Every worker prunes, about every ``PRUNE_INTERVAL`` seconds (the first pass
at a random point of the first minute, so a fleet started together does not
prune together). ``failed`` events are never pruned: they wait for a person.

The pruner shares the maintenance loop (and its connection) with the
heartbeat, the rescuer, the pause check and the dependencies, so a pass
deletes for at most ``PRUNE_SLICE`` seconds and then lets them have their
turn, going on after a pause as long as the slice (so at most half the
loop's time). At 7,000 events/s a pass finds 4 million rows: deleted in one
go, that took minutes in the soak of 2026-12-03, minutes without a lease
renewed (``lease_ttl`` is 15 s), a pause noticed or a chord's callback
released. A batch waits at most ``PRUNE_LOCK_TIMEOUT`` for a row another
transaction holds, and is then taken again past the held rows.

The history (0025, docs/history-partitions.md) goes a partition at a time
(a day, or the shorter span of 0026): each pass drops the partitions past
the retention and makes those of the next ``HISTORY_AHEAD`` seconds (the
worker's start-up makes them too), so acknowledgements always find theirs;
the rows it deletes one by one are those finished in the live partition
(before 0025, keyed events, a worker that may not create tables).
"""

from __future__ import annotations

import logging
import random
import time
from datetime import datetime
from typing import Any

import psycopg
from psycopg import errors
from psycopg.rows import dict_row

from conveyor.config import WorkerConfig
from conveyor.db.named_queries import Queries
from conveyor.types import FINISHED_STATES, EventState
from conveyor.worker.sessions import MAINTENANCE_STATEMENT_TIMEOUT

log = logging.getLogger(__name__)

PRUNE_INTERVAL = 600.0
PRUNE_BATCH = 5000
# Seconds of deleting before the maintenance loop's other services get their
# turn: well inside the heartbeat's interval (5 s by default).
PRUNE_SLICE = 0.5
PRUNE_LOCK_TIMEOUT = "200ms"
DEAD_WORKER_ROW_AGE = 3600.0
# Outcome counts (event_counts) are kept for the dashboard's charts this long.
COUNTS_KEPT = 8 * 86_400.0
# Fired cron slots are kept a day (their keys guard nothing older: the
# schedules' cursors have moved past them); see migration 0011.
CRON_SLOTS_KEPT = 86_400.0


# How far ahead the history's partitions are made: a pass every
# PRUNE_INTERVAL keeps tomorrow's day ready long before it starts (partitions
# shorter than a day: 24 of them at most, history_make in 0026).
HISTORY_AHEAD = 86_400.0


# Failed events wait for a person: never pruned.
_PRUNED_STATES = [s.value for s in FINISHED_STATES if s is not EventState.FAILED]


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
        # The pass under way: when it started and how many events it has deleted.
        self._pass: tuple[float, int] | None = None
        # Whether this worker's role may make and drop the history's
        # partitions; refused once, the rows of later ones stay live and are
        # deleted.
        self._history = True
        # When the partitions made last will be half used up (the database's
        # clock), for a multi-tenant worker's turns to make more then.
        self.history_due: datetime | None = None

    def due_at(self) -> float:
        return self._next

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        now = time.monotonic()
        if self._pass is None:
            self._pass = (now, 0)
            await self._prune_bookkeeping(conn)
            await self.keep_history(conn)
        deleted, done = await self._prune_events(conn, until=now + PRUNE_SLICE)
        started, total = self._pass
        total += deleted
        if not done:
            self._pass = (started, total)
            self._next = time.monotonic() + (time.monotonic() - now)
            return
        self._pass = None
        self._next = started + PRUNE_INTERVAL
        if total:
            log.info("pruned %d finished events in %.1f s", total, time.monotonic() - started,
                     extra={"action": "pruned", "count": total})

    async def prune(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """Delete succeeded and cancelled events older than the retention, all at once."""
        await self._prune_bookkeeping(conn)
        await self.keep_history(conn)
        deleted, _ = await self._prune_events(conn, until=None)
        return deleted

    async def keep_history(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Make the history's next partitions and drop those past the retention."""
        if not self._history:
            return
        try:
            async with conn.transaction():
                by_name = conn.cursor(row_factory=dict_row)
                made = await (await by_name.execute(self._q["history_make"],
                                                    {"ahead": HISTORY_AHEAD})).fetchone()
            self.history_due = made["due"] if made else None
            if self._retention is not None:
                async with conn.transaction():
                    cur = await conn.execute(self._q["history_drop"],
                                             {"older_than": self._retention})
                    row = await cur.fetchone()
                if row and row[0]:
                    log.info("dropped %d partition(s) of finished events past the retention",
                             row[0], extra={"action": "history_dropped", "count": row[0]})
        except errors.InsufficientPrivilege as exc:
            self._history = False
            log.warning("finished events stay in the live partition, deleted row by row: this "
                        "role may not make the history's partitions (%s); run the worker as the "
                        "schema's owner, or SELECT %s.history_make('1 day') daily as it",
                        exc.diag.message_primary, self._q.schema,
                        extra={"action": "history_refused"})
        except (errors.LockNotAvailable, errors.DuplicateTable) as exc:
            # A partition's DDL waited its half second, or a table of that name is in
            # the way: the acknowledgements keep to the days made; the next
            # pass tries again.
            log.warning("could not make or drop the history's partitions: %s", exc.diag.message_primary,
                        extra={"action": "history_deferred"})

    async def _prune_bookkeeping(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(self._q["worker_prune_dead"], {"older_than": DEAD_WORKER_ROW_AGE})
        await conn.execute(self._q["event_counts_prune"], {"keep": COUNTS_KEPT})
        # One batch per pass is plenty: a one-second schedule fires 600 slots per pass.
        await conn.execute(self._q["cron_slots_prune"], {"keep": CRON_SLOTS_KEPT,
                                                          "limit": PRUNE_BATCH})

    async def _prune_events(self, conn: psycopg.AsyncConnection[Any],
                            until: float | None) -> tuple[int, bool]:
        """Delete in batches until none is left (True) or ``until`` has passed (False)."""
        if self._retention is None:
            return 0, True
        params = {"older_than": self._retention, "states": _PRUNED_STATES,
                  "limit": PRUNE_BATCH}
        total = 0
        while True:
            deleted = await self._batch(conn, params)
            total += deleted
            if deleted < PRUNE_BATCH:
                return total, True
            if until is not None and time.monotonic() >= until:
                return total, False

    async def _batch(self, conn: psycopg.AsyncConnection[Any], params: dict[str, Any]) -> int:
        for query in ("event_prune_live", "event_prune_live_skip_locked"):
            try:
                async with conn.transaction():
                    await conn.execute(self._q["prune_lock_timeout"],
                                       {"timeout": PRUNE_LOCK_TIMEOUT})
                    cur = await conn.execute(self._q[query], params)
                return cur.rowcount
            except errors.LockNotAvailable:
                continue    # a row of the batch is held: take the batch past it
        return 0
