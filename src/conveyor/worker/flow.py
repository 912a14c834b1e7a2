"""Flow control in the claim: global concurrency limits, rate limits, tenant fairness.

While the flow_limits table (migration 0012) holds any pattern, a worker
claims in two steps. The plain claim (``event_claim_flow``) leaves out every
limited pattern's events. Then, for each limited pattern whose topics its
router handles, one short transaction: lock the pattern's row (SKIP LOCKED:
another worker holding it is claiming it now), count the pattern's running
events with a snapshot taken after the lock, refill the token bucket, and
claim at most ``min(free slots, max_running - running, tokens)``, in claim
order or, with ``fair_by="tenant"``, each tenant's first event before
anyone's second. Because every claim of a pattern happens under its lock
with a fresh count, the fleet never has more than ``max_running`` of its
events running (a lease that expires while its handler still runs is the one
exception: the event may run again beside it, as at-least-once allows).

With no row in flow_limits the worker claims exactly as before: one
statement, ``event_claim`` (checked every FLOW_REFRESH seconds).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from conveyor.db.named_queries import Queries
from conveyor.flow import FlowLimit
from conveyor.router import Router, pattern_filter, patterns_overlap

log = logging.getLogger(__name__)

# Seconds between two reads of the flow_limits table (a limit declared by a
# worker that starts later is seen within this).
FLOW_REFRESH = 5.0


class FlowControl:
    """One worker's view of the fleet's flow limits, and the claims that keep them."""

    def __init__(self, queries: Queries, router: Router) -> None:
        self._q = queries
        self._router = router
        self.declared = [r.flow for r in router.routes if r.flow is not None]
        self.limits: list[FlowLimit] = []
        self._read_at = -math.inf
        self._turn = 0
        # Seconds until a limited pattern may have room again (a token), when
        # the last claim found none; None when it was not held back.
        self.retry_in: float | None = None
        self.held_back = False

    @property
    def active(self) -> bool:
        """Whether any pattern is limited: the plain claim must leave those out."""
        return bool(self.limits)

    def stale(self) -> bool:
        return time.monotonic() - self._read_at >= FLOW_REFRESH

    async def declare(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Write this router's limits (a new pattern starts with a full bucket)."""
        if not self.declared:
            return
        d = self.declared
        await conn.execute(self._q["flow_declare"], {
            "patterns": [x.pattern for x in d], "max_runnings": [x.max_running for x in d],
            "rates": [x.rate for x in d], "bursts": [x.burst for x in d],
            "fair_bys": [x.fair_by for x in d]})

    async def refresh(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Read every limit of the fleet."""
        cur = await conn.execute(self._q["flow_list"])
        self.limits = [FlowLimit(pattern, max_running, rate, fair_by)
                       for pattern, max_running, rate, fair_by in await cur.fetchall()]
        self._read_at = time.monotonic()

    def plain_params(self) -> dict[str, Any]:
        """What the plain claim leaves out: every limited pattern."""
        return pattern_filter([x.pattern for x in self.limits], prefix="except_")

    def _handled(self, limit: FlowLimit) -> bool:
        """Whether this worker's router may handle some topic of ``limit``'s pattern."""
        return any(patterns_overlap(r.pattern, limit.pattern) for r in self._router.routes)

    async def claim(self, conn: psycopg.AsyncConnection[Any], want: int,
                    params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Claim up to ``want`` events of the limited patterns, each within its limit.

        ``params``: the worker's own claim parameters (topics, tenants, owner, lease).
        """
        rows: list[tuple[Any, ...]] = []
        self.retry_in, self.held_back = None, False
        limits = [x for x in self.limits if self._handled(x)]
        if not limits:
            return rows
        # Start with another pattern each time, so one busy pattern does not
        # always take the free slots first.
        self._turn = (self._turn + 1) % len(limits)
        for limit in limits[self._turn:] + limits[:self._turn]:
            if want - len(rows) <= 0:
                break
            rows += await self._claim_one(conn, limit, want - len(rows), params)
        return rows

    async def _claim_one(self, conn: psycopg.AsyncConnection[Any], limit: FlowLimit, want: int,
                         params: dict[str, Any]) -> Sequence[tuple[Any, ...]]:
        q = self._q
        async with conn.transaction():
            cur = await conn.execute(q["flow_lock"], {"pattern": limit.pattern})
            row = await cur.fetchone()
            if row is None:
                self.held_back = True      # another worker is claiming it: look again soon
                return []
            max_running, rate, burst, tokens, idle_s = row
            budget = want
            if max_running is not None:
                cur = await conn.execute(q["flow_running"], pattern_filter([limit.pattern]))
                running = (await cur.fetchone() or (0,))[0]
                budget = min(budget, max_running - running)
            if rate is not None:
                tokens = min(burst, tokens + idle_s * rate)
                if tokens < 1:
                    wait = (1 - tokens) / rate
                    self.retry_in = wait if self.retry_in is None else min(self.retry_in, wait)
                budget = min(budget, math.floor(tokens))
            if budget <= 0:
                self.held_back = True
                if rate is not None:
                    await conn.execute(q["flow_take_tokens"],
                                       {"pattern": limit.pattern, "tokens": tokens})
                return []
            query = q["flow_claim_fair" if limit.fair_by == "tenant" else "flow_claim"]
            cur = await conn.execute(query, {
                **params, **pattern_filter([limit.pattern], prefix="limit_"), "limit": budget})
            claimed = await cur.fetchall()
            if rate is not None:
                await conn.execute(q["flow_take_tokens"],
                                   {"pattern": limit.pattern, "tokens": tokens - len(claimed)})
            if len(claimed) == budget:
                self.held_back = True      # the limit, not the backlog, ended this claim
            return claimed
