"""Periodic maintenance every worker does: heartbeat, lease renewal, rescue, pruning.

It also re-reads whether any topic is paused, twice a second: the fallback
for a worker that does not LISTEN (or missed the notification).

It runs on a connection of its own, on a cadence of its own, and it is the
one that measures the database clock and sends the listener's probe. Rescue
runs on every worker, so events of a dead worker come back as long as any
worker is alive; ``FOR UPDATE SKIP LOCKED`` keeps concurrent rescuers from
fighting over the same rows.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from conveyor.config import WorkerConfig
from conveyor.db.named_queries import Queries
from conveyor.types import FINISHED_STATES, EventState
from conveyor.worker.connection import (
    MAINTENANCE_STATEMENT_TIMEOUT,
    RECOVERABLE_ERRORS,
    ManagedConnection,
)
from conveyor.worker.deadline import with_deadline
from conveyor.worker.lanes import Lanes
from conveyor.worker.running import Key, RunningSet
from conveyor.worker.stats import OutcomeTally, WorkerStats
from conveyor.worker.wakeups import PauseState

log = logging.getLogger(__name__)

PRUNE_INTERVAL = 600.0
CLOCK_SKEW_WARNING = 60.0

RESCUE_BATCH = 1000
PRUNE_BATCH = 5000
DEAD_WORKER_ROW_AGE = 3600.0
# Outcome counts (event_counts) are kept for the dashboard's charts this long.
COUNTS_KEPT = 8 * 86_400.0
# Fired cron slots are kept a day (their keys guard nothing older: the
# schedules' cursors have moved past them); see migration 0011.
CRON_SLOTS_KEPT = 86_400.0
HORIZON_CHECK_INTERVAL = 30.0
HORIZON_REPEAT = 300.0     # a pin that lasts is reported again this often
# Pauses are honoured within 1 s: a re-check every half second leaves the
# other half for the next claim. One read of a table of a few rows.
PAUSE_CHECK_INTERVAL = 0.5


@dataclass(frozen=True, slots=True)
class HorizonHolder:
    """The transaction holding back vacuum the longest, as last seen by the worker."""

    kind: str              # "session", "standby", "replication slot" or "prepared transaction"
    who: str               # "pid 123 (app, idle in transaction)", "replica1 at 10.0.0.7
                           # (walsender pid 99)", a slot's name or a prepared gid
    # How long its transaction has been open; where this role cannot read the
    # start time, how long the worker has seen it (a lower bound).
    seconds: float
    xid_age: int | None    # transactions since its snapshot
    dead_rows: int | None  # dead rows in the events table at the time


class Maintenance:
    """The maintenance service of one worker.

    Args:
        conn: its own connection.
        queries: the schema's named queries.
        config: the worker's settings (lease, intervals, retention, horizon alert).
        owner: the worker's id, the lease owner of its events.
        name: the worker's label in the registry.
        topics: the worker's route patterns, for the registry.
        running: the worker's claimed events, whose leases the heartbeat renews.
        decided: (event id, attempt) of outcomes decided but not yet written:
            a lease missing for one of them is not a lost event.
        stats: the worker's counters (rescued, lost).
        pauses: told whether any pause exists, every ``PAUSE_CHECK_INTERVAL``.
            Defaults to None (no re-check).
        tally: the outcomes the worker has written, added to ``event_counts``
            at each heartbeat. Defaults to None (nothing counted).
        lanes: moves the events no live worker claims to the aside lane and
            back (0018), after the heartbeat of each pass it is due in.
            Defaults to None (no lanes kept).
    """

    def __init__(self, conn: ManagedConnection, queries: Queries, config: WorkerConfig,
                 owner: str, name: str, topics: list[str], running: RunningSet,
                 decided: Callable[[], set[Key]], stats: WorkerStats, *,
                 pauses: PauseState | None = None, tally: OutcomeTally | None = None,
                 lanes: Lanes | None = None) -> None:
        self.conn = conn
        self.lanes = lanes
        self._pause_print: frozenset[tuple[str, str | None]] | None = None   # as last read
        self.tally = tally
        self._pauses = pauses
        self._q = queries
        self._config = config
        self._owner = owner
        self._running = running
        self._decided = decided
        self._stats = stats
        self._rng = random.Random()
        # Database clock minus this machine's, measured with every heartbeat, so a
        # due time announced by the database fires the local timer on time.
        self.clock_offset = 0.0
        self.horizon: HorizonHolder | None = None   # set while the alert stands
        self._first_seen: dict[str, float] = {}    # holders whose start time is hidden
        self._horizon_reported = 0.0
        self.registration = {
            "id": owner, "name": name, "host": socket.gethostname(), "pid": os.getpid(),
            "topics": topics, "concurrency": config.concurrency,
            "tenants": list(config.tenants) if config.tenants is not None else None,
        }

    async def run(self, closing: asyncio.Event) -> None:
        """Each pass when it is due, until ``closing`` is set.

        Runs until nothing is left to acknowledge, not merely until the worker
        stops: handlers still draining after SIGTERM must keep their leases.
        """
        c = self._config
        next_beat = next_rescue = next_pauses = time.monotonic()
        next_prune = time.monotonic() + self._rng.uniform(0, 60)
        # Checked often enough that a pin is reported within 1.25 x the threshold.
        horizon_every = min(HORIZON_CHECK_INTERVAL, (c.horizon_alert_after or 0) / 4) or None
        next_horizon = time.monotonic() + (horizon_every or 0) * self._rng.random()
        while not closing.is_set():
            now = time.monotonic()
            try:
                conn = await self.conn.get(give_up_on_stop=False)
                if now >= next_beat:
                    await self._beat(conn)
                    next_beat = now + c.heartbeat_interval
                if self._pauses is not None and now >= next_pauses:
                    await with_deadline(conn, self.check_pauses(conn), c.query_timeout)
                    next_pauses = now + PAUSE_CHECK_INTERVAL
                if self.lanes is not None and now >= self.lanes.due_at():
                    # After the heartbeat: a bring-back follows this worker's
                    # registry row, so no set-aside can miss it (lanes.py).
                    await with_deadline(conn, self.lanes.run(conn), c.query_timeout)
                if now >= next_rescue:
                    await self._rescue(conn)
                    next_rescue = now + c.rescue_interval * (1 - 0.2 * self._rng.random())
                if horizon_every is not None and now >= next_horizon:
                    await with_deadline(conn, self.check_horizon(conn), c.query_timeout)
                    next_horizon = now + horizon_every
                if now >= next_prune:
                    await self._prune(conn)
                    next_prune = now + PRUNE_INTERVAL
            except RECOVERABLE_ERRORS as exc:
                await self.conn.discard(exc)
                continue
            except psycopg.Error as exc:
                log.error("maintenance failed: %s", exc, extra={"action": "maintenance_failed"})
                await self.conn.pause_after_failure(interruptible=False)
                continue
            sleep_for = max(0.05, min(next_beat, next_rescue,
                                      next_horizon if horizon_every else next_beat,
                                      next_pauses if self._pauses else next_beat,
                                      self.lanes.due_at() if self.lanes else next_beat)
                            - time.monotonic())
            try:
                await asyncio.wait_for(closing.wait(), timeout=sleep_for)
            except TimeoutError:
                pass

    async def run_once(self) -> None:
        """One pass of everything: heartbeat and clock, pauses, lanes, rescue, horizon
        check, pruning."""
        conn = await self.conn.get(give_up_on_stop=False)
        await self._beat(conn)
        await with_deadline(conn, self.check_pauses(conn), self._config.query_timeout)
        if self.lanes is not None:
            await with_deadline(conn, self.lanes.run(conn), self._config.query_timeout)
        await self._rescue(conn)
        await with_deadline(conn, self.check_horizon(conn), self._config.query_timeout)
        await self._prune(conn)

    async def check_pauses(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Tell the pause state which pauses the table holds."""
        if self._pauses is None:
            return
        version = self._pauses.version
        cur = await conn.execute(self._q["pause_list"])
        rows = await cur.fetchall()
        self._pauses.read([(row[0], row[1], row[2]) for row in rows], version)
        if self.lanes is not None:
            # A pause set that changed may have lost one, whose events come back
            # from aside, even without the !pause notification (a poll-only
            # worker, a pause deleted in SQL).
            printed = frozenset((row[0], row[1]) for row in rows)
            if self._pause_print is not None and printed != self._pause_print:
                self.lanes.bring_back_soon()
            self._pause_print = printed

    async def register(self) -> None:
        """Add the worker to the registry; the first heartbeat does it if the database is away."""
        conn = await self.conn.get()
        await conn.execute(self._q["worker_register"], self.registration)

    async def send_probe(self, payload: str) -> None:
        """NOTIFY ``payload`` from this session, so the listener can tell it hears."""
        conn = await self.conn.get()
        await with_deadline(conn, conn.execute(self._q["event_notify"],
                                               {"channel": self._q.channel, "payload": payload}),
                            self._config.query_timeout)

    async def _beat(self, conn: psycopg.AsyncConnection[Any]) -> None:
        bound = self._config.query_timeout
        lost = await with_deadline(conn, self.heartbeat(conn), bound)
        self._stats.lost += self._running.lose(lost, self._decided())
        await with_deadline(conn, self._measure_clock(conn), bound)
        await with_deadline(conn, self.flush_counts(conn), bound)

    async def flush_counts(self, conn: psycopg.AsyncConnection[Any]) -> None:
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

    async def _rescue(self, conn: psycopg.AsyncConnection[Any]) -> None:
        requeued, parked = await with_deadline(conn, self.rescue(conn), self._config.query_timeout)
        self._stats.rescued += requeued + parked

    async def _prune(self, conn: psycopg.AsyncConnection[Any]) -> None:
        # Pruning a large backlog of finished rows may take a while.
        await with_deadline(conn, self.prune(conn), max(self._config.query_timeout,
                                                     MAINTENANCE_STATEMENT_TIMEOUT))

    async def _measure_clock(self, conn: psycopg.AsyncConnection[Any]) -> None:
        before = time.time()
        cur = await conn.execute(self._q["clock_now"])
        row = await cur.fetchone()
        after = time.time()
        if row is None:
            return
        offset = float(row[0]) - (before + after) / 2
        if abs(offset) > CLOCK_SKEW_WARNING and abs(self.clock_offset) <= CLOCK_SKEW_WARNING:
            log.warning("this machine's clock is %.1fs off the database's; schedules follow the "
                        "database", offset, extra={"action": "clock_skew", "offset_s": offset})
        self.clock_offset = offset

    async def heartbeat(self, conn: psycopg.AsyncConnection[Any]) -> set[tuple[int, int]]:
        """Refresh the registry row and this worker's leases; returns the (id, attempt) it lost."""
        await conn.execute(self._q["worker_heartbeat"], self.registration)
        owned = set(self._running.keys())
        if not owned:
            return set()
        cur = await conn.execute(self._q["event_extend_leases"], {
            "ids": sorted({event_id for event_id, _ in owned}), "owner": self._owner,
            "lease_ttl": self._config.lease_ttl})
        kept = {(r[0], r[1]) for r in await cur.fetchall()}
        missing = owned - kept
        if missing:
            # Skipped because locked elsewhere is not lost; look without locking.
            cur = await conn.execute(self._q["event_owned"], {
                "ids": sorted({event_id for event_id, _ in missing}), "owner": self._owner})
            missing -= {(r[0], r[1]) for r in await cur.fetchall()}
        # Pairs acknowledged while the queries ran are not lost; the caller re-checks.
        return missing

    async def unregister(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(self._q["worker_unregister"], {"id": self._owner})

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
                                   {"channel": self._q.channel, "payload": "*"})
            if len(rows) < RESCUE_BATCH:
                return requeued, parked

    async def prune(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """Delete succeeded and cancelled events older than the retention."""
        await conn.execute(self._q["worker_prune_dead"], {"older_than": DEAD_WORKER_ROW_AGE})
        await conn.execute(self._q["event_counts_prune"], {"keep": COUNTS_KEPT})
        # One batch per pass is plenty: a one-second schedule fires 600 slots per pass.
        await conn.execute(self._q["cron_slots_prune"], {"keep": CRON_SLOTS_KEPT,
                                                          "limit": PRUNE_BATCH})
        if self._config.retention is None:
            return 0
        states = [s.value for s in FINISHED_STATES if s is not EventState.FAILED]
        total = 0
        while True:
            cur = await conn.execute(self._q["event_prune"], {
                "older_than": self._config.retention, "states": states, "limit": PRUNE_BATCH})
            total += cur.rowcount
            if cur.rowcount < PRUNE_BATCH:
                return total

    async def check_horizon(self, conn: psycopg.AsyncConnection[Any]) -> HorizonHolder | None:
        """Alert when a transaction has pinned the vacuum horizon past the threshold.

        A pinned horizon is the slow death of any table queue: every finished or
        claimed event leaves a dead row no vacuum may remove, and each claim
        walks more of them. The worker cannot end someone else's transaction;
        it says who holds it, for how long, and what it costs.
        """
        limit = self._config.horizon_alert_after
        if limit is None:
            return None
        cur = await conn.execute(self._q["horizon_holders"])
        rows = await cur.fetchall()
        now = time.monotonic()
        seen: dict[str, float] = {}
        oldest: tuple[float, Any] | None = None
        for row in rows:
            seconds = row[2]
            if seconds is None:
                seen[row[4]] = self._first_seen.get(row[4], now)
                seconds = now - seen[row[4]]
            if oldest is None or seconds > oldest[0]:
                oldest = (seconds, row)
        self._first_seen = seen
        if oldest is None or oldest[0] < limit:
            if self.horizon is not None:
                log.info("vacuum horizon released (was held by %s for %.0fs)",
                         self.horizon.who, self.horizon.seconds,
                         extra={"action": "horizon_released"})
            self.horizon = None
            return None
        seconds, row = oldest
        cur = await conn.execute(self._q["events_dead_rows"], {"table": self._q.events_table})
        dead = await cur.fetchone()
        holder = HorizonHolder(kind=row[0], who=row[1], seconds=float(seconds),
                               xid_age=row[3], dead_rows=dead[0] if dead else None)
        if self.horizon is None or now - self._horizon_reported >= HORIZON_REPEAT:
            self._horizon_reported = now
            log.warning(
                "vacuum horizon pinned for %.0fs by %s %s: dead rows cannot be removed "
                "(%s in the events table) and claims slow down; end that transaction",
                holder.seconds, holder.kind, holder.who,
                "unknown" if holder.dead_rows is None else f"{holder.dead_rows:,}",
                extra={"action": "horizon_pinned", "holder": holder.who,
                       "seconds": round(holder.seconds), "dead_rows": holder.dead_rows})
        self.horizon = holder
        return holder
