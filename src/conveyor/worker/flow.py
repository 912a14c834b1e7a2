"""Flow control in the claim: global concurrency limits, rate limits, tenant fairness.

While the flow_limits table (migration 0012) holds any pattern, a worker
claims in two steps. The plain claim (``event_claim_flow``) leaves out every
limited pattern's events. Then, for each limited pattern whose topics its
router handles, one short transaction: lock the pattern's row (SKIP LOCKED:
another worker holding it is claiming it now), count the pattern's running
events with a snapshot taken after the lock, refill the token bucket, and
claim at most ``min(free slots, max_running - running, tokens)``, in claim
order or, with ``fair_by="tenant"``, each tenant's first event before
anyone's second, the tenants in turn from the one after the last served (so
claims of one event each go round the tenants too). Because every claim of a pattern happens under its lock
with a fresh count, the fleet never has more than ``max_running`` of its
events running (a lease that expires while its handler still runs is the one
exception: the event may run again beside it, as at-least-once allows).

The limited patterns' pending events have a lane of their own in the claim
index (migration 0013): the plain claims read the open lane and the flow
claims the limited one, so a limited topic's backlog is never in an unlimited
event's way. Every event is written to the open lane; a plain claim moves
the limited events it meets instead of claiming them, the flow loop of each
worker moves those it finds at the lane's front (``flow_sort``, the next 100
to 10,000 events in claim order); a flow claim leaves its events in the
limited lane, so a retried event waits there. A fifo_by pattern's events are
moved by the sorts alone, one at a time across the fleet, so a key's events
reach the limited lane in claim order. A limit that is gone sends its
events back (``flow_unsort``) when a worker reads the table and finds the set
of patterns changed, and once every UNSORT_EVERY seconds (an event that was
running when its limit went returns to pending in the limited lane).

With no row in flow_limits the worker claims exactly as before: one
statement, ``event_claim`` (checked every FLOW_REFRESH seconds, and at the
next claim after a ``!control`` notification: an operator set or cleared a
limit). An operator's override wins over the declared value (flow_list and
flow_lock read COALESCE(override, declared), migration 0023); flow_lock
reads it at every claim, so a changed value holds from the next claim.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Collection, Sequence
from typing import Any

import psycopg

from conveyor.db.named_queries import Queries
from conveyor.flow import FlowLimit
from conveyor.patterns import TopicPattern, sql_params
from conveyor.router import Router

# Seconds between two claims of a full pattern by this worker that one of its
# events finishing may ask for: the first finish after a quiet spell claims
# at once, the finishes within this of a claim go into the next one.
FLOW_GATHER = 0.02

# Seconds before a pattern found full is looked at again, unless this
# worker's own events finish first.
FLOW_RECHECK = 0.05

# Seconds between flow claims while no limited event was due (a NOTIFY for
# a new event pokes the flow claim at once).
FLOW_IDLE_RECHECK = 1.0

# Seconds between two reads of the flow_limits table (a limit declared by a
# worker that starts later is seen within this).
FLOW_REFRESH = 5.0

# A `!control` notification (an operator changed a limit) wakes the fetch
# loop to read the limits again at most once per this many seconds after a
# read: any role may send one, and a flood must not turn into a read per
# notification (the flag still makes the next claim read them).
CONTROL_REREAD_MIN = 0.1

# Events at the front of the open lane one flow_sort looks at: the window
# doubles after a sort that moved more than half of it (and that sort is
# followed by another at once), up to SORT_WINDOW_MAX, so a 100,000-event
# limited backlog leaves the plain claims' way in a dozen statements; it
# halves after a sort that moved none, down to SORT_WINDOW_MIN, so the sorts
# of a fleet draining an unlimited backlog read little (at 5,000 a sort,
# eight workers' sorts cost the drain about a tenth, 2026-12-02).
SORT_WINDOW_MIN = 100
SORT_WINDOW_MAX = 10_000

# Events flow_unsort moves back per statement.
UNSORT_BATCH = 10_000

# Seconds between two unsorts while the limits stay the same.
UNSORT_EVERY = 60.0


def describe_limit(limit: FlowLimit) -> str:
    """``export.* max_running=2 rate=5/s fair_by=tenant``: a route's flow limit in one piece."""
    parts = [limit.pattern]
    if limit.max_running is not None:
        parts.append(f"max_running={limit.max_running}")
    if limit.rate is not None:
        parts.append(f"rate={limit.rate:g}/s")
    if limit.fair_by is not None:
        parts.append(f"fair_by={limit.fair_by}")
    if limit.fifo_by is not None:
        parts.append(f"fifo_by={limit.fifo_by}")
    return " ".join(parts)


