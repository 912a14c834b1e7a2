"""``work_event``: run one event through the real executor inside your transaction.

The event is claimed with the worker's own claim query, its handler runs
through the worker's own :class:`~conveyor.worker.executor.Executor` (the
inline, thread and async paths, the deadline sweep, outcome signals, backoff:
exactly what a worker runs), and the outcome is written with the worker's
fenced acknowledgement queries, all on the connection you pass. So it works
inside a test transaction that is rolled back afterwards.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from conveyor.config import HANDLER_TIMEOUT_DEFAULT
from conveyor.db.named_queries import Queries, queries_for
from conveyor.db.rows import event_from_claim_row, record_from_event_get_row
from conveyor.retry import BackoffPolicy, RetryPolicy
from conveyor.router import Route, Router
from conveyor.types import Event, EventRecord, EventState
from conveyor.validation import check_tenant
from conveyor.worker.executor import Executor, Outcome
from conveyor.worker.running import RunningSet

# The lease only has to outlive the handler: nobody else can see the claim
# before the caller's transaction commits.
_LEASE_MARGIN = 60.0


@dataclass(frozen=True, slots=True)
class WorkedEvent:
    """One event run by :func:`work_event`.

    Attributes:
        event: the event as the handler received it.
        outcome: what the executor decided (state, retry delay, error).
        record: the event row after the outcome was written.
    """

    event: Event
    outcome: Outcome
    record: EventRecord


@dataclass(frozen=True, slots=True)
class _Claim:
    owner: str
    route: Route
    event: Event
    timeout: float


def _claim_params(router: Router, owner: str, timeout: float,
                  tenants: Sequence[str] | None) -> dict[str, Any]:
    # The same filter a worker with WorkerConfig(tenants=...) uses.
    chosen = None if tenants is None else [t for t in tenants if check_tenant(t)]
    return {**router.claim_filter(), "all_tenants": chosen is None, "tenants": chosen or [],
            "limit": 1, "owner": owner, "lease_ttl": timeout + _LEASE_MARGIN}


def _prepare(router: Router, owner: str, row: Any, timeout: float | None) -> _Claim:
    event = event_from_claim_row(row)   # the worker's own decoder of the claim row
    route = router.resolve(event.topic)
    if route is None:  # the claim filter makes this unreachable
        raise AssertionError(f"router claimed topic {event.topic!r} it cannot route")
    return _Claim(owner, route, event, timeout or route.timeout or HANDLER_TIMEOUT_DEFAULT)


def _ack(q: Queries, owner: str, outcome: Outcome) -> tuple[str, dict[str, Any]]:
    """The worker's fenced acknowledgement for one outcome (as the completer writes it)."""
    if outcome.state is EventState.SUCCEEDED:
        return q["event_succeed_many"], {
            "owner": owner, "ids": [outcome.event_id], "attempts": [outcome.attempt]}
    return q["event_settle_many"], {
        "owner": owner, "ids": [outcome.event_id], "attempts": [outcome.attempt],
        "states": [outcome.state.value], "delays": [outcome.delay],
        "refunds": [outcome.refund], "errors": [outcome.error],
        "tracebacks": [outcome.traceback]}


async def _run(claim: _Claim, router: Router, backoff: RetryPolicy | None) -> Outcome:
    """Run the claimed event through the worker's executor, as a worker of one slot would."""
    running = RunningSet(1)
    outcomes: list[Outcome] = []
    # The same precedence as the worker: the route's policy, then the caller's.
    executor = Executor(router, running, outcomes.append, handler_timeout=claim.timeout,
                        backoff=backoff or BackoffPolicy(), timeout=claim.timeout, threads=2)
    running.take([claim.event])
    try:
        executor.start([claim.event])
        await asyncio.gather(*running.tasks())
    finally:
        executor.close()
    if not outcomes:  # only a cancellation from outside gets here
        raise AssertionError(f"event {claim.event.id}'s handler ended without an outcome")
    return outcomes[0]


