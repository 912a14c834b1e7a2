"""Claim windows: a batch held in the claim's transaction, written once.

A leased claim writes every event twice: the claim makes it ``running`` under
a lease, the acknowledgement writes its outcome. With
``WorkerConfig.claim_window`` the fetch loop claims by locking instead
(``event_claim_held``, ``FOR NO KEY UPDATE SKIP LOCKED``, no write), starts
the handlers at once, and keeps the transaction open until every event of the
batch has its outcome or the window ends. Then, in that transaction, it writes
the outcomes (the acknowledgement's statements, fenced by the locks:
:func:`~conveyor.worker.acks.ack` with ``held``), leases the events still
running (``event_lease_held``: from there on they are leased events, their
outcomes written by the completer) and commits. A fast event costs one row
version and half the WAL (docs/held-claims.md has the figures).

What a window changes and what it keeps:

- A worker that dies inside a window loses nothing: its transaction rolls
  back as its connection drops, and the events are pending again at once.
- The attempt that died is not written by the rollback, so before the
  handlers start the window's batch is recorded on a connection of its own
  (:mod:`~conveyor.worker.window_record`); the window's commit deletes the
  record. A record left behind names attempts that ran: the next window that
  claims one of its events leases its whole batch at once, those attempts
  counted (``event_claim_crashed``), so a poison event that kills its worker
  still runs out of attempts and is parked.
- While a window is open its events read ``pending``: other workers skip
  them, an operator's cancel waits for the window's end, and the heartbeat
  leaves them out (:attr:`RunningSet.windowed`).
- A window whose transaction fails (a lost connection) wrote nothing: its
  handlers are stopped as on a lost lease, and their events run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from conveyor.db.arrays import int_array
from conveyor.db.named_queries import Queries
from conveyor.types import Event
from conveyor.worker.acks import ack, finished_notice
from conveyor.worker.classify import Outcome
from conveyor.worker.connection import CursorCache, ManagedConnection
from conveyor.worker.deadline import StopFlag, with_deadline_in_task
from conveyor.worker.running import Key, RunningSet
from conveyor.worker.window_record import WindowRecord

log = logging.getLogger(__name__)


def _statements(parts: list[str]) -> str:
    """Statements sent as one string: one round trip for all, as each statement on
    the wire costs the worker's CPU (measured: docs/held-claims.md); the parameters
    are bound on this side (psycopg's AsyncClientCursor) and the results read with
    ``nextset``."""
    # A line of its own: a statement may end in a comment.
    return "\n;\n".join(parts)


class ClaimWindow:
    """One held batch: its events, and the outcomes they reach while it is open."""

    def __init__(self, number: int, events: list[Event]) -> None:
        self.number = number
        self.events = events
        self.keys: set[Key] = {(e.id, e.attempt) for e in events}
        self._waiting = set(self.keys)
        self.outcomes: list[Outcome] = []
        # Outcomes that came while the window committed: their events' leases
        # are in that commit, so they go to the completer after it (late).
        self.late: list[Outcome] = []
        self.closing = False
        self.all_in = asyncio.Event()
        self.opened = time.monotonic()

    def take(self, key: Key, outcome: Outcome) -> bool:
        """Keep ``outcome`` of the event ``key`` if it is its first while the window is
        open, or while it commits (:attr:`late`)."""
        waiting = self._waiting
        if key not in waiting:
            return False
        if self.closing:
            self.late.append(outcome)
            return True
        waiting.remove(key)
        self.outcomes.append(outcome)
        if not waiting:
            self.all_in.set()
        return True

    def unfinished(self) -> list[Event]:
        """The events without an outcome: to be leased as the window closes."""
        return [e for e in self.events if (e.id, e.attempt) in self._waiting]


class ClaimWindows:
    """Opens the fetch loop's claim windows and closes them, up to one per claim
    connection at a time.

    Each window holds one claim connection's transaction until it closes; the
    fetch loop claims the next batch on another while it is open, so the
    database claims and writes while handlers run, as with leased claims (one
    connection per window in flight: two, the fetch connection and one more).

    Args:
        claimers: the connections the windows' transactions run on.
        record: the connection the windows' records are committed on.
        running: the worker's slots; a window's events are in
            :attr:`RunningSet.windowed` while it is open.
        start: starts the handlers of claimed events (the executor's).
        hand_on: takes the outcome of an event leased as its window closed
            (the completer's ``add``).
        on_written: takes each written batch of outcomes and the ids written
            (the worker's accounting, as for the completer's batches).
        duration: the window's length (``WorkerConfig.claim_window``).
    """

    def __init__(self, claimers: Sequence[ManagedConnection], record: ManagedConnection,
                 queries: Queries, owner: str, running: RunningSet, *,
                 start: Callable[[list[Event]], None],
                 hand_on: Callable[[Outcome], None],
                 on_written: Callable[[list[Outcome], set[int]], None], duration: float,
                 lease_ttl: float, query_timeout: float, delete_succeeded: bool) -> None:
        self._claimers = list(claimers)
        self._free = list(claimers)
        self._freed = asyncio.Event()
        self._record = WindowRecord(record, queries, owner, lease_ttl=lease_ttl,
                                    query_timeout=query_timeout)
        self._q = queries
        self._owner = owner
        self._running = running
        self._start = start
        self._hand_on = hand_on
        self._on_written = on_written
        self._duration = duration
        self._lease_ttl = lease_ttl
        self._timeout = query_timeout
        self._delete_succeeded = delete_succeeded
        self._count = 0
        # The open windows' events, to find the window of an outcome (take).
        self._open: dict[Key, ClaimWindow] = {}
        self._closers: set[asyncio.Task[None]] = set()
        # A cursor kept per connection, as the completer keeps its own: a
        # cursor made per statement sets up its adaptation state each time
        # (CursorCache says why).
        self._cursors = {c.role: CursorCache() for c in claimers}
        self._client_cursors: dict[str, psycopg.AsyncClientCursor[Any]] = {}

    def _cursor(self, managed: ManagedConnection, conn: psycopg.AsyncConnection[Any]
                ) -> psycopg.AsyncCursor[Any]:
        return self._cursors[managed.role].get(conn)

    @property
    def open_windows(self) -> int:
        """How many windows are open (claimed and not yet closed)."""
        return len(self._closers)

    async def acquire(self) -> ManagedConnection:
        """A claim connection no open window holds, the fetch connection if it is free
        (an idle worker never opens the other); waits for a window to close."""
        while not self._free:
            self._freed.clear()
            await self._freed.wait()
        claimer = min(self._free, key=self._claimers.index)
        self._free.remove(claimer)
        return claimer

    def release(self, claimer: ManagedConnection) -> None:
        if claimer not in self._free:
            self._free.append(claimer)
            self._freed.set()

    def take(self, outcome: Outcome) -> bool:
        """Whether an open window keeps ``outcome`` (the completer's first look)."""
        key = (outcome.event_id, outcome.attempt)
        window = self._open.get(key)
        return window is not None and window.take(key, outcome)

    async def settle(self) -> None:
        """Wait until every open window has closed (a shutdown, ``Worker.run_once``, an
        idle worker's poll)."""
        while self._closers:
            await asyncio.wait(set(self._closers))

    async def begin(self, claimer: ManagedConnection, conn: psycopg.AsyncConnection[Any],
                    query: str, params: dict[str, Any], stopping: StopFlag) -> list[Any]:
        """Open the transaction and lock a batch with ``query``, in one round trip
        (:func:`_statements`); returns its rows (none: the transaction is over). A
        stop cuts a claim that waits."""
        cur = self._client_cursor(claimer, conn)
        try:
            rows = await with_deadline_in_task(conn, self._locked(cur, query, params),
                                               self._timeout, stopping=stopping)
            if not rows:
                await with_deadline_in_task(conn, cur.execute("ROLLBACK"), self._timeout)
            return rows
        except psycopg.Error:
            # An error that left the connection usable left the transaction
            # aborted: end it, or every later claim fails on it.
            if not conn.broken:
                with contextlib.suppress(psycopg.Error, TimeoutError):
                    await with_deadline_in_task(conn, conn.execute("ROLLBACK"), self._timeout)
            raise

    @staticmethod
    async def _locked(cur: psycopg.AsyncClientCursor[Any], query: str, params: dict[str, Any]
                      ) -> list[Any]:
        await cur.execute(_statements(["BEGIN", cur.mogrify(query, params)]))
        cur.nextset()
        return await cur.fetchall()

    def _client_cursor(self, claimer: ManagedConnection, conn: psycopg.AsyncConnection[Any]
                       ) -> psycopg.AsyncClientCursor[Any]:
        """The claim connection's cursor for strings of statements, its parameters bound
        by psycopg on this side."""
        cur = self._client_cursors.get(claimer.role)
        if cur is None or cur.connection is not conn:
            cur = self._client_cursors[claimer.role] = psycopg.AsyncClientCursor(conn)
        return cur

    async def hold(self, claimer: ManagedConnection, conn: psycopg.AsyncConnection[Any],
                   events: list[Event]) -> list[Event]:
        """Record the batch ``begin`` locked on ``claimer`` and start its handlers; the
        window closes in a task of its own when its outcomes are in or its time is up,
        and gives ``claimer`` back then. Returns the events started.

        The caller has taken their slots. A batch that meets the record of a
        window that never committed is leased at once instead (see the module).
        """
        self._count += 1
        number = self._count
        crashes = await self._record.open(number, events)
        if crashes is None or crashes:
            try:
                if crashes is None:
                    await self._roll_back(claimer, conn, events, None)
                    return []
                return await self._lease_at_once(claimer, conn, number, events, crashes)
            finally:
                self.release(claimer)
        window = ClaimWindow(number, events)
        for key in window.keys:
            self._open[key] = window
        self._start(events)
        closer = asyncio.create_task(self._run(claimer, conn, window), name="conveyor-window")
        self._closers.add(closer)
        closer.add_done_callback(self._closers.discard)
        return events

    async def _run(self, claimer: ManagedConnection, conn: psycopg.AsyncConnection[Any],
                   window: ClaimWindow) -> None:
        try:
            if not window.all_in.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._duration):
                        await window.all_in.wait()
            await self._close(claimer, conn, window)
        finally:
            self.release(claimer)

    async def _lease_at_once(self, claimer: ManagedConnection, conn: psycopg.AsyncConnection[Any],
                             number: int, events: list[Event], crashes: dict[int, int]
                             ) -> list[Event]:
        """Lease the whole batch now, the lost attempts counted; start the events left to run."""
        log.warning("%d events of this claim ran in claim windows that never committed; "
                    "their attempts are counted and the batch is leased",
                    len(crashes), extra={"action": "window_crashes_counted",
                                         "events": len(crashes)})
        try:
            rows = await self._record.lease_crashed(conn, self._cursor(claimer, conn), number,
                                                    events, crashes)
        except (psycopg.Error, TimeoutError) as exc:
            await self._roll_back(claimer, conn, events, exc)
            return []
        # Their slots were taken for the attempts the held claim read; those
        # left to run start the attempts counted here (the parked free theirs),
        # leased now: the heartbeat renews them.
        for event in events:
            key = (event.id, event.attempt)
            self._running.windowed.discard(key)
            self._running.release(key)
        from_row = Event._from_claim_row
        left = [from_row(row[:-1]) for row in rows if row[-1] == "running"]
        self._running.take(left)
        self._running.freed.set()
        self._start(left)
        return left

    async def _close(self, claimer: ManagedConnection, conn: psycopg.AsyncConnection[Any],
                     window: ClaimWindow) -> None:
        """Write the window's outcomes, lease its unfinished events, commit."""
        window.closing = True
        outcomes = window.outcomes
        unfinished = [e.id for e in window.unfinished()
                      if (e.id, e.attempt) in self._running]
        plan = ack(self._q, self._owner, outcomes, delete_succeeded=self._delete_succeeded,
                   held=True)
        try:
            done = await with_deadline_in_task(
                conn, self._write(claimer, conn, window, plan.statements, unfinished),
                self._timeout)
        except (psycopg.Error, TimeoutError) as exc:
            # The late outcomes go with the rest: their events run again.
            self._forget(window)
            await self._roll_back(claimer, conn, window.events, exc)
            return
        self._forget(window)
        self._running.windowed.difference_update(window.keys)
        for outcome in window.late:
            self._hand_on(outcome)   # leased now: the completer writes them
        if outcomes:
            notice = finished_notice(self._q, plan.settled, done)
            if notice is not None:
                try:
                    await with_deadline_in_task(conn, self._cursor(claimer, conn).execute(*notice),
                                                self._timeout)
                except (psycopg.Error, TimeoutError) as exc:
                    await claimer.discard(exc)
            self._on_written(outcomes, done)

    def _forget(self, window: ClaimWindow) -> None:
        # Only its own: once its commit has landed, a retry given its attempt
        # back may already be held by the next window, under the same key.
        open_ = self._open
        for key in window.keys:
            if open_.get(key) is window:
                del open_[key]

    async def _write(self, claimer: ManagedConnection, conn: psycopg.AsyncConnection[Any],
                     window: ClaimWindow, statements: list[tuple[str, dict[str, Any]]],
                     unfinished: list[int]) -> set[int]:
        """The window's writes, its record's deletion and its commit, in one round trip
        (:func:`_statements`); returns the ids of the outcomes written."""
        cur = self._client_cursor(claimer, conn)
        parts = [cur.mogrify(query, params) for query, params in statements]
        if unfinished:
            # The lease runs from the transaction's start, the window's.
            lease_ttl = self._lease_ttl + time.monotonic() - window.opened
            parts.append(cur.mogrify(self._q["event_lease_held"], {
                "ids": int_array(unfinished), "owner": self._owner, "lease_ttl": lease_ttl}))
        parts.append(cur.mogrify(*self._record.deletion(window.number)))
        parts.append("COMMIT")
        await cur.execute(_statements(parts))
        done: set[int] = set()
        for _ in statements:
            done.update(r[0] for r in await cur.fetchall())
            cur.nextset()
        return done

    async def _roll_back(self, claimer: ManagedConnection, conn: psycopg.AsyncConnection[Any],
                         events: list[Event], exc: BaseException | None) -> None:
        """The window wrote nothing: its events are pending again, for any worker; a
        handler still running is stopped as on a lost lease, its outcome not written."""
        if exc is not None:
            log.warning("a claim window of %d events could not commit (%s); they run again",
                        len(events), exc, extra={"action": "window_rolled_back",
                                                 "events": len(events)})
        keys = [(e.id, e.attempt) for e in events]
        self._running.windowed.difference_update(keys)
        self._running.lose(keys, set(), quiet=True)
        self._running.freed.set()
        if exc is None or (isinstance(exc, psycopg.Error) and not conn.broken):
            try:
                await with_deadline_in_task(conn, conn.execute("ROLLBACK"), self._timeout)
                return
            except (psycopg.Error, TimeoutError) as error:
                exc = error
        await claimer.discard(exc)
