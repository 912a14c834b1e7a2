"""The I/O-free half of ``work_event``: claim parameters, the handler run, the acknowledgement.

Shared by :mod:`conveyor.testing.working_async` and its generated sync twin.
Running the handler needs an event loop but no connection: the sync twin
runs it on a loop of its own (:func:`_run`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.config import HANDLER_TIMEOUT_DEFAULT
from conveyor.db.rows import event_from_claim_row
from conveyor.holder import Holder
from conveyor.middleware import Middleware
from conveyor.retry import BackoffPolicy, RetryPolicy
from conveyor.router import Route, Router
from conveyor.types import Event, EventRecord
from conveyor.validation import check_tenant
from conveyor.worker.classify import Outcome
from conveyor.worker.executor import Executor
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
    holder: Holder      # what conveyor.complete() in the handler fences on


def _claim_params(router: Router, owner: str, timeout: float,
                  tenants: Sequence[str] | None) -> dict[str, Any]:
    # The same filter a worker with WorkerConfig(tenants=...) uses.
    chosen = None if tenants is None else [t for t in tenants if check_tenant(t)]
    return {**router.claim_filter(), "all_tenants": chosen is None, "tenants": chosen or [],
            "limit": 1, "owner": owner, "lease_ttl": timeout + _LEASE_MARGIN}


def _prepare(router: Router, owner: str, row: Any, timeout: float | None, schema: str) -> _Claim:
    event = event_from_claim_row(row)   # the worker's own decoder of the claim row
    route = router.resolve(event.topic)
    if route is None:  # the claim filter makes this unreachable
        raise AssertionError(f"router claimed topic {event.topic!r} it cannot route")
    return _Claim(owner, route, event, timeout or route.timeout or HANDLER_TIMEOUT_DEFAULT,
                  Holder(owner, schema, result_limit=router.result_limit))


async def _run_async(claim: _Claim, router: Router, backoff: RetryPolicy | None,
                     middleware: Sequence[Middleware] = ()) -> Outcome:
    """Run the claimed event through the worker's executor, as a worker of one slot would."""
    running = RunningSet(1, claim.holder)
    outcomes: list[Outcome] = []
    # The same precedence as the worker: the route's policy, then the caller's.
    executor = Executor(router, running, outcomes.append, handler_timeout=claim.timeout,
                        backoff=backoff or BackoffPolicy(), timeout=claim.timeout, threads=2,
                        middleware=middleware)
    running.take([claim.event])
    try:
        executor.start([claim.event])
        await asyncio.gather(*running.tasks())
    finally:
        executor.close()
    if not outcomes:  # only a cancellation from outside gets here
        raise AssertionError(f"event {claim.event.id}'s handler ended without an outcome")
    return outcomes[0]


def _run(claim: _Claim, router: Router, backoff: RetryPolicy | None,
         middleware: Sequence[Middleware] = ()) -> Outcome:
    """:func:`_run_async` on an event loop of its own."""
    return asyncio.run(_run_async(claim, router, backoff, middleware))


def _no_running_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError("work_event() cannot run inside an event loop; "
                       "use 'await work_event_async(...)' in async tests")
