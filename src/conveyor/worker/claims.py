"""The claim side of a worker: the fetch loop, and which claim to send.

Two loops fill the worker's :class:`~conveyor.worker.running.RunningSet`:

- the fetch loop sends the plain claim on the fetch connection, as soon as a
  quarter of a batch of slots is free and a wake-up (a NOTIFY, a due time,
  a freed slot) or the poll interval says so;
- the flow claims take the limited patterns' events
  (:class:`~conveyor.worker.flow.FlowControl`) on a connection of its own, so
  its short transactions never delay a plain claim: a service of its own,
  :class:`~conveyor.worker.flow_claims.FlowClaims`.

The plain claim is one of four statements: ``event_claim`` unless flow limits
exist (``event_claim_flow``, which leaves their events to the flow loop), each
in a pause-aware variant used only while :class:`~conveyor.worker.wakeups.PauseState`
says a pause may be in force. ``event_claim_flow`` also says, in its ``moved``
column, how many limited events it moved to their lane instead of claiming.
With claim windows (``WorkerConfig.claim_window``) and no flow limit, the
plain claim is ``event_claim_held`` instead, and each batch is run through a
window (:mod:`conveyor.worker.window`) before the next claim.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from conveyor.config import WorkerConfig
from conveyor.db.arrays import text_array
from conveyor.db.named_queries import Queries
from conveyor.db.rows import CLAIM_PRIORITY, claim_cursor
from conveyor.router import Router
from conveyor.types import CLAIM_COLUMNS, Event
from conveyor.worker.classify import Outcome
from conveyor.worker.completer import Completer
from conveyor.worker.connection import (
    RECOVERABLE_ERRORS,
    CursorCache,
    ManagedConnection,
    StopRequested,
)
from conveyor.worker.deadline import StopFlag, with_deadline, with_deadline_in_task
from conveyor.worker.executor import Executor
from conveyor.worker.flow import FlowControl
from conveyor.worker.running import RunningSet
from conveyor.worker.sessions import WorkerConnections
from conveyor.worker.stats import WorkerStats
from conveyor.worker.wake_hold import FetchHold
from conveyor.worker.wakeups import PauseState
from conveyor.worker.window import ClaimWindows

log = logging.getLogger(__name__)

_PRIORITY = operator.itemgetter(CLAIM_PRIORITY)
# event_claim_flow's rows: the claimed event's columns, then `moved`.
_EVENT_COLUMNS = len(CLAIM_COLUMNS)


def claim_filter(router: Router, tenants: Sequence[str] | None) -> dict[str, Any]:
    """The claim parameters that say which events a worker claims: ``router``'s
    topics, of ``tenants`` (None: every tenant's)."""
    params = {**router.claim_filter(), "all_tenants": tenants is None,
              "tenants": list(tenants or ())}
    # Array parameters as literals, rendered once: psycopg would adapt each
    # list element by element on every claim.
    return {k: text_array(v) if isinstance(v, list) else v for k, v in params.items()}


class Claims:
    """Claims events into ``running`` and starts their handlers on ``executor``.

    ``flow``: the fleet's flow limits, as this worker sees them.

    ``claim_filter``: the worker's topics and tenants as claim parameters
    (:func:`claim_filter`). ``completer``'s flush size follows the claim size,
    so acknowledgements are written in batches as large as the claims.

    With claim windows (``connections`` has a window record connection), the
    claims hold their batches in :attr:`windows`, which ``completer`` hands
    their outcomes to while they are open; ``on_window_written`` takes each
    batch of outcomes a window wrote, as the completer's ``on_acked`` does.
    """

    def __init__(self, connections: WorkerConnections, queries: Queries, config: WorkerConfig,
                 worker_id: str, flow: FlowControl, claim_filter: dict[str, Any], *,
                 running: RunningSet, executor: Executor, completer: Completer,
                 stats: WorkerStats, stopping: StopFlag,
                 on_window_written: Callable[[list[Outcome], set[int]], None]) -> None:
        self.connections = connections
        self._q = queries
        self.config = config
        self.id = worker_id
        self._filter = claim_filter
        self.running = running
        self.executor = executor
        self.completer = completer
        self.stats = stats
        self._stopping = stopping
        self.flow = flow
        self.windows: ClaimWindows | None = None
        if connections.record is not None:
            self.windows = completer.windows = ClaimWindows(
                connections.claimers(), connections.record, queries, worker_id, running,
                start=executor.start, hand_on=completer.add, on_written=on_window_written,
                duration=config.claim_window, lease_ttl=config.lease_ttl,
                query_timeout=config.query_timeout, delete_succeeded=config.retention == 0)
        self.pauses = PauseState(self.wake)
        # The wake gate, held while this worker may wait for a wake-up (worker/wake_hold.py).
        self.hold = FetchHold(queries, connections.fetch, flow,
                              enabled=(config.listen and config.transaction_pooler is not True
                                       and self.windows is None),
                              query_timeout=config.query_timeout)
        self.woken = asyncio.Event()
        self._deferred: list[list[Event]] = []   # claimed batches whose handlers start next round
        self._rng = random.Random()
        # A cursor per claim connection (two with claim windows), and the
        # connection the last claim handed to its window (not to be given back here).
        self._cursors = {c.role: CursorCache(binary=True, setup=claim_cursor)
                         for c in connections.claimers()}
        self._held: ManagedConnection | None = None
        # How many limited events the last plain claim moved to their lane.
        self.moved = 0

    def wake(self) -> None:
        """Ask the fetch loop and the flow claims to claim now (a NOTIFY, a freed slot)."""
        self.woken.set()
        self.flow.poke()

    def claim_params(self, **extra: Any) -> dict[str, Any]:
        return {**self._filter, "owner": self.id, "lease_ttl": self.config.lease_ttl, **extra}

    async def fetch_loop(self) -> None:
        """Claim with the plain claim until a stop is requested."""
        c = self.config
        running = self.running
        threshold = max(1, min(c.batch_size, c.concurrency) // 4)
        size, limit = c.batch_size, c.claim_limit
        while not self._stopping.is_set():
            free = running.free_slots()
            if free < threshold:
                await running.wait_for_slot()
                continue
            want = min(free, size)
            self.woken.clear()
            claimed = await self.claim(want, defer=True)
            if claimed is None:
                continue
            if len(claimed) == want:
                # A full claim: the backlog is deeper than one batch. Fewer,
                # larger statements drain it faster (each claim and each
                # acknowledgement costs a round trip and a statement start), so
                # the next claim may take up to twice as many, up to the free
                # slots (River caps a fetch at them too) and max_batch_size; the
                # acknowledgements are written in batches as large.
                if size < limit:
                    size = min(size * 2, limit)
                    self.completer.flush_size = size
                await self.hold.after_full_claim()
                continue
            if self.moved:
                # The claim met limited events and moved them out of the open
                # lane: what is behind them may be claimable now.
                continue
            if size != c.batch_size:
                # Caught up: single events and small bursts go back to small
                # claims and to acknowledgements flushed at batch_size.
                size = c.batch_size
                self.completer.flush_size = size
            if await self.hold.before_wait():
                continue     # a producer that sent no wake-up has ended: claim again
            if not await self._idle_wait() and self.windows is not None:
                await self._poll_after_windows(self.windows)

    async def _poll_after_windows(self, windows: ClaimWindows) -> None:
        """A poll, not a wake: the safety net's claim waits for the open windows
        (each closes within claim_window) rather than open a second connection
        for itself; a wake meanwhile claims at once."""
        if not windows.open_windows:
            return
        settled = asyncio.ensure_future(windows.settle())
        woken = asyncio.ensure_future(self.woken.wait())
        try:
            await asyncio.wait({settled, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            settled.cancel()
            woken.cancel()

    async def _idle_wait(self) -> bool:
        """Wait for a wake or the poll; whether woken."""
        poll = self.hold.wait_at_most(self.config.poll_interval * (1 - 0.1 * self._rng.random()))
        # asyncio.timeout, not wait_for: no task in between, so a NOTIFY reaches
        # the next claim a few loop rounds (~40 us on an idle machine) sooner.
        try:
            async with asyncio.timeout(poll):
                await self.woken.wait()
        except TimeoutError:
            return False
        return True

    def _statement(self, params: dict[str, Any]) -> tuple[str, bool]:
        """The plain claim to send, and whether it is event_claim_flow (rows end in `moved`)."""
        flow = self.flow
        if flow.active:
            # The plain claim leaves the limited patterns to the flow claim.
            params.update(flow.plain_params())
            return self._q["event_claim_flow_unpaused" if self.pauses.any
                           else "event_claim_flow"], True
        # The plain claim unless a pause may be in force (wakeups.PauseState).
        claim = "event_claim_held" if self.windows is not None else "event_claim"
        return self._q[f"{claim}_unpaused" if self.pauses.any else claim], False

    async def claim(self, want: int, *, defer: bool = False) -> list[Event] | None:
        """Claim up to ``want`` events and start them; ``None`` after a database error."""
        if self.windows is None:
            fetch = self.connections.fetch
            return await self._claim(fetch, self._cursors[fetch.role], want, defer)
        # With claim windows, on a connection no open window holds.
        claimer = await self.windows.acquire()
        try:
            return await self._claim(claimer, self._cursors[claimer.role], want, defer)
        finally:
            if claimer is not self._held:
                self.windows.release(claimer)
            self._held = None

    async def _claim(self, fetch: ManagedConnection, cursor: CursorCache, want: int,
                     defer: bool) -> list[Event] | None:
        try:
            conn = await fetch.get()
            # Binary results: the server skips formatting ids and timestamps as
            # text and the client skips parsing them (hot path, measured: see
            # docs/benchmarks.md).
            cur = cursor.get(conn)
            if self.flow.stale():
                await with_deadline(conn, self.flow.refresh(conn), self.config.query_timeout)
            params = {**self._filter, "limit": want, "owner": self.id,
                      "lease_ttl": self.config.lease_ttl}
            query, counts_moves = self._statement(params)
            windows = None if counts_moves else self.windows
            sent = time.monotonic()
            if windows is not None:
                rows = await windows.begin(fetch, conn, query, params, self._stopping)
            else:
                await with_deadline_in_task(conn, cur.execute(query, params),
                                            self.config.query_timeout, stopping=self._stopping)
                rows = await cur.fetchall()
            self.moved = 0
            if counts_moves and rows:
                self.moved = rows[0][_EVENT_COLUMNS]
                self.flow.sorted += self.moved
                rows = [] if rows[0][0] is None else [r[:_EVENT_COLUMNS] for r in rows]
            if len(rows) > 1:
                # The claim picks by priority but returns in join order; a stable
                # sort keeps the rest of that order (O(n) when all are equal).
                rows.sort(key=_PRIORITY, reverse=True)
        except StopRequested:
            return None
        except RECOVERABLE_ERRORS as exc:
            await fetch.discard(exc)
            return None
        except psycopg.Error as exc:
            log.error("claiming events failed: %s", exc, extra={"action": "claim_failed"})
            await fetch.pause_after_failure()
            return None
        from_row = Event._from_claim_row
        events = [from_row(r) for r in rows]
        if events and windows is None and self.handed_back_late(events, sent):
            return []
        stats = self.stats
        stats.claimed += len(events)
        if events:
            stats.claims += 1
        stats.last_claim_at = time.monotonic()
        if not events and not self.moved:
            # Caught up: a multi-tenant supervisor may park this worker (tenancy/turns.py).
            stats.last_empty_claim_at = stats.last_claim_at
        # The slots are taken now; the handlers start on the loop's next round,
        # after the fetch loop has sent its next claim, so the database works
        # on that claim while this batch's handlers start.
        self.running.take(events, held=windows is not None)
        if windows is not None and events:
            # Held: the window starts the handlers, and this connection's
            # transaction is the window's until it closes.
            self._held = fetch
            return await windows.hold(fetch, conn, events)
        # Only a full batch is followed at once by another claim; a short one
        # (the idle worker woken for one event) starts its handlers now.
        if defer and len(events) == want:
            self._deferred.append(events)
            asyncio.get_running_loop().call_soon(self.start_deferred)
        else:
            self.executor.start(events)
        return events

    def handed_back_late(self, events: list[Event], sent: float) -> bool:
        """Whether the claim of ``events``, sent at ``sent`` (``time.monotonic()``), was
        answered only after their leases could have run out (a network path that
        stalled and came back): another worker may have been given them already.
        If so they are handed back, unrun: fenced like any acknowledgement, so the
        hand-back is written only where the lease is still this worker's, and the
        attempt the claim counted is given back."""
        answered_after = time.monotonic() - sent
        if answered_after < self.config.lease_ttl:
            return False
        log.warning("a claim of %d events was answered after %.1fs, past the %gs lease: "
                    "handed back unrun", len(events), answered_after, self.config.lease_ttl,
                    extra={"action": "claim_late", "events": len(events)})
        self.running.take(events)
        for event in events:
            self.completer.add(Outcome.handed_back(event))
        self.stats.handed_back += len(events)
        return True

    def start_deferred(self) -> None:
        # Claimed events start even when a stop came in between, so they finish
        # within the shutdown timeout like the rest.
        while self._deferred:
            self.executor.start(self._deferred.pop(0))

    async def drain(self, timeout: float) -> None:
        """The claims' part of a shutdown: every claimed event finished within
        ``timeout``, cancelled after it, or handed back without spending an attempt."""
        self.start_deferred()
        if self.windows is not None:
            # Each open window closes within claim_window: its unfinished events
            # are leased by then, and drain like any others.
            await self.windows.settle()
        pending = self.running.unfinished_tasks()
        if pending:
            log.info("waiting up to %.0fs for %d running handlers", timeout, len(pending),
                     extra={"action": "draining"})
            _done, late = await asyncio.wait(pending, timeout=timeout)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        for event in self.running.hand_back(self.completer.unacknowledged()):
            self.completer.add(Outcome.handed_back(event))
            self.stats.handed_back += 1

    async def run_once(self) -> list[Event]:
        """One plain claim of a batch, then the limited patterns' events as the flow
        loop would claim them; every one run to its end, its outcome written (its
        window closed, the completer flushed). For tests (``Worker.run_once``)."""
        want = min(self.running.free_slots(), self.config.batch_size)
        claimed = await self.claim(want) or []
        if self.flow.active and len(claimed) < want:
            self.flow.poke()
            conn = await self.connections.fetch.get()
            rows = await self.flow.claim(conn, want - len(claimed), self.claim_params())
            events = [Event._from_claim_row(r) for r in rows]
            self.running.take(events)
            self.executor.start(events)
            claimed += events
        if claimed:
            await asyncio.gather(*self.running.tasks(), return_exceptions=True)
            if self.windows is not None:
                await self.windows.settle()
            await self.completer.flush()
        return claimed