def _no_running_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError("work_event() cannot run inside an event loop; "
                       "use 'await work_event_async(...)' in async tests")


def work_event(
    conn: psycopg.Connection[Any],
    router: Router,
    *,
    backoff: RetryPolicy | None = None,
    timeout: float | None = None,
    tenants: Sequence[str] | None = None,
    schema: str = "conveyor",
) -> WorkedEvent | None:
    """Claim the next due event ``router`` handles, run its handler, write the outcome.

    Everything happens in ``conn``'s current transaction, so the events your
    test enqueued on ``conn`` are visible and a final rollback undoes it all.
    Returns ``None`` when no due event matches the router. The handler runs
    while the event row is locked by ``conn``'s transaction: a handler that
    updates the same event row on another connection would wait forever.

    ``backoff`` stands in for the worker's ``WorkerConfig.backoff``: a route's
    own ``backoff`` still wins, as in a worker. ``tenants`` limits the claim
    like ``WorkerConfig.tenants``.

    Defaults: ``backoff`` ``BackoffPolicy()``, ``timeout`` the route's timeout or
    300 s, every tenant, schema ``"conveyor"``.

    Example::

        def test_charge_retries_when_gateway_is_down(conn):
            Producer().enqueue(conn, "billing.charge", {"amount": 5})
            worked = work_event(conn, router)
            assert worked is not None and worked.record.state is EventState.PENDING
            assert "gateway down" in worked.record.last_error
    """
    _no_running_loop()
    q = queries_for(schema)
    owner = str(uuid.uuid4())
    cur = conn.cursor(row_factory=tuple_row)  # whatever the connection's row_factory
    row = cur.execute(q["event_claim"], _claim_params(
        router, owner, timeout or HANDLER_TIMEOUT_DEFAULT, tenants)).fetchone()
    if row is None:
        return None
    claim = _prepare(router, owner, row, timeout)
    outcome = asyncio.run(_run(claim, router, backoff))
    query, params = _ack(q, owner, outcome)
    if cur.execute(query, params).fetchone() is None:
        raise AssertionError(f"event {claim.event.id} changed hands while its handler ran")
    after = cur.execute(q["event_get"], {"id": claim.event.id}).fetchone()
    if after is None:
        raise AssertionError(f"event {claim.event.id} vanished after its outcome was written")
    return WorkedEvent(claim.event, outcome, record_from_event_get_row(after))


async def work_event_async(
    conn: psycopg.AsyncConnection[Any],
    router: Router,
    *,
    backoff: RetryPolicy | None = None,
    timeout: float | None = None,
    tenants: Sequence[str] | None = None,
    schema: str = "conveyor",
) -> WorkedEvent | None:
    """The async twin of :func:`work_event`.

    Example::

        async def test_welcome(aconn):
            await AsyncProducer().enqueue(aconn, "email.send", {"to": "ada@example.com"})
            worked = await work_event_async(aconn, router)
            assert worked is not None and worked.outcome.state is EventState.SUCCEEDED
    """
    q = queries_for(schema)
    owner = str(uuid.uuid4())
    cur = conn.cursor(row_factory=tuple_row)  # whatever the connection's row_factory
    await cur.execute(q["event_claim"], _claim_params(
        router, owner, timeout or HANDLER_TIMEOUT_DEFAULT, tenants))
    row = await cur.fetchone()
    if row is None:
        return None
    claim = _prepare(router, owner, row, timeout)
    outcome = await _run(claim, router, backoff)
    query, params = _ack(q, owner, outcome)
    await cur.execute(query, params)
    if await cur.fetchone() is None:
        raise AssertionError(f"event {claim.event.id} changed hands while its handler ran")
    await cur.execute(q["event_get"], {"id": claim.event.id})
    after = await cur.fetchone()
    if after is None:
        raise AssertionError(f"event {claim.event.id} vanished after its outcome was written")
    return WorkedEvent(claim.event, outcome, record_from_event_get_row(after))
