"""The record of a worker's open claim windows: why an attempt that died in one counts.

A window that dies with its worker (or its connection) rolls back, and the
attempts its handlers ran are not written. So before a window's handlers
start, its batch is recorded on a connection of its own and committed
(``claim_window_open``, an unlogged table, migration 0024); the window's
commit deletes the record. A record left behind names attempts that ran: the
next window that claims one of its events leases its whole batch at once,
those attempts counted (``event_claim_crashed``), so a poison event that kills
its worker still runs out of attempts and is parked.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from conveyor.db.arrays import int_array
from conveyor.db.named_queries import Queries
from conveyor.types import Event
from conveyor.worker.connection import RECOVERABLE_ERRORS, CursorCache, ManagedConnection
from conveyor.worker.deadline import with_deadline_in_task

log = logging.getLogger(__name__)


class WindowRecord:
    """The records of the windows of one worker (``owner``), committed on ``conn``."""

    def __init__(self, conn: ManagedConnection, queries: Queries, owner: str, *,
                 lease_ttl: float, query_timeout: float) -> None:
        self.conn = conn
        self._q = queries
        self._owner = owner
        self._lease_ttl = lease_ttl
        self._timeout = query_timeout
        self._cursor = CursorCache()

    async def open(self, number: int, events: list[Event]) -> dict[int, int] | None:
        """Commit the record of window ``number``; returns the attempts earlier windows
        lost, by event id (None: the record could not be written, and the window is
        not held)."""
        try:
            conn = await self.conn.get()
            cur = self._cursor.get(conn)
            await with_deadline_in_task(conn, cur.execute(self._q["claim_window_open"], {
                "worker": self._owner, "window_no": number,
                "ids": int_array(e.id for e in events)}), self._timeout)
            return {row[0]: row[1] for row in await cur.fetchall()}
        except RECOVERABLE_ERRORS as exc:
            await self.conn.discard(exc)
        except psycopg.Error as exc:
            log.error("recording a claim window failed: %s", exc,
                      extra={"action": "window_record_failed"})
        return None

    def deletion(self, number: int) -> tuple[str, dict[str, Any]]:
        """The statement that deletes window ``number``'s record, in its commit."""
        return self._q["claim_window_close"], {"worker": self._owner, "window_no": number}

    async def lease_crashed(self, conn: psycopg.AsyncConnection[Any],
                            cur: psycopg.AsyncCursor[Any], number: int, events: list[Event],
                            crashes: dict[int, int]) -> list[Any]:
        """In window ``number``'s transaction (``cur`` on ``conn``): lease its batch now,
        the attempts earlier windows lost (``crashes``) counted, delete its record and
        commit; returns ``event_claim_crashed``'s rows."""
        ids = [e.id for e in events]
        await with_deadline_in_task(conn, cur.execute(self._q["event_claim_crashed"], {
            "ids": ids, "crashes": [crashes.get(i, 0) for i in ids], "owner": self._owner,
            "window_no": number, "lease_ttl": self._lease_ttl}), self._timeout)
        rows = await cur.fetchall()
        await with_deadline_in_task(conn, self._commit(cur, number), self._timeout)
        return rows

    async def _commit(self, cur: psycopg.AsyncCursor[Any], number: int) -> None:
        await cur.execute(*self.deletion(number))
        await cur.execute("COMMIT")
