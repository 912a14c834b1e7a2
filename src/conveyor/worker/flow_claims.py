"""The flow claims: the limited patterns' events, claimed beside the fetch loop.

A worker service (worker/service.py) on a connection of its own, so its short
transactions never delay the plain claims: the unlimited topics drain beside a
saturated limit as fast as without it. Each pass claims what the fleet's flow
limits (:class:`~conveyor.worker.flow.FlowControl`) leave room for, or only
sorts the limited events into their lane when this worker has no slot or no
limited pattern of its own; the slots it may fill are reserved while the claim
is in flight, so the fetch loop keeps the rest.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from typing import Any

import psycopg

from conveyor.config import WorkerConfig
from conveyor.db.rows import CLAIM_PRIORITY
from conveyor.types import Event
from conveyor.worker.claims import Claims
from conveyor.worker.connection import RECOVERABLE_ERRORS, StopRequested
from conveyor.worker.deadline import with_deadline

log = logging.getLogger(__name__)

_PRIORITY = operator.itemgetter(CLAIM_PRIORITY)


class FlowClaims:
    """Claims the limited patterns' events into ``claims``' running set and starts them.

    ``run_once(conn)`` is one claim (or sort) on ``conn``; ``run`` repeats it
    whenever the flow control says a pattern is due (a freed slot, a NOTIFY,
    its retry time), on the worker's flow connection.
    """

    name = "flow"

    def __init__(self, claims: Claims, config: WorkerConfig) -> None:
        self.claims = claims
        self.flow = claims.flow
        self.running = claims.running
        self._config = config
        self._stopping: asyncio.Event | None = None

    async def run(self, stopping: asyncio.Event) -> None:
        """Claim when due until ``stopping`` is set."""
        flow, running = self.flow, self.running
        managed = self.claims.connections.flow_connection()
        self._stopping = stopping
        while not stopping.is_set():
            await flow.wait_until_due(stopping)
            if stopping.is_set() or not flow.active:
                continue
            try:
                conn = await managed.get()
                free = await self.run_once(conn)
            except StopRequested:
                return
            except RECOVERABLE_ERRORS as exc:
                await managed.discard(exc)
                continue
            except psycopg.Error as exc:
                log.error("flow claim failed: %s", exc, extra={"action": "claim_failed"})
                await managed.pause_after_failure()
                continue
            if not free and flow.handled and not stopping.is_set():
                await running.wait_for_slot()

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """One flow claim on ``conn``, every event claimed started; returns the slots it
        could fill (0: it only sorted)."""
        flow, running, c = self.flow, self.running, self._config
        # A quarter of the slots at most: while the claim is in flight its
        # slots are reserved, and the fetch loop must keep the rest. With
        # none free (or no limited pattern of its own), only the sort.
        free = max(0, min(running.free_slots(), max(1, c.concurrency // 4),
                          flow.most_claimable(c.batch_size)))
        running.reserved += free
        sent = time.monotonic()
        try:
            rows = await with_deadline(conn, flow.claim(conn, free, self.claims.claim_params()),
                                       c.query_timeout, stopping=self._stopping)
        finally:
            running.reserved -= free
            running.freed.set()    # the fetch loop may wait for those slots
        if rows:
            rows.sort(key=_PRIORITY, reverse=True)
            events = [Event._from_claim_row(r) for r in rows]
            if self.claims.handed_back_late(events, sent):
                return free
            stats = self.claims.stats
            stats.claimed += len(events)
            stats.claims += 1
            running.take(events)
            self.claims.executor.start(events)
        return free
