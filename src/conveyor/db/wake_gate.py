"""A waiter's hold on the wake gate: producers wake only who waits.

Producers send a wake-up (NOTIFY) only while somebody holds the gate's slots
(``db/queries/wakes.sql`` says how, docs/producing.md why). Whoever is about
to wait for wake-ups holds them first, on a connection of its own session,
then reads what is there, then waits:

- a slot it got means every producer that skipped the wake-up in it has
  ended, so the read after it sees their events;
- a slot a producer still holds (one that skipped the wake-up, not committed
  yet) is tried again soon (:meth:`WakeGate.retry_in`, doubling up to a
  ceiling), and the waiter reads again once it gets it.

The slots are session-level advisory locks: they survive the waiter's
commits and rollbacks and end with its session, so a waiter that dies or
loses its connection holds nothing.

Example (an ordered relay stream's loop, in outline)::

    gate = WakeGate(queries)
    while True:
        if await gate.hold(conn):     # slots newly held: read again first
            ...
        await read_and_hand_on(conn)
        await wait_for_notifications(conn, timeout=gate.retry_in(poll_interval))
"""

from __future__ import annotations

from typing import Any

import psycopg

from conveyor.db.named_queries import Queries

SLOTS = 8
EVERY_SLOT = (1 << SLOTS) - 1
# A producer that skipped the wake-up is usually one short transaction away
# from its commit: the first try comes soon, then less often while it runs.
FIRST_RETRY = 0.005


class WakeGate:
    """The gate's slots one connection holds (see the module's docstring)."""

    def __init__(self, queries: Queries) -> None:
        self._q = queries
        self._session: Any = None      # the connection the slots are held on
        self.held = 0                  # a bit per slot
        self._retry = FIRST_RETRY

    @property
    def whole(self) -> bool:
        """Whether every slot is held: every producer from now on wakes the holder."""
        return self.held == EVERY_SLOT

    async def hold(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Hold the slots not held yet on ``conn``; whether any was newly held.

        When one was, the caller reads again before it waits: a producer that
        skipped its wake-up in that slot has ended. A new connection (the
        last one was lost) holds nothing, so it starts from no slot.
        """
        if conn is not self._session:
            self._session, self.held, self._retry = conn, 0, FIRST_RETRY
        if self.whole:
            return False
        cur = await conn.execute(self._q["wake_gate_hold"], {"held": self.held})
        row = await cur.fetchone()
        now = int(row[0]) if row is not None else self.held
        gained, self.held = now & ~self.held, now
        self._retry = FIRST_RETRY if self.whole or gained else self._retry * 2
        return bool(gained)

    async def release(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Release every slot held on ``conn``: producers stop waking this holder.

        Slots held on an earlier connection went with its session: none is left.
        """
        held, self.held, self._retry = self.held, 0, FIRST_RETRY
        if conn is self._session and held:
            await conn.execute(self._q["wake_gate_release"], {"held": held})

    def retry_in(self, longest: float) -> float:
        """How long the holder may wait before it tries the missing slots again
        (``longest`` when none is missing)."""
        return longest if self.whole else min(longest, self._retry)
