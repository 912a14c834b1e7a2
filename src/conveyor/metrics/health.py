"""Is a worker alive (``/healthz``) and ready (``/readyz``)? Read from its state, no query.

Both read plain attributes only, so they answer from any thread, including
while a handler blocks the worker's event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.multitenant import MultiTenantWorker
    from conveyor.worker import Worker


@dataclass(frozen=True, slots=True)
class Check:
    """One answer: ``ok`` and, when not ok, why (one line)."""

    ok: bool
    reason: str


def loop_lag(worker: Worker) -> float | None:
    """Seconds since the worker's event loop last ran; None when its loops are not running."""
    watchdog = worker.watchdog
    # The watchdog's thread exists exactly while run() is inside its main phase:
    # it is stopped in run()'s finally, whether run() returned or raised.
    if not watchdog.watching:
        return None
    return watchdog.lag()


def claim_limit(worker: Worker) -> float:
    """Seconds without a claim round trip after which a worker with free slots is unhealthy.

    The fetch loop claims at least every poll_interval; a claim may take up to
    query_timeout; twice the poll leaves room for one slow round.
    """
    c = worker.config
    return 2 * c.poll_interval + c.query_timeout


def health(worker: Worker) -> Check:
    """Alive: started, loops running, loop not blocked past the lease, a recent claim."""
    if not worker.started.is_set():
        return Check(False, "worker not started")
    lag = loop_lag(worker)
    if lag is None:
        return Check(False, "worker loops ended")
    lease = worker.config.lease_ttl
    if lag >= lease:
        return Check(False, f"event loop blocked for {lag:.1f}s, past the lease ({lease:g}s)")
    since = time.monotonic() - worker.stats.last_claim_at
    # A worker whose slots are all taken does not claim, and is not stuck for it.
    if since > claim_limit(worker) and worker.running.free_slots() > 0:
        return Check(False, f"no claim round trip for {since:.1f}s "
                            f"(expected one within {claim_limit(worker):g}s)")
    scheduler = worker.scheduler
    if scheduler is not None:
        since = time.monotonic() - scheduler.last_pass
        if since > scheduler_limit(worker):
            return Check(False, f"cron scheduler has not completed a pass for {since:.1f}s "
                                f"({scheduler.failures} failed passes; see the worker's log)")
    return Check(True, "ok")


def scheduler_limit(worker: Worker) -> float:
    """Seconds without a completed cron pass after which the worker is unhealthy.

    The loop completes a pass at least every second; one pass may wait for a
    statement up to query_timeout per schedule it fires, and a failed pass
    pauses a second before the next.
    """
    return 2 * worker.config.query_timeout + 5.0


def readiness(worker: Worker) -> Check:
    """Ready: started (so the schema is current), connected, not shutting down."""
    if not worker.started.is_set():
        return Check(False, "worker not started (schema not yet checked)")
    if worker.stopping:
        return Check(False, "worker shutting down")
    if loop_lag(worker) is None:
        return Check(False, "worker loops ended")
    if not worker.connections.fetch.connected:
        return Check(False, "worker not connected to the database")
    return Check(True, "ok")


def _tenant_checks(multi: MultiTenantWorker, check: Callable[[Worker], Check]) -> Check:
    """Every tenant's answer: ok only when all are ok; the reason names the ones that are not."""
    if not multi.started.is_set():
        return Check(False, "multi-tenant worker not started")
    failing = []
    for name, state in sorted(multi.tenants.items()):
        if state.worker is None or not state.running:
            # Parked (nothing to do, or waiting for its turn) is healthy; failing is not.
            if state.error is not None:
                failing.append(f"{name}: {state.error}")
            continue
        answer = check(state.worker)
        if not answer.ok:
            failing.append(f"{name}: {answer.reason}")
    if failing:
        return Check(False, "; ".join(failing))
    return Check(True, f"ok ({len(multi.tenants)} tenants)")


def tenants_health(multi: MultiTenantWorker) -> Check:
    """``/healthz`` of ``worker-multi``: every tenant's worker alive (see :func:`health`)."""
    return _tenant_checks(multi, health)


def tenants_readiness(multi: MultiTenantWorker) -> Check:
    """``/readyz`` of ``worker-multi``: every tenant's worker ready (see :func:`readiness`)."""
    return _tenant_checks(multi, readiness)


def checks_for(target: Worker | MultiTenantWorker) -> tuple[Callable[[], Check], Callable[[], Check]]:
    """(health, readiness) of a worker or of a multi-tenant worker, as callables."""
    from conveyor.multitenant import MultiTenantWorker

    if isinstance(target, MultiTenantWorker):
        multi = target
        return (lambda: tenants_health(multi)), (lambda: tenants_readiness(multi))
    worker = target
    return (lambda: health(worker)), (lambda: readiness(worker))
