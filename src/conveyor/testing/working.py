# Generated from src/conveyor/testing/working_async.py by scripts/unasync.py; DO NOT EDIT.
"""``work_event``: run one event through the real executor inside your transaction.

The event is claimed with the worker's own claim query, its handler runs
through the worker's own :class:`~conveyor.worker.executor.Executor` (the
inline, thread and async paths, the deadline sweep, outcome signals, backoff:
exactly what a worker runs), and the outcome is written with the worker's
fenced acknowledgement queries, all on the connection you pass. So it works
inside a test transaction that is rolled back afterwards.

``conveyor/testing/working_async.py`` is the source people edit;
``conveyor/testing/working.py`` is its sync twin, generated from it by
``scripts/unasync.py``; the I/O-free half is
:mod:`conveyor.testing.working_core`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from conveyor.config import HANDLER_TIMEOUT_DEFAULT
from conveyor.db.named_queries import queries_for
from conveyor.db.rows import record_from_event_get_row
from conveyor.middleware import Middleware
from conveyor.retry import RetryPolicy
from conveyor.router import Router
from conveyor.testing.working_async import work_event_async as work_event_async
from conveyor.testing.working_core import WorkedEvent as WorkedEvent
from conveyor.testing.working_core import _claim_params, _prepare, _run
from conveyor.testing.working_core import _no_running_loop as _no_running_loop
from conveyor.worker.acks import ack


def work_event(
    conn: psycopg.Connection[Any],
    router: Router,
    *,
    backoff: RetryPolicy | None = None,
    timeout: float | None = None,
    tenants: Sequence[str] | None = None,
    schema: str = "conveyor",
    middleware: Sequence[Middleware] = (),
) -> WorkedEvent | None:
    """Claim the next due event ``router`` handles, run its handler, write the outcome.

    Everything happens in ``conn``'s current transaction, so the events your
    test enqueued on ``conn`` are visible and a final rollback undoes it all.
    Returns ``None`` when no due event matches the router. The handler runs
    while the event row is locked by ``conn``'s transaction: a handler that
    updates the same event row on another connection would wait forever.

    ``backoff`` stands in for the worker's ``WorkerConfig.backoff``: a route's
    own ``backoff`` still wins, as in a worker. ``tenants`` limits the claim
    like ``WorkerConfig.tenants``; ``middleware`` runs around the handler as
    the worker's does.

    Defaults: ``backoff`` ``BackoffPolicy()``, ``timeout`` the route's timeout or
    300 s, every tenant, schema ``"conveyor"``.

    Example::

        def test_charge_retries_when_gateway_is_down(conn):
            Producer().enqueue(conn, "billing.charge", {"amount": 5})
            worked = work_event(conn, router)
            assert worked is not None and worked.record.state is EventState.PENDING
            assert "gateway down" in worked.record.last_error
    """
    _no_running_loop()   # the handler runs on an event loop of its own
    q = queries_for(schema)
    owner = str(uuid.uuid4())
    cur = conn.cursor(row_factory=tuple_row)  # whatever the connection's row_factory
    cur.execute(q["event_claim"], _claim_params(
        router, owner, timeout or HANDLER_TIMEOUT_DEFAULT, tenants))
    row = cur.fetchone()
    if row is None:
        return None
    claim = _prepare(router, owner, row, timeout, schema)
    outcome = _run(claim, router, backoff, middleware)
    if (claim.event.id, claim.event.attempt) not in claim.holder.completed:
        # The worker's own acknowledgement (worker/acks.py): one statement for one
        # outcome; none when the handler finished the event itself (conveyor.complete).
        (query, params), = ack(q, owner, [outcome]).statements
        cur.execute(query, params)
        if cur.fetchone() is None:
            raise AssertionError(f"event {claim.event.id} changed hands while its handler ran")
    cur.execute(q["event_get"], {"id": claim.event.id})
    after = cur.fetchone()
    if after is None:
        raise AssertionError(f"event {claim.event.id} vanished after its outcome was written")
    return WorkedEvent(claim.event, outcome, record_from_event_get_row(after))
