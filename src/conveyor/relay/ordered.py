"""The ordered relay: one stream per route, in transaction order, never skipping an event.

A route in ``mode="ordered"`` is not served by the worker's claims (which run
events side by side, in claim order); one :class:`OrderedStream` per route
reads its events and publishes them one at a time, each confirmed before the
next is sent, in the order of the transactions that wrote them.

Why a transaction order and not the event ids: ids are handed out when rows
are inserted, transactions commit later, in any order. A reader that follows
ids (the Kafka Connect JDBC source's "incrementing" mode) reads id 11, moves
its cursor past it, and never sees id 10, whose transaction committed a moment
after 11's. Every event remembers the transaction that wrote it (the ``xid``
column, migration 0016; written by a trigger the stream adds for its own
pattern when it first leads, migration 0019, so other topics carry none and
cost the ordered relay's index nothing), and the stream reads only events whose transaction
is older than the oldest transaction still running (its snapshot's xmin), in
(xid, id) order: whatever it has not read yet comes after everything it has.
The price: while a transaction stays open, events of younger transactions
wait for it, however unrelated it is. The stream says so (``held``, a warning
naming the holder) and polls quickly until it ends.

One relay at a time reads a stream: its reading connection holds a session
advisory lock named after the schema and the route, so a relay that dies or
loses its connection hands the stream over at once to the next one waiting.
Events are marked relayed after the broker's confirmation, in batches; a relay
killed between the two publishes those events again, with the same
deduplication ids, so the broker drops them within its window.

An ordered stream never parks an event and moves on: a refused publish is
recorded (attempts, ``last_error``, the history) and retried with backoff, and
the stream waits at that event until it goes through or an operator cancels
it. It also stops at an event a pause holds or one that is not due yet.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from conveyor.db.connect_async import connect_async
from conveyor.db.named_queries import queries_for
from conveyor.db.wake_gate import WakeGate
from conveyor.errors import BrokerUnavailableError, ConfigError
from conveyor.patterns import sql_params
from conveyor.retry import BackoffPolicy
from conveyor.schema.migrator_async import AsyncMigrator
from conveyor.types import Event

if TYPE_CHECKING:
    from conveyor.relay.messages import MessageBuilder, RelayRoute

log = logging.getLogger(__name__)

# How often a relay that does not hold a stream's lock tries again.
LOCK_RETRY = 1.0
# How often a stream looks again while a running transaction holds events back.
HELD_POLL = 0.02
# How often a stream says who holds it back, at most.
HELD_REPORT_EVERY = 10.0
# The longest uninterrupted wait for a notification: a stop waits at most this.
IDLE_SLICE = 0.5
# How often the leading stream renews its row in the worker registry, which
# `conveyor status` and the dashboard read to tell which topics someone serves.
HEARTBEAT_EVERY = 5.0
# Waits after a refused publish, a broker away, a lost database connection.
RETRY_BACKOFF = BackoffPolicy(base_delay=1.0, factor=2.0, max_delay=30.0, jitter=0.2)


@dataclass(frozen=True, slots=True)
class _Row:
    event: Event
    later: bool
    paused: bool


class OrderedStream:
    """Reads one ordered route's events in transaction order and publishes them one by one.

    ``relayed`` counts the events this stream marked relayed; ``leading`` is
    whether it holds the route's lock now; ``blocked_on`` the event id it is
    retrying, or None; ``held`` (events, seconds) while a running transaction
    holds events of the route back, else None.
    """

    def __init__(self, relay: MessageBuilder, route: RelayRoute, conninfo: str, *,
                 schema: str = "conveyor", batch_size: int = 100,
                 poll_interval: float = 1.0, name: str = "relay") -> None:
        self._relay = relay
        self._route = route
        self._conninfo = conninfo
        self._schema = schema
        self._q = queries_for(schema)
        self._batch = batch_size
        self._poll = poll_interval
        self._name = name
        self._filter = sql_params([route.pattern])
        self._key = f"conveyor.relay.ordered:{schema}:{route.pattern}"
        self.name = f"relay-ordered:{route.pattern}"   # as a worker's service
        self._stop = asyncio.Event()
        self.relayed = 0
        self.leading = False
        self.blocked_on: int | None = None
        self.held: tuple[int, float] | None = None
        self._failures = 0
        self._checked = False
        self._ordered = False      # the route's trigger is known to exist
        self._registration = {
            "id": uuid.uuid4(), "name": f"{name} (ordered {route.pattern})",
            "host": socket.gethostname(), "pid": os.getpid(), "topics": [route.pattern],
            "tenants": None, "concurrency": 1}
        self._beat = 0.0
        self._held_checked = 0.0
        self._held_reported = 0.0

    @property
    def pattern(self) -> str:
        return self._route.pattern

    def request_stop(self) -> None:
        """Finish the publish in flight, mark what was confirmed, and return from run()."""
        self._stop.set()

    async def run(self, stopping: asyncio.Event | None = None) -> None:
        """Lead the stream whenever this relay holds its lock, until request_stop().

        ``stopping``: an event that asks the same stop once set; a worker runs
        a stream as one of its services that way (``Worker(services=streams)``).
        """
        watch = None
        if stopping is not None:
            watch = asyncio.ensure_future(stopping.wait())
            watch.add_done_callback(lambda w: None if w.cancelled() else self.request_stop())
        try:
            await self._run()
        finally:
            if watch is not None:
                watch.cancel()

    async def _run(self) -> None:
        lost = 0
        while not self._stop.is_set():
            try:
                conn = await connect_async(self._conninfo, autocommit=True,
                                           application_name="conveyor-relay-ordered")
            except psycopg.OperationalError as exc:
                lost += 1
                await self._again(lost, "cannot connect", exc)
                continue
            try:
                await self._lead(conn)
                lost = 0
            except psycopg.OperationalError as exc:
                lost += 1
                await self._again(lost, "database connection lost", exc)
            finally:
                self.leading = False
                await conn.close()

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> float:
        """One step as the route's leader on ``conn``: its lock taken first if this
        session does not hold it yet, then the next batch published in order.

        Returns how long to wait before the next step (0: at once); without the
        lock, or while transactions writing events hold the trigger back,
        nothing is published.
        """
        if not self.leading:
            if not await self._take_lock(conn) or not await self._order_topics(conn):
                return LOCK_RETRY
            self.leading = True
        await self._heartbeat(conn)
        return await self._step(conn)

    async def _again(self, lost: int, what: str, exc: Exception) -> None:
        delay = RETRY_BACKOFF.delay(lost)
        log.warning("ordered stream %s: %s, again in %.1fs: %s", self.pattern, what, delay, exc,
                    extra={"action": "relay_reconnect"})
        await self._sleep(delay)

    async def _take_lock(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Whether this session holds the route's lock now (tried once)."""
        if not self._checked:
            await AsyncMigrator(self._schema).require_current(conn)   # fatal: raised out of run()
            self._checked = True
        row = await (await conn.execute(self._q["relay_ordered_lock"],
                                        {"key": self._key})).fetchone()
        return row is not None and bool(row[0])

    async def _lead(self, conn: psycopg.AsyncConnection[Any]) -> None:
        while not self._stop.is_set() and not await self._take_lock(conn):
            await self._sleep(LOCK_RETRY)
        if self._stop.is_set():
            return
        self.leading = True
        busy = 0
        while not await self._order_topics(conn):
            busy += 1
            delay = RETRY_BACKOFF.delay(busy)
            log.warning("ordered stream %s: transactions writing events hold its trigger back, "
                        "again in %.1fs", self.pattern, delay,
                        extra={"action": "relay_order_topics_waiting"})
            await self._sleep(delay)
            if self._stop.is_set():
                return
        log.info("ordered stream %s: leading", self.pattern, extra={"action": "relay_leading"})
        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._q.channel)))
        # Held for as long as it leads, so producers wake it (db/wake_gate.py); a
        # slot a producer still holds is tried again before each read until held.
        gate = WakeGate(self._q)
        self._beat = 0.0
        try:
            while not self._stop.is_set():
                await self._heartbeat(conn)
                await gate.hold(conn)
                wait = await self._step(conn)
                if wait and not self._stop.is_set():
                    await self._idle(conn, gate.retry_in(wait))
        finally:
            if not conn.closed and not conn.broken:
                # Best effort: a row left behind ages out of the registry by itself.
                try:
                    await conn.execute(self._q["worker_unregister"], self._registration)
                except psycopg.Error:
                    pass

    async def _order_topics(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Make sure the route's events carry their transaction's id (its trigger, 0019);
        False when transactions writing events kept the trigger from being created."""
        if self._ordered:
            return True
        try:
            cur = await conn.execute(self._q["relay_order_topics"], {"pattern": self.pattern})
        except psycopg.errors.LockNotAvailable:
            return False
        except psycopg.errors.InsufficientPrivilege as exc:
            raise ConfigError(
                f"the ordered stream {self.pattern!r} needs its trigger on "
                f"{self._schema}.events_live and this role may not create it: run "
                f"SELECT {self._schema}.order_topics('{self.pattern}') once as the table's "
                f"owner ({exc.diag.message_primary})") from None
        row = await cur.fetchone()
        stamped = row[0] if row else None
        if stamped is not None:
            log.info("ordered stream %s: its topics' events carry their transaction id from now "
                     "on (%d pending ones before it in id order)", self.pattern, stamped,
                     extra={"action": "relay_order_topics"})
        self._ordered = True
        return True

    async def _heartbeat(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Keep this stream in the worker registry as the one serving its route's topics."""
        now = time.monotonic()
        if now - self._beat >= HEARTBEAT_EVERY:
            await conn.execute(self._q["worker_heartbeat"], self._registration)
            self._beat = now

    async def _step(self, conn: psycopg.AsyncConnection[Any]) -> float:
        """Publish the next batch in order; how long to wait for a wake-up (0: go on at once)."""
        cur = await conn.execute(self._q["relay_ordered_next"],
                                 {**self._filter, "limit": self._batch})
        rows = [_Row(Event(id=r[0], tenant=r[1], topic=r[2], payload_text=r[3],
                           attempt=r[4] + 1, traceparent=r[5], tracestate=r[6]), r[7], r[8])
                for r in await cur.fetchall()]
        confirmed: list[int] = []
        backoff = 0.0
        stopped_at = False
        try:
            for row in rows:
                if row.later or row.paused or self._stop.is_set():
                    stopped_at = True
                    break
                backoff = await self._publish(conn, row.event)
                if backoff:
                    break
                confirmed.append(row.event.id)
        finally:
            if confirmed:
                await conn.execute(self._q["relay_ordered_done"], {"ids": confirmed})
                self.relayed += len(confirmed)
        if backoff:
            # Not cut short by a notification: the same event is tried again after it.
            end = time.monotonic() + backoff
            while not self._stop.is_set() and (left := end - time.monotonic()) > 0:
                await self._sleep(min(left, HEARTBEAT_EVERY))
                await self._heartbeat(conn)
            return 0.0
        if stopped_at:
            return self._poll
        if len(rows) == self._batch:
            return 0.0
        return await self._held_back(conn)

    async def _publish(self, conn: psycopg.AsyncConnection[Any], event: Event) -> float:
        """0 once the broker confirmed ``event``; else the backoff before it is tried again."""
        route = self._route
        try:
            await route.publisher.publish(self._relay.message(route, event))
        except BrokerUnavailableError as exc:
            self._failures += 1
            delay = RETRY_BACKOFF.delay(self._failures)
            log.warning("%s unavailable, ordered stream %s waits %.1fs at event %d: %s",
                        route.publisher.name, self.pattern, delay, event.id, exc,
                        extra={"action": "relay_unavailable"})
            self.blocked_on = event.id
            return delay
        except Exception as exc:  # noqa: BLE001 - a refusal, or the publisher's own error
            self._failures += 1
            delay = RETRY_BACKOFF.delay(self._failures)
            error = f"{type(exc).__name__}: {exc}"
            await conn.execute(self._q["relay_ordered_failed"],
                               {"id": event.id, "error": error[:2000], "relay": self._name})
            log.error("ordered stream %s stays at event %d (attempt %d), again in %.1fs: %s",
                      self.pattern, event.id, event.attempt, delay, error,
                      extra={"action": "relay_refused", "event_id": event.id})
            self.blocked_on = event.id
            return delay
        self._failures = 0
        self.blocked_on = None
        return 0.0

    async def _held_back(self, conn: psycopg.AsyncConnection[Any]) -> float:
        """The wait after a short batch: quick while a running transaction holds events back."""
        now = time.monotonic()
        if self.held is None and now - self._held_checked < self._poll:
            return self._poll
        self._held_checked = now
        row = await (await conn.execute(self._q["relay_ordered_held"], self._filter)).fetchone()
        if row is None or not row[0]:
            self.held = None
            return self._poll
        self.held = (int(row[0]), float(row[1] or 0.0))
        if now - self._held_reported >= HELD_REPORT_EVERY:
            self._held_reported = now
            holder = await (await conn.execute(self._q["horizon_holders"])).fetchone()
            who = f"{holder[1]}" if holder is not None else "a transaction still running"
            log.warning("ordered stream %s: %d events wait (oldest %.1fs) for %s to end",
                        self.pattern, self.held[0], self.held[1], who,
                        extra={"action": "relay_held"})
        return HELD_POLL

    async def _idle(self, conn: psycopg.AsyncConnection[Any], timeout: float) -> None:
        """Wait up to ``timeout``, less if an event is committed or a stop is asked.

        In slices of at most half a second: a wait for notifications cannot be
        interrupted without leaving the connection unusable, so a stop is seen
        between slices.
        """
        end = time.monotonic() + timeout
        while not self._stop.is_set() and (left := end - time.monotonic()) > 0:
            async for _ in conn.notifies(timeout=min(left, IDLE_SLICE), stop_after=1):
                return

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        except TimeoutError:
            pass
