"""Acknowledges finished attempts in batches, fenced on owner and attempt.

Outcomes wait in a buffer; one flush writes all successes with one statement
and every other outcome with a second. While a flush runs, new outcomes pile
up and go out together in the next one, so batching grows with load. A flush
that fails on a broken connection keeps its outcomes and retries after
reconnecting: nothing is lost, and the fence makes a late write harmless.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg

from conveyor.db.named_queries import Queries
from conveyor.worker.acks import ack, finished_notice
from conveyor.worker.classify import Outcome
from conveyor.worker.connection import RECOVERABLE_ERRORS, CursorCache, ManagedConnection
from conveyor.worker.deadline import with_deadline_in_task
from conveyor.worker.window import ClaimWindows

log = logging.getLogger(__name__)

HELD_RETRY_PAUSE = 0.5
RECONNECT_PAUSE = 0.05


class Completer:
    def __init__(self, conn: ManagedConnection, queries: Queries, owner: str, *,
                 flush_size: int, interval: float, query_timeout: float = 30.0,
                 on_acked: Callable[[list[Outcome], set[int]], None],
                 delete_succeeded: bool = False,
                 completed: set[tuple[int, int]] | None = None) -> None:
        self._conn = conn
        # (event id, attempt) that handlers finished themselves (conveyor.complete):
        # their acknowledgement finds the row no longer owned, and that is no loss.
        self._completed = completed if completed is not None else set()
        # Retention 0: a success is acknowledged by deleting the row, which
        # writes no new row version and no index entries (4 us less per event).
        self._delete_succeeded = delete_succeeded
        self._q = queries
        self._cursor = CursorCache()
        self._owner = owner
        # Raised by the worker while its claims grow with a backlog (Claims.fetch_loop).
        self.flush_size = flush_size
        self._interval = interval
        self._on_acked = on_acked
        self._query_timeout = query_timeout
        self._buffer: list[Outcome] = []
        self._flushing: list[Outcome] = []
        # Events whose row another transaction held at the last try: batches with
        # one of them go straight to the lock-skipping path instead of waiting again.
        self._held: set[int] = set()
        self._signal = asyncio.Event()
        # Set when the buffer holds flush_size outcomes: a flush waiting out
        # the interval for more goes at once (tests/worker/test_completer.py).
        self._full = asyncio.Event()
        self.acked = 0
        self.stale = 0
        # The worker's claim windows (worker/window.py), if it holds claims: the
        # outcome of an event of the open window is written by the window.
        self.windows: ClaimWindows | None = None

    @property
    def backlog(self) -> int:
        return len(self._buffer)

    def unacknowledged(self) -> set[tuple[int, int]]:
        """(event id, attempt) of outcomes decided but not yet written (buffered or being written)."""
        return ({(o.event_id, o.attempt) for o in self._buffer}
                | {(o.event_id, o.attempt) for o in self._flushing})

    def decided(self) -> set[tuple[int, int]]:
        """Attempts whose end is known but not yet acknowledged: a lease missing for one
        is no loss. Those a handler finished itself (conveyor.complete) are among them."""
        unacknowledged = self.unacknowledged()
        return unacknowledged | self._completed if self._completed else unacknowledged

    def add(self, outcome: Outcome) -> None:
        windows = self.windows
        if windows is not None and windows.take(outcome):
            return
        buffer = self._buffer
        buffer.append(outcome)
        n = len(buffer)
        if n == 1:
            # Only the first outcome of a batch needs to wake the flusher: run()
            # waits on the signal only while the buffer is empty.
            self._signal.set()
        if n >= self.flush_size:
            self._full.set()

    async def run(self, stopping: asyncio.Event) -> None:
        """Flush until stopped and the buffer is empty."""
        while True:
            if not self._buffer:
                if stopping.is_set():
                    return
                self._signal.clear()
                stop_wait = asyncio.ensure_future(stopping.wait())
                sig_wait = asyncio.ensure_future(self._signal.wait())
                await asyncio.wait({stop_wait, sig_wait}, return_when=asyncio.FIRST_COMPLETED)
                stop_wait.cancel()
                sig_wait.cancel()
                continue
            if len(self._buffer) < self.flush_size and not stopping.is_set():
                # Up to the interval for more outcomes, and no longer than it
                # takes flush_size of them to gather.
                self._full.clear()
                try:
                    async with asyncio.timeout(self._interval):
                        await self._full.wait()
                except TimeoutError:
                    pass
            await self.flush()

    async def finish(self, task: asyncio.Task[None], timeout: float) -> None:
        """Wait for ``task``, this completer's :meth:`run` told to stop, to write the last
        outcomes; one that cannot finish within ``timeout`` is cut, and their leases expire."""
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if done:
            return
        log.error("could not acknowledge %d results before exit; their leases will expire",
                  self.backlog, extra={"action": "ack_abandoned"})
        # Close the socket first, so the cancellation waits on no server: a
        # statement under a deadline would close it itself, but those probing
        # locks (_write_around_locks) run without one.
        self._conn.abort()
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)

    async def flush(self) -> None:
        """Write the buffered outcomes once; on a lost connection keep them for later."""
        batch, self._buffer = self._buffer, []
        if not batch:
            return
        self._flushing = batch
        try:
            conn = await self._conn.get(give_up_on_stop=False)
            if self._held and self._held.intersection(o.event_id for o in batch):
                raise psycopg.errors.LockNotAvailable("a row of this batch was held before")
            done = await self._write(conn, batch)
        except psycopg.errors.LockNotAvailable:
            # Some row is held by another transaction: write what can be written
            # now and keep the held ones for a later flush, so one locked row
            # never stalls every other result.
            try:
                done, held = await self._write_around_locks(conn, batch)
            except RECOVERABLE_ERRORS as exc:
                self._buffer[:0] = batch
                await self._conn.discard(exc)
                return
            self._buffer[:0] = held
            self._held = {o.event_id for o in held}
            if held:
                log.warning("%d results wait for rows locked by another transaction", len(held),
                            extra={"action": "ack_row_locked"})
                if not done:
                    await asyncio.sleep(HELD_RETRY_PAUSE)  # only held rows left: do not spin
            batch = [o for o in batch if o not in held]
        except RECOVERABLE_ERRORS as exc:
            self._buffer[:0] = batch
            await self._conn.discard(exc)
            # Reconnecting backs off by itself when the server is away; a cut
            # connection to a healthy server should cost milliseconds, not a
            # backoff step (slots stay taken until results are acknowledged).
            await asyncio.sleep(RECONNECT_PAUSE)
            return
        except psycopg.Error as exc:
            # Not a connection problem, so retrying the same batch would fail the
            # same way and block every later acknowledgement. Drop it: the leases
            # expire and the events run again (at-least-once still holds).
            log.error("acknowledging %d events failed, leaving them to lease expiry: %s",
                      len(batch), exc, extra={"action": "ack_failed"})
            self._on_acked(batch, set())
            return
        finally:
            self._flushing = []
        if self._completed:
            self._completed_in_handlers(batch, done)
        self.acked += len(done)
        missed = len(batch) - len(done)
        if missed:
            self.stale += missed
            log.warning("%d results discarded: the events are no longer owned by this worker",
                        missed, extra={"action": "ack_stale"})
        self._on_acked(batch, done)

    def _completed_in_handlers(self, batch: list[Outcome], done: set[int]) -> None:
        """Count as written the outcomes of events their handlers finished, and forget them."""
        completed = self._completed
        for outcome in batch:
            key = (outcome.event_id, outcome.attempt)
            if key in completed:
                completed.discard(key)
                done.add(outcome.event_id)

    async def _write(self, conn: psycopg.AsyncConnection[Any], batch: list[Outcome]) -> set[int]:
        plan = ack(self._q, self._owner, batch, delete_succeeded=self._delete_succeeded)
        done: set[int] = set()
        cur = self._cursor.get(conn)
        for query, params in plan.statements:
            await with_deadline_in_task(conn, cur.execute(query, params), self._query_timeout)
            done.update(r[0] for r in await cur.fetchall())
        notice = finished_notice(self._q, plan.settled, done)
        if notice is not None:
            # After the write has committed (autocommit), so a waiter woken
            # by it reads the final row.
            await with_deadline_in_task(conn, cur.execute(*notice), self._query_timeout)
        return done

    async def _write_around_locks(self, conn: psycopg.AsyncConnection[Any], batch: list[Outcome]
                                  ) -> tuple[set[int], list[Outcome]]:
        """Write the outcomes whose rows can be locked now; return (written ids, held outcomes)."""
        ids = sorted({o.event_id for o in batch})
        async with conn.transaction():
            cur = await conn.execute(self._q["event_lock_owned"], {"ids": ids, "owner": self._owner})
            lockable = {r[0] for r in await cur.fetchall()}
            done = await self._write(conn, [o for o in batch if o.event_id in lockable])
        rest = [o for o in batch if o.event_id not in lockable]
        if not rest:
            return done, []
        cur = await conn.execute(self._q["event_owned"], {
            "ids": sorted({o.event_id for o in rest}), "owner": self._owner})
        still_mine = {(r[0], r[1]) for r in await cur.fetchall()}
        return done, [o for o in rest if (o.event_id, o.attempt) in still_mine]