class FlowControl:
    """One worker's view of the fleet's flow limits, and the claims that keep them."""

    def __init__(self, queries: Queries, router: Router) -> None:
        self._q = queries
        self._router = router
        self.declared = [r.flow for r in router.routes if r.flow is not None]
        self.limits: list[FlowLimit] = []
        # The limits whose pattern this worker's router may claim topics of,
        # worked out once per read of the table.
        self.handled: list[FlowLimit] = []
        self._read_at = -math.inf
        self._expired = False       # an operator changed a limit: read them at the next claim
        self._lanes = asyncio.Lock()    # a sort and an unsort of this worker, one at a time
        self._turn = 0
        # When each pattern's next flow claim is worth sending (time.monotonic()):
        # a pattern found full is looked at again after FLOW_RECHECK (or its next
        # token), at once when one of this worker's events finishes
        # (room_freed); one found empty after FLOW_IDLE_RECHECK, at once on a
        # NOTIFY (poke). So a saturated limit costs a claim per finished event,
        # and idle patterns cost nothing between wake-ups.
        self._next_try: dict[str, float] = {}
        self._claimed_at: dict[str, float] = {}
        self._full: set[str] = set()
        self._room = asyncio.Event()
        # When flow_sort is next worth running, and when it last ran: a sort
        # that moved nothing waits FLOW_IDLE_RECHECK, a NOTIFY brings it
        # forward, but never closer than FLOW_RECHECK to the last one.
        self._sort_at = 0.0
        self._sorted_at = -math.inf
        self._sort_params: dict[str, Any] = {}
        self._unsorted_at = -math.inf
        self._sort_lock = {"key": f"conveyor flow sort {queries.schema}"}
        # The fifo_by patterns of the fleet: the plain claim leaves their events
        # where they are, and the sorts take turns.
        self._fifo: list[str] = []
        self._fifo_handled: list[TopicPattern] = []     # of self.handled
        self.sorted = 0             # events moved to the limited lane, for stats

    @property
    def active(self) -> bool:
        """Whether any pattern is limited: the plain claim must leave those out."""
        return bool(self.limits)

    def _due(self, now: float) -> list[FlowLimit]:
        return [x for x in self.handled if self._next_try.get(x.pattern, 0.0) <= now]

    def poke(self) -> None:
        """An event may have become due (a NOTIFY, a due time): look at every pattern now."""
        if self.limits:
            self._next_try.clear()
            self._sort_at = min(self._sort_at, self._sorted_at + FLOW_RECHECK)
            self._room.set()

    def room_freed(self, topics: Collection[str]) -> None:
        """Some of this worker's events finished (of ``topics``): a full pattern
        may have room again, and a fifo_by pattern the next event of a key."""
        # A fifo_by key's next event waits for the running one, whichever way
        # the last claim of the pattern went: a finish of the pattern's own
        # events claims again (left to FLOW_IDLE_RECHECK, a key's backlog ran
        # one event a second).
        freed = [p for p in self._fifo_handled if any(p.matches(t) for t in topics)]
        if self._full or freed:
            # At once, unless this worker claimed the pattern within FLOW_GATHER:
            # then the finishes until then go into one claim. A claim per
            # finished event would cost the database as much as the events of
            # an unlimited topic it could claim instead; a fixed wait after
            # every finish would leave short events' slots empty most of the
            # time (10 ms events ran 2.4 of 5 on average with a 20 ms wait).
            now = time.monotonic()
            for pattern in {*self._full, *(p.text for p in freed)}:
                soon = max(now, self._claimed_at.get(pattern, 0.0) + FLOW_GATHER)
                self._next_try[pattern] = min(self._next_try.get(pattern, soon), soon)
            self._room.set()

    async def wait_until_due(self, stopping: asyncio.Event) -> None:
        """Sleep until some pattern may have room (or the limits are to be read again)."""
        if self.handled:
            wait = min(min(self._next_try.get(x.pattern, 0.0) for x in self.handled),
                       self._sort_at) - time.monotonic()
        elif self.limits:
            wait = min(self._sort_at - time.monotonic(), FLOW_REFRESH)
        else:
            wait = FLOW_REFRESH
        if wait <= 0:
            return
        self._room.clear()
        room, stop = asyncio.ensure_future(self._room.wait()), asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({room, stop}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            room.cancel()
            stop.cancel()

    def most_claimable(self, batch_size: int) -> int:
        """The most events one flow claim can take: what it reserves beforehand."""
        return min(batch_size, sum(x.max_running or batch_size for x in self.handled))

    def stale(self) -> bool:
        return self._expired or time.monotonic() - self._read_at >= FLOW_REFRESH

    def expire(self) -> bool:
        """An operator changed a limit (a ``!control`` notification): read the limits at
        the next claim; returns whether that claim is worth waking for now."""
        self._expired = True
        return time.monotonic() - self._read_at >= CONTROL_REREAD_MIN

    async def declare(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Write this router's limits (a new pattern starts with a full bucket)."""
        if not self.declared:
            return
        d = self.declared
        await conn.execute(self._q["flow_declare"], {
            "patterns": [x.pattern for x in d], "max_runnings": [x.max_running for x in d],
            "rates": [x.rate for x in d], "bursts": [x.burst for x in d],
            "fair_bys": [x.fair_by for x in d], "fifo_bys": [x.fifo_by for x in d]})

    async def refresh(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Read every limit of the fleet; on a change (or the first read), send
        the events no limit covers any more back to the open lane."""
        # Before the read: a notification that comes during it asks for another.
        self._expired = False
        # Under the lanes' lock: a sort of the flow loop, on its own connection,
        # with the limits read before, must not move events back into the
        # limited lane after the unsort below (nothing would bring them out
        # again for UNSORT_EVERY seconds).
        async with self._lanes:
            cur = await conn.execute(self._q["flow_list"])
            limits = [FlowLimit(*row) for row in await cur.fetchall()]
            patterns = [x.pattern for x in limits]
            now = time.monotonic()
            changed = patterns != [x.pattern for x in self.limits] or self._read_at == -math.inf
            if changed or now - self._unsorted_at >= UNSORT_EVERY:
                params = {**sql_params(patterns, prefix="limit_"), "batch": UNSORT_BATCH}
                while True:
                    cur = await conn.execute(self._q["flow_unsort"], params)
                    if cur.rowcount < UNSORT_BATCH:
                        break
                self._unsorted_at = now
            if changed:
                self._sort_params = {**sql_params(patterns, prefix="limit_"),
                                     "window": SORT_WINDOW_MAX}
                self._sort_at = 0.0
            self.limits = limits
        self._fifo = [x.pattern for x in limits if x.fifo_by is not None]
        routes = self._router.routes
        self.handled = [x for x in limits
                        if any(TopicPattern(r.pattern).overlaps(TopicPattern(x.pattern)) for r in routes)]
        self._fifo_handled = [TopicPattern(x.pattern) for x in self.handled if x.fifo_by is not None]
        self._read_at = time.monotonic()
        if changed:
            self.poke()     # the flow claims may have patterns to claim, or none any more

    async def sort(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """Move the limited patterns' events at the open lane's front to the limited
        lane, if a sort is due; returns how many moved."""
        now = time.monotonic()
        if not self.limits or now < self._sort_at:
            return 0
        async with self._lanes:
            if not self.limits:
                return 0        # a read while this sort waited found none any more
            params = self._sort_params
            window = params["window"]
            if self._fifo:
                # The fleet's sorts take turns while a key's order is at stake
                # (flow.sql's flow_sort_lock); one that finds another at it leaves
                # the work to it.
                async with conn.transaction():
                    cur = await conn.execute(self._q["flow_sort_lock"], self._sort_lock)
                    row = await cur.fetchone()
                    if not (row and row[0]):
                        self._sort_at = now + FLOW_RECHECK
                        return 0
                    cur = await conn.execute(self._q["flow_sort"], params)
            else:
                cur = await conn.execute(self._q["flow_sort"], params)
        moved = max(cur.rowcount, 0)
        self.sorted += moved
        self._sorted_at = now
        if moved * 2 > window:
            params["window"] = min(window * 2, SORT_WINDOW_MAX)
            self._sort_at = now
        elif moved:
            self._sort_at = now + FLOW_RECHECK
        else:
            params["window"] = max(window // 2, SORT_WINDOW_MIN)
            self._sort_at = now + FLOW_IDLE_RECHECK
        if moved:
            self._next_try.clear()     # the flow claims have new events to look at
        return moved

    def plain_params(self) -> dict[str, Any]:
        """What the plain claim leaves out: every limited pattern (and the fifo_by
        ones it must not even move: only the sorts do, event_claim_flow says why)."""
        return {**sql_params([x.pattern for x in self.limits], prefix="except_"),
                **sql_params(self._fifo, prefix="fifo_")}

    async def claim(self, conn: psycopg.AsyncConnection[Any], want: int,
                    params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Claim up to ``want`` events of the patterns due, each within its limit.

        ``params``: the worker's own claim parameters (topics, tenants, owner, lease).
        """
        rows: list[tuple[Any, ...]] = []
        await self.sort(conn)
        due = self._due(time.monotonic())
        if not due:
            return rows
        # Start with another pattern each time, so one busy pattern does not
        # always take the free slots first.
        self._turn = (self._turn + 1) % len(due)
        for limit in due[self._turn:] + due[:self._turn]:
            if want - len(rows) <= 0:
                break
            rows += await self._claim_one(conn, limit, want - len(rows), params)
        return rows

    def _schedule(self, pattern: str, full: bool, retry_in: float | None = None) -> None:
        # The rate limit's next token; or the recheck of a full or an empty pattern.
        wait = max(retry_in, 0.001) if retry_in is not None \
            else FLOW_RECHECK if full else FLOW_IDLE_RECHECK
        self._next_try[pattern] = time.monotonic() + wait
        if full:
            self._full.add(pattern)
        else:
            self._full.discard(pattern)

    async def _claim_one(self, conn: psycopg.AsyncConnection[Any], limit: FlowLimit, want: int,
                         params: dict[str, Any]) -> Sequence[tuple[Any, ...]]:
        q = self._q
        async with conn.transaction():
            cur = await conn.execute(q["flow_lock"], {"pattern": limit.pattern})
            row = await cur.fetchone()
            if row is None:
                self._schedule(limit.pattern, full=True)   # another worker is claiming it
                return []
            max_running, rate, burst, tokens, idle_s = row
            budget = want
            retry_in = None
            if max_running is not None:
                cur = await conn.execute(q["flow_running"], sql_params([limit.pattern]))
                running = (await cur.fetchone() or (0,))[0]
                budget = min(budget, max_running - running)
            if rate is not None:
                tokens = min(burst, tokens + idle_s * rate)
                if tokens < 1:
                    retry_in = (1 - tokens) / rate
                budget = min(budget, math.floor(tokens))
            if budget <= 0:
                self._schedule(limit.pattern, full=True, retry_in=retry_in)
                if rate is not None:
                    await conn.execute(q["flow_take_tokens"],
                                       {"pattern": limit.pattern, "tokens": tokens})
                return []
            self._claimed_at[limit.pattern] = time.monotonic()
            claim = {**params, **sql_params([limit.pattern], prefix="limit_"), "limit": budget,
                     "pattern": limit.pattern}
            if limit.fifo_by is not None:
                query = q["flow_claim_fifo"]
                claim.update(limit.fifo_params)
            else:
                query = q["flow_claim_fair" if limit.fair_by == "tenant" else "flow_claim"]
            cur = await conn.execute(query, claim)
            claimed = await cur.fetchall()
            if rate is not None:
                await conn.execute(q["flow_take_tokens"],
                                   {"pattern": limit.pattern, "tokens": tokens - len(claimed)})
            # A claim the budget cut short may have more waiting; a short one means
            # the pattern has nothing more due now (under fifo_by, a key's next
            # event may wait for a running one: room_freed claims at its finish).
            self._schedule(limit.pattern, full=len(claimed) == budget)
            return claimed
