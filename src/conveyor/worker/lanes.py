"""The aside lane: pending events that no live worker claims, out of the claims' way.

The plain claim reads the open lane of events_claim_idx in claim order and
steps over every event it may not take: a topic no running worker handles,
or one a pause holds back. With tens of thousands of such events due ahead
of a handled topic's, every claim read them all again (55,000 cut a drain of
about 19,000 events a second to 4,000-8,000, 2026-12-02). Migration 0018
gives them a lane no claim reads: ``events.limited`` NULL (false is the open
lane, true the flow claims' limited lane, 0013).

Each worker, on its maintenance connection:

* sets aside (``lane_set_aside``) the events at the open lane's front that
  a pause holds, or that neither it nor any worker alive in the registry may
  claim; the window is the largest while it finds many and shrinks to
  ``SET_ASIDE_WINDOW_MIN`` entries a second while it finds none;
* brings back (``lane_bring_back``) the aside events it may claim and no
  pause holds: on its first pass (after its registry row is written), after
  a ``!pause`` notification, and every ``RETURN_EVERY`` seconds.

No event is stranded: both take one advisory lock (``lane_lock``) before
their statement, in turn, so a set-aside
either ran before a worker's bring-back (which then sees and returns its
events) or after its registration (and so sees the worker alive). The
periodic bring-back catches a worker taken for gone while its heartbeat was
late, and a pause lifted by hand in SQL. An
event that returns to pending from a claim (a retry, a rescued lease) is in
the lane it was claimed from, the open one, and is judged again there.

Nothing of this runs per claim: the claims are the statements they were.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import psycopg

from conveyor.db.named_queries import Queries

# Events at the open lane's front one set-aside looks at: the most after one
# that moved more than half of its window (and that one is followed by
# another at once), halved down to the least after one that moved none. Not
# doubled: each worker keeps its own window and the fleet's set-asides take
# turns under one lock, so doubling from the least took 4 workers over 5 s
# to move a 20,000-event backlog (the claims stepping over it meanwhile).
SET_ASIDE_WINDOW_MIN = 100
SET_ASIDE_WINDOW_MAX = 10_000

# Seconds between set-asides that moved none; after one that moved some, the
# next comes after SET_ASIDE_AGAIN.
SET_ASIDE_IDLE = 1.0
SET_ASIDE_AGAIN = 0.05

# A worker whose registry row was written within this many seconds (or three
# of this worker's heartbeat intervals, if longer) counts as alive: its
# topics' events are not set aside.
ALIVE_WITHIN = 30.0

# Seconds between two bring-backs when nothing asks for one sooner.
RETURN_EVERY = 30.0

# Events one lane_bring_back statement moves: the claims are woken after
# each, so a resumed backlog starts to drain after the first. One pass of the
# maintenance loop runs at most RETURN_BATCHES of them (the pass has a
# deadline); the next pass goes on at once.
RETURN_BATCH = 2_000
RETURN_BATCHES = 10


class Lanes:
    """One worker's share of keeping the open lane free of events no worker claims.

    Args:
        queries: the schema's named queries.
        claim_filter: the worker's own claim parameters (``all_topics``,
            ``topics``, ``prefixes``, ``all_tenants``, ``tenants``).
        heartbeat_interval: the worker's; the fleet is taken to beat alike.
        on_back: called after a bring-back that moved events (wake the claims).

    A maintenance service (worker/service.py): ``run_once`` is :meth:`run`.
    """

    name = "lanes"
    timeout: float | None = None

    def __init__(self, queries: Queries, claim_filter: dict[str, Any], *,
                 heartbeat_interval: float, on_back: Callable[[], None]) -> None:
        self._q = queries
        self._filter = claim_filter
        self._lock = {"key": f"conveyor lanes {queries.schema}"}
        self._alive_within = max(ALIVE_WITHIN, 3 * heartbeat_interval)
        self._on_back = on_back
        self._window = SET_ASIDE_WINDOW_MAX
        self._aside_at = 0.0
        self._back_at = 0.0
        self.set_aside_total = 0     # events moved to the aside lane, for stats
        self.brought_back_total = 0  # and back to the open lane

    def bring_back_soon(self) -> None:
        """A pause may have been lifted: look for this worker's aside events now."""
        self._back_at = 0.0

    def due_at(self) -> float:
        """When :meth:`run` has something to do (time.monotonic())."""
        return min(self._aside_at, self._back_at)

    async def run(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Bring back and set aside, each if it is due."""
        now = time.monotonic()
        if now >= self._back_at:
            self._back_at = now + RETURN_EVERY
            if await self.bring_back(conn, batches=RETURN_BATCHES) \
                    >= RETURN_BATCH * RETURN_BATCHES:
                self._back_at = now          # more to bring back: the next pass
        if now >= self._aside_at:
            await self.set_aside(conn)

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await self.run(conn)

    async def set_aside(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """Move the unclaimable events at the open lane's front aside; returns how many."""
        q = self._q
        window = self._window
        async with conn.transaction():
            cur = await conn.execute(q["lane_try_lock"], self._lock)
            row = await cur.fetchone()
            if not (row and row[0]):
                # Another worker is at it; its statement covers this one's.
                self._aside_at = time.monotonic() + SET_ASIDE_AGAIN
                return 0
            cur = await conn.execute(q["lane_set_aside"], {
                **self._filter, "window": window, "alive_within": self._alive_within})
            moved = max(cur.rowcount, 0)
        self.set_aside_total += moved
        now = time.monotonic()
        if moved * 2 > window:
            self._window = SET_ASIDE_WINDOW_MAX
            self._aside_at = now
        elif moved:
            self._aside_at = now + SET_ASIDE_AGAIN
        else:
            self._window = max(window // 2, SET_ASIDE_WINDOW_MIN)
            self._aside_at = now + SET_ASIDE_IDLE
        return moved

    async def bring_back(self, conn: psycopg.AsyncConnection[Any], *,
                         batches: int | None = None) -> int:
        """Return the aside events this worker may claim to the open lane, at most
        ``batches`` statements of RETURN_BATCH (default: all); returns how many."""
        q = self._q
        params = {**self._filter, "batch": RETURN_BATCH}
        total = 0
        for _ in itertools.repeat(None) if batches is None else range(batches):
            async with conn.transaction():
                await conn.execute(q["lane_lock"], self._lock)
                cur = await conn.execute(q["lane_bring_back"], params)
            moved = max(cur.rowcount, 0)
            total += moved
            if moved:
                self.brought_back_total += moved
                self._on_back()
            if moved < RETURN_BATCH:
                break
        return total
