"""The dependency service: waiting events become due when what they wait for has finished.

An event written with dependencies (:mod:`conveyor.canvas`, migration 0022)
is ``waiting``, out of every claim's way, with one edge per dependency in
``event_dependencies``. No acknowledgement looks at that table, so an
application without dependencies pays nothing for it: instead each worker,
on its maintenance connection, runs ``deps_release`` passes, which settle
the open edges whose event has finished, however it finished (a worker's
acknowledgement, ``conveyor.complete``, a rescue, an operator's cancel).
A waiting event with no open edge left becomes pending and its topic's
workers are woken; one whose dependency failed or was cancelled is parked
as failed, cancelled, or released, as its edge says.

When it runs:

* at once after a ``!deps`` notification, which the transaction that wrote
  the edges sends at its commit (so an edge to an event that had already
  finished is settled within a round trip);
* while an edge is open (the events being waited for are running: their
  acknowledgements send nothing), ``POLL_MIN`` after a pass that settled
  an edge, twice as long after one that settled none, up to ``POLL_MAX``:
  a pass reads every open edge (15 ms for the 20,000 of a 10,000-member
  chord, 2026-12-03), so a workflow whose steps run for minutes is not read
  five times a second, and one whose steps finish all the time is;
* every ``IDLE_INTERVAL`` otherwise, the fallback of a worker that does not
  LISTEN or missed the notification.

One pass at a time fleet-wide (an advisory lock tried, not waited for): the
others would only wait for the same rows. A pass runs statements of at most
``RELEASE_BATCH`` edges until one settles fewer; an event it parks or
cancels is a finished dependency for the next statement, so a failure goes
down a chain within the pass.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from conveyor.db.named_queries import Queries
from conveyor.notify import results_channel

# Seconds between passes while some edge is open: how late a dependent may
# start after the commit of the last event it waited for, while its
# workflow's steps keep finishing (and at most POLL_MAX after a lull).
POLL_MIN = 0.2
POLL_MAX = 2.0
# Seconds between passes with no open edge, when no notification came.
IDLE_INTERVAL = 30.0
# Seconds between two deletions of pruned steps' edges (deps_forget).
FORGET_INTERVAL = 300.0
# Edges one statement settles (or forgets); statements in one pass, at most.
RELEASE_BATCH = 1_000
RELEASE_STATEMENTS = 50


class Dependencies:
    """One worker's share of releasing waiting events (a maintenance service).

    Args:
        queries: the schema's named queries.

    ``run_once`` is one pass; it returns nothing, its counts are attributes.
    """

    name = "dependencies"
    timeout: float | None = None

    def __init__(self, queries: Queries) -> None:
        self._q = queries
        self._params = {"limit": RELEASE_BATCH,
                        "results_channel": results_channel(queries.schema)}
        self._lock = {"key": f"conveyor dependencies {queries.schema}"}
        self._next = 0.0
        self._poll = POLL_MIN
        self._forget_at = time.monotonic() + FORGET_INTERVAL
        self.released_total = 0   # waiting events made pending
        self.stopped_total = 0    # waiting events parked or cancelled by a dependency

    def due_at(self) -> float:
        return self._next

    def check_soon(self) -> None:
        """Edges were written (``!deps``): the next maintenance pass runs this one."""
        self._next = 0.0
        self._poll = POLL_MIN

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        q = self._q
        if time.monotonic() >= self._forget_at:
            self._forget_at = time.monotonic() + FORGET_INTERVAL
            await conn.execute(q["deps_forget"], {"limit": RELEASE_BATCH})
        if not await self._open(conn):
            # No event waits: the usual case, one read of an empty index.
            self._next = time.monotonic() + IDLE_INTERVAL
            return
        settled = 0
        for _ in range(RELEASE_STATEMENTS):
            async with conn.transaction():
                cur = await conn.execute(q["deps_try_lock"], self._lock)
                row = await cur.fetchone()
                if not (row and row[0]):
                    # Another worker's pass is settling these edges.
                    break
                cur = await conn.execute(q["deps_release"], self._params)
                closed, released, stopped, _, _ = await cur.fetchone() or (0, 0, 0, 0, 0)
            settled += closed
            self.released_total += released
            self.stopped_total += stopped
            if closed < RELEASE_BATCH and not stopped:
                break
        self._poll = POLL_MIN if settled else min(POLL_MAX, 2 * self._poll)
        waiting = await self._open(conn)
        self._next = time.monotonic() + (self._poll if waiting else IDLE_INTERVAL)

    async def _open(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Whether some edge is open (an event waits)."""
        cur = await conn.execute(self._q["deps_open"])
        row = await cur.fetchone()
        return bool(row and row[0])
