"""The worker's cron loop: fires the router's schedules, once per slot across all workers.

Each worker whose router declares schedules runs this loop on a connection
of its own (a firing is a transaction, which must not interleave with the
heartbeat's statements). It sleeps until the earliest next slot, then fires
each due schedule in one transaction (``cron_lock``, ``cron_fire``,
``cron_advance`` in conveyor/db/queries/cron.sql): the schedule's row
locked with SKIP LOCKED, so a worker finding another one firing it leaves
it be; the slots' unique keys and events inserted together; the cursor
moved on. Slots come from the database's clock, never this machine's.

An operator may change a schedule's expression or disable it at run time
(``Admin.set_schedule``, migration 0023): ``cron_lock`` returns the override
and whether the schedule is enabled with the row it locks, so every firing
uses the operator's expression when there is one, and a disabled schedule's
slots are settled without firing. A ``!control`` notification (:meth:`poke`)
has the loop look at every schedule again within MAX_SLEEP; the periodic
declaration does too, should a notification be missed.

A failure of the loop itself is logged with its traceback and the loop
starts again after a pause; :attr:`Scheduler.last_pass` tells ``/healthz``
whether it is still turning (see conveyor.metrics.health).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import psycopg

from conveyor.cron import Schedule
from conveyor.db.named_queries import Queries
from conveyor.notify import wake_payload
from conveyor.retry import BackoffPolicy
from conveyor.worker.backoff import Backoff
from conveyor.worker.connection import RECOVERABLE_ERRORS, ManagedConnection, StopRequested
from conveyor.worker.deadline import with_deadline
from conveyor.worker.service import sleep_unless

log = logging.getLogger(__name__)

# The loop looks again at least this often (seconds), so a changed clock
# offset or a slot another worker was firing is seen soon.
MAX_SLEEP = 1.0
MIN_SLEEP = 0.005
# After finding a schedule's row locked (another worker firing it), look again after this.
LOCKED_RETRY = 0.05
# Schedules are declared again this often, so one removed while a worker
# still declares it comes back.
DECLARE_INTERVAL = 60.0
# After an unexpected error in the loop, it starts again after this pause
# (metrics.health allows for it: a failing pass keeps the worker healthy).
FAILURE_PAUSE = 1.0
_FAILURE_POLICY = BackoffPolicy(base_delay=FAILURE_PAUSE, factor=1.0, max_delay=FAILURE_PAUSE,
                                jitter=0.0)


class Scheduler:
    """Fires ``schedules`` from one worker, a :class:`~conveyor.worker.service.Service`
    on its own connection; see the module docstring.

    ``clock``: a callable returning the current time as an aware datetime, for
    tests that move time; by default the database's clock (``now()``).
    ``clock_offset``: the database's clock minus this machine's, in seconds,
    to know locally when the next slot is due.
    """

    name = "cron"

    def __init__(self, conn: ManagedConnection, queries: Queries, schedules: Sequence[Schedule],
                 *, query_timeout: float, clock_offset: Callable[[], float],
                 clock: Callable[[], datetime] | None = None) -> None:
        self.conn = conn
        self.schedules = tuple(schedules)
        self._q = queries
        self._query_timeout = query_timeout
        self._clock_offset = clock_offset
        self._clock = clock
        # When each schedule is next due, in epoch seconds on the schedules' clock;
        # 0 looks at once (at the start nothing is known).
        self._next: dict[str, float] = {s.name: 0.0 for s in self.schedules}
        # The schedules as they fire: with the operator's expression when one is set.
        self._effective: dict[str, Schedule] = {s.name: s for s in self.schedules}
        self._declared_at = -math.inf
        self.fired = 0          # events enqueued by this worker's firings
        self.skipped = 0        # slots it found past their catch-up window
        self.failures = 0       # unexpected errors of the loop, each logged
        self.last_pass = time.monotonic()   # when the loop last completed a pass
        self._backoff = Backoff(_FAILURE_POLICY)

    def _now(self) -> float:
        if self._clock is not None:
            return self._clock().timestamp()
        return time.time() + self._clock_offset()

    async def run(self, stopping: asyncio.Event) -> None:
        """Fire until ``stopping`` is set."""
        while not stopping.is_set():
            try:
                conn = await self.conn.get()
                await self.run_once(conn)
                self.last_pass = time.monotonic()
            except StopRequested:
                return
            except RECOVERABLE_ERRORS as exc:
                await self.conn.discard(exc)
                continue
            except Exception:   # reported with its traceback, and the loop goes on
                self.failures += 1
                pause = self._backoff.next_delay()
                log.exception("cron scheduler pass failed; starting again in %.0fs", pause,
                              extra={"action": "cron_failed"})
                await sleep_unless(stopping, pause)
                continue
            self._backoff.reset()
            wait = min(self._next.values(), default=math.inf) - self._now()
            await sleep_unless(stopping, min(MAX_SLEEP, max(MIN_SLEEP, wait)))

    def poke(self) -> None:
        """An operator changed a schedule: look at each one again (its row says how)."""
        for name in self._next:
            self._next[name] = 0.0

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Declare the schedules when due, and fire every schedule whose next slot has come."""
        if time.monotonic() - self._declared_at >= DECLARE_INTERVAL:
            await with_deadline(conn, self.declare(conn), self._query_timeout)
            self._declared_at = time.monotonic()
            self.poke()     # and read the operator's overrides, should a NOTIFY have been missed
        for schedule in self.schedules:
            if self._next[schedule.name] <= self._now():
                await with_deadline(conn, self.fire(conn, schedule), self._query_timeout)

    async def declare(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Insert or update this worker's schedules (new ones start now)."""
        s = self.schedules
        await conn.execute(self._q["cron_declare"], {
            "names": [x.name for x in s], "expressions": [x.expression for x in s],
            "timezones": [x.timezone for x in s], "topics": [x.topic for x in s],
            "catch_ups": [x.catch_up for x in s],
            "now": self._clock() if self._clock is not None else None})

    def _follow(self, declared: Schedule, override: str | None) -> Schedule:
        """``declared`` with the operator's expression, if one is set (kept for the wait)."""
        current = self._effective[declared.name]
        wanted = override or declared.expression
        if current.expression != wanted:
            current = dataclasses.replace(declared, expression=wanted)
            self._effective[declared.name] = current
            log.info("cron schedule %r fires on %r%s", declared.name, wanted,
                     " (set by an operator)" if override else " (as declared)",
                     extra={"action": "cron_changed", "schedule": declared.name})
        return current

    async def fire(self, conn: psycopg.AsyncConnection[Any], schedule: Schedule) -> int:
        """Fire ``schedule``'s due slots in one transaction; returns the events enqueued."""
        q = self._q
        test_now = self._clock() if self._clock is not None else None
        async with conn.transaction():
            cur = await conn.execute(q["cron_lock"], {"name": schedule.name, "now": test_now})
            row = await cur.fetchone()
            if row is None:
                # Another worker holds the row and is firing it (or it was removed
                # and comes back with the next declaration): look again shortly.
                self._next[schedule.name] = self._now() + LOCKED_RETRY
                return 0
            fired_through, now, override, enabled = row
            schedule = self._follow(schedule, override)
            if not enabled:
                # Disabled by an operator: its slots pass unfired and uncounted, and
                # it has no next slot until it is enabled (a poke looks again).
                await conn.execute(q["cron_advance"], {
                    "name": schedule.name, "through": now, "next_fire_at": None,
                    "fired": 0, "last_fired_at": None, "missed": 0})
                self._next[schedule.name] = math.inf
                return 0
            fire, skipped, through = schedule.due(fired_through, now)
            fired = 0
            if fire:
                cur = await conn.execute(q["cron_fire"], {
                    "name": schedule.name, "table": q.events_table, "fire_ats": fire,
                    "tenant": schedule.tenant, "topic": schedule.topic,
                    "payload": schedule.payload, "priority": schedule.priority,
                    "max_attempts": schedule.max_attempts})
                fired = (await cur.fetchone() or (0,))[0]
                if fired:
                    # Delivered at commit, with the events.
                    await conn.execute(q["event_notify"],
                                       {"channel": q.channel,
                                        "payload": wake_payload(schedule.topic)})
            following = schedule.next_after(through)
            await conn.execute(q["cron_advance"], {
                "name": schedule.name, "through": through, "next_fire_at": following,
                "fired": fired, "last_fired_at": fire[-1] if fire else None,
                "missed": skipped})
        self.fired += fired
        if skipped:
            self.skipped += skipped
            log.warning("cron schedule %r skipped %d slot(s) older than its catch-up window of "
                        "%gs (up to %s)", schedule.name, skipped, schedule.catch_up,
                        through.isoformat(), extra={"action": "cron_missed",
                                                    "schedule": schedule.name, "missed": skipped})
        if through < now:
            self._next[schedule.name] = 0.0          # stopped at the walk's limit: go on at once
        elif following is None:
            self._next[schedule.name] = math.inf     # the expression never fires again
        else:
            self._next[schedule.name] = following.timestamp()
        return fired
