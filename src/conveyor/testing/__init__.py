"""Helpers for testing code that uses Conveyor, against a real PostgreSQL.

There is deliberately no in-memory fake: the outbox promise (an event exists
if and only if your transaction commits) can only be checked on a database.

* :func:`assert_enqueued` / :func:`refute_enqueued` look at the events your
  code wrote, in your test's own transaction (payloads match as subsets).
* :func:`work_event` runs one event through the real executor inside that
  same transaction, so a rolled-back test leaves nothing behind.
* :func:`drain` runs a real :class:`~conveyor.Worker` step by step until no
  event is due, for tests that commit to a database of their own.

Example::

    from conveyor import Producer
    from conveyor.testing import assert_enqueued, work_event

    def test_order_placed(conn):                       # conn: a rolled-back transaction
        place_order(conn, order_id=42)                 # enqueues "order.placed"
        assert_enqueued(conn, "order.placed", payload={"order_id": 42})
        worked = work_event(conn, router)
        assert worked is not None and worked.record.state == "succeeded"
"""

from conveyor.testing.assertions import (
    assert_enqueued,
    assert_enqueued_async,
    payload_matches,
    refute_enqueued,
    refute_enqueued_async,
)
from conveyor.testing.draining import DrainResult, drain, drain_sync
from conveyor.testing.working import WorkedEvent, work_event, work_event_async

__all__ = [
    "DrainResult",
    "WorkedEvent",
    "assert_enqueued",
    "assert_enqueued_async",
    "drain",
    "drain_sync",
    "payload_matches",
    "refute_enqueued",
    "refute_enqueued_async",
    "work_event",
    "work_event_async",
]
