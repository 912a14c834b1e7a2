"""conveyor.testing: the helpers users run in their own tests, against a real database."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from conveyor import (
    AsyncProducer,
    BackoffPolicy,
    Cancel,
    CommittingProducer,
    Event,
    EventState,
    InvalidInputError,
    NewEvent,
    PermanentFailure,
    Producer,
    RetryAfter,
    Router,
    Snooze,
    WorkerConfig,
)
from conveyor.testing import (
    assert_enqueued,
    assert_enqueued_async,
    drain,
    drain_sync,
    payload_matches,
    refute_enqueued,
    refute_enqueued_async,
    work_event,
    work_event_async,
)
from schema_reset import empty_schema

Conn = psycopg.Connection[Any]
NO_JITTER = BackoffPolicy(base_delay=2, jitter=0)
IMMEDIATE_RETRY = WorkerConfig(backoff=BackoffPolicy(base_delay=0, max_delay=0))


@pytest.fixture
def db(conn: Conn) -> Conn:
    empty_schema(conn)
    return conn


def _router(pattern: str, handler: Any) -> Router:
    router = Router()
    router.add(pattern, handler)
    return router


def _states(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        return dict(conn.execute(  # type: ignore[arg-type]
            "SELECT state, count(*) FROM conveyor.events GROUP BY state").fetchall())


# ------------------------------------------------------------ payload_matches

@pytest.mark.parametrize(("expected", "actual", "result"), [
    ({"a": 1}, {"a": 1, "b": 2}, True),
    ({"a": {"x": 1}}, {"a": {"x": 1, "y": 2}}, True),
    ({"a": 1}, {"a": 2}, False),
    ({"a": 1}, {"b": 1}, False),
    ({"a": 1}, [1], False),
    ([1], [1, 2], False),
    ([{"a": 1}], [{"a": 1, "b": 2}], False),
    ("x", "x", True),
    ({}, {"anything": 1}, True),
])
def test_payload_matches_dicts_as_subsets_and_the_rest_as_equal(
    expected: Any, actual: Any, result: bool,
) -> None:
    assert payload_matches(expected, actual) is result


def test_payload_matches_exact_requires_equality() -> None:
    assert not payload_matches({"a": 1}, {"a": 1, "b": 2}, exact=True)
    assert payload_matches({"a": 1}, {"a": 1}, exact=True)


# ------------------------------------------------------------ assert_enqueued

def test_assert_enqueued_returns_the_matching_records(db: Conn) -> None:
    event_id = Producer().enqueue(db, "email.send", {"to": "a@x", "cc": []}, tenant="acme")
    Producer().enqueue(db, "email.send", {"to": "b@x"}, tenant="acme")
    [record] = assert_enqueued(db, "email.send", payload={"to": "a@x"})
    assert record.id == event_id and record.tenant == "acme"
    assert record.state is EventState.PENDING


def test_assert_enqueued_sees_uncommitted_events_of_the_transaction(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn, psycopg.connect(fresh_db) as other:
        Producer().enqueue(conn, "x")
        assert len(assert_enqueued(conn, "x")) == 1
        refute_enqueued(other, "x")
        conn.rollback()


def test_assert_enqueued_fails_listing_what_is_there(db: Conn) -> None:
    Producer().enqueue(db, "email.send", {"to": "b@x"})
    with pytest.raises(AssertionError) as info:
        assert_enqueued(db, "email.send", payload={"to": "a@x"})
    message = str(info.value)
    assert "payload ⊇ {'to': 'a@x'}" in message and "{'to': 'b@x'}" in message


def test_assert_enqueued_fails_when_nothing_has_the_topic(db: Conn) -> None:
    with pytest.raises(AssertionError, match="found 0"):
        assert_enqueued(db, "never.sent")


def test_assert_enqueued_exact_payload_refuses_extra_keys(db: Conn) -> None:
    Producer().enqueue(db, "x", {"a": 1, "b": 2})
    with pytest.raises(AssertionError):
        assert_enqueued(db, "x", payload={"a": 1}, exact_payload=True)
    assert assert_enqueued(db, "x", payload={"a": 1, "b": 2}, exact_payload=True)


def test_assert_enqueued_tenant_none_means_no_tenant(db: Conn) -> None:
    Producer().enqueue(db, "x", tenant="acme")
    with pytest.raises(AssertionError):
        assert_enqueued(db, "x", tenant=None)
    Producer().enqueue(db, "x")
    assert [r.tenant for r in assert_enqueued(db, "x", tenant=None)] == [None]


def test_assert_enqueued_count_demands_exactly_that_many(db: Conn) -> None:
    Producer().enqueue_many(db, [NewEvent(topic="x"), NewEvent(topic="x")])
    assert len(assert_enqueued(db, "x", count=2)) == 2
    with pytest.raises(AssertionError, match="exactly 1 event"):
        assert_enqueued(db, "x", count=1)


def test_assert_enqueued_matches_delay_within_tolerance(db: Conn) -> None:
    Producer().enqueue(db, "x", delay=60)
    assert assert_enqueued(db, "x", delay=60.5, tolerance=1)
    with pytest.raises(AssertionError, match="delay≈30s"):
        assert_enqueued(db, "x", delay=30)


def test_assert_enqueued_matches_run_at_within_tolerance(db: Conn) -> None:
    Producer().enqueue(db, "x", delay=10)
    [event] = assert_enqueued(db, "x")
    assert assert_enqueued(db, "x", run_at=event.run_at + timedelta(seconds=0.5))
    with pytest.raises(AssertionError):
        assert_enqueued(db, "x", run_at=event.run_at + timedelta(seconds=5))


def test_assert_enqueued_filters_on_key_priority_attempts_and_state(db: Conn) -> None:
    Producer().enqueue(db, "x", idempotency_key="k", priority=3, max_attempts=2)
    assert assert_enqueued(db, "x", idempotency_key="k", priority=3, max_attempts=2,
                           state="pending")
    for wrong in ({"idempotency_key": "other"}, {"priority": 4}, {"max_attempts": 9},
                  {"state": EventState.FAILED}):
        with pytest.raises(AssertionError):
            assert_enqueued(db, "x", **wrong)


def test_assert_enqueued_reads_a_custom_schema(empty_db: str) -> None:
    from conveyor import Migrator, ProducerConfig

    with psycopg.connect(empty_db) as conn:
        Migrator("app_q").apply(conn)
        Producer(ProducerConfig(schema="app_q")).enqueue(conn, "x")
        assert assert_enqueued(conn, "x", schema="app_q")


def test_assert_enqueued_refuses_malicious_schema_before_sql(conn: Conn) -> None:
    with pytest.raises(InvalidInputError):
        assert_enqueued(conn, "x", schema='x"; drop table conveyor.events; --')
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_refute_enqueued_passes_when_nothing_matches(db: Conn) -> None:
    Producer().enqueue(db, "x", {"a": 1})
    assert refute_enqueued(db, "x", payload={"a": 2}) == []
    assert refute_enqueued(db, "y") == []


def test_refute_enqueued_fails_listing_the_matches(db: Conn) -> None:
    event_id = Producer().enqueue(db, "x", {"a": 1})
    with pytest.raises(AssertionError, match=f"#{event_id} topic='x'"):
        refute_enqueued(db, "x", payload={"a": 1})


async def test_async_assert_and_refute_enqueued(aconn: psycopg.AsyncConnection[Any]) -> None:
    await AsyncProducer().enqueue(aconn, "async.topic", {"n": 1}, tenant="t1")
    [record] = await assert_enqueued_async(aconn, "async.topic", payload={"n": 1}, tenant="t1")
    assert record.topic == "async.topic"
    assert await refute_enqueued_async(aconn, "async.topic", tenant="t2") == []
    with pytest.raises(AssertionError):
        await refute_enqueued_async(aconn, "async.topic")


# ----------------------------------------------------------------- work_event

def test_work_event_runs_the_handler_and_marks_success(db: Conn) -> None:
    seen: list[Any] = []
    router = _router("email.*", lambda event: seen.append((event.topic, event.payload)))
    Producer().enqueue(db, "email.send", {"to": "a@x"})
    worked = work_event(db, router)
    assert worked is not None
    assert seen == [("email.send", {"to": "a@x"})]
    assert worked.outcome.state is EventState.SUCCEEDED
    assert worked.record.state is EventState.SUCCEEDED and worked.record.attempts == 1


def test_work_event_failure_schedules_retry_with_backoff(db: Conn) -> None:
    def broken(event: Event) -> None:
        raise ConnectionError("gateway down")

    Producer().enqueue(db, "billing.charge", max_attempts=3)
    worked = work_event(db, _router("billing.charge", broken), backoff=NO_JITTER)
    assert worked is not None
    record = worked.record
    assert (record.state, record.attempts) == (EventState.PENDING, 1)
    assert record.last_error == "ConnectionError: gateway down"
    assert record.errors[0].traceback and "gateway down" in record.errors[0].traceback
    assert_enqueued(db, "billing.charge", delay=2, tolerance=0.01)


def test_work_event_failure_on_last_attempt_parks_the_event(db: Conn) -> None:
    def broken(event: Event) -> None:
        raise ValueError("no")

    Producer().enqueue(db, "x", max_attempts=1)
    worked = work_event(db, _router("x", broken))
    assert worked is not None and worked.record.state is EventState.FAILED


@pytest.mark.parametrize(("signal", "state", "attempts"), [
    (RetryAfter(30), EventState.PENDING, 1),
    (Snooze(30), EventState.PENDING, 0),
    (PermanentFailure("bad"), EventState.FAILED, 1),
    (Cancel("nope"), EventState.CANCELLED, 1),
])
def test_work_event_applies_handler_signals(db: Conn, signal: Exception, state: EventState,
                                            attempts: int) -> None:
    def handler(event: Event) -> None:
        raise signal

    Producer().enqueue(db, "x", max_attempts=5)
    worked = work_event(db, _router("x", handler))
    assert worked is not None
    assert (worked.record.state, worked.record.attempts) == (state, attempts)
    if state is EventState.PENDING:
        assert_enqueued(db, "x", delay=30, tolerance=0.01)


def test_work_event_times_out_a_slow_async_handler(db: Conn) -> None:
    async def slow(event: Event) -> None:
        await asyncio.sleep(10)

    Producer().enqueue(db, "x")
    worked = work_event(db, _router("x", slow), timeout=0.05)
    assert worked is not None
    assert worked.record.last_error == "handler timed out after 0.05s"


def test_work_event_returns_none_when_nothing_is_due(db: Conn) -> None:
    Producer().enqueue(db, "x", delay=60)
    Producer().enqueue(db, "other.topic")
    assert work_event(db, _router("x", lambda event: None)) is None


def test_work_event_takes_the_highest_priority_first(db: Conn) -> None:
    Producer().enqueue(db, "x", {"p": "low"})
    Producer().enqueue(db, "x", {"p": "high"}, priority=9)
    worked = work_event(db, _router("x", lambda event: None))
    assert worked is not None and worked.event.payload == {"p": "high"}


def test_work_event_stays_in_the_callers_transaction(fresh_db: str) -> None:
    with CommittingProducer(fresh_db) as producer:
        producer.enqueue("x")
    with psycopg.connect(fresh_db) as conn:
        assert work_event(conn, _router("x", lambda event: None)) is not None
        assert _states(fresh_db) == {"pending": 1}
        conn.rollback()
    assert _states(fresh_db) == {"pending": 1}


async def test_work_event_refuses_to_run_inside_an_event_loop(
    aconn: psycopg.AsyncConnection[Any],
) -> None:
    with pytest.raises(RuntimeError, match="work_event_async"):
        work_event(None, Router())  # type: ignore[arg-type]


async def test_work_event_async_runs_the_handler(aconn: psycopg.AsyncConnection[Any]) -> None:
    await aconn.execute("DELETE FROM conveyor.events")
    seen: list[int] = []

    async def handler(event: Event) -> None:
        seen.append(event.payload["n"])

    await AsyncProducer().enqueue(aconn, "a.b", {"n": 7})
    worked = await work_event_async(aconn, _router("a.*", handler))
    assert worked is not None and worked.record.state is EventState.SUCCEEDED
    assert seen == [7]
    assert await work_event_async(aconn, _router("a.*", handler)) is None


# ---------------------------------------------------------------------- drain

def test_drain_runs_every_due_event_and_counts_outcomes(fresh_db: str) -> None:
    ran: list[str] = []
    router = Router()
    router.add("a.*", lambda event: ran.append(event.topic))
    with CommittingProducer(fresh_db) as producer:
        producer.enqueue_many([NewEvent(topic=t) for t in ("a.one", "a.two", "a.three")])
        producer.enqueue("b.unrouted")
        producer.enqueue("a.later", delay=3600)
    result = drain_sync(fresh_db, router)
    assert sorted(ran) == ["a.one", "a.three", "a.two"]
    assert (result.claimed, result.succeeded, result.failed) == (3, 3, 0)
    assert result.batches == 1
    assert _states(fresh_db) == {"succeeded": 3, "pending": 2}


def test_drain_with_zero_backoff_runs_retries_to_the_end(fresh_db: str) -> None:
    def broken(event: Event) -> None:
        raise RuntimeError("still broken")

    with CommittingProducer(fresh_db) as producer:
        producer.enqueue("x", max_attempts=3)
    result = drain_sync(fresh_db, _router("x", broken), IMMEDIATE_RETRY)
    assert (result.claimed, result.retried, result.failed, result.batches) == (3, 2, 1, 3)
    assert _states(fresh_db) == {"failed": 1}


def test_drain_leaves_retries_scheduled_later_pending(fresh_db: str) -> None:
    def broken(event: Event) -> None:
        raise RuntimeError("later")

    with CommittingProducer(fresh_db) as producer:
        producer.enqueue("x", max_attempts=3)
    result = drain_sync(fresh_db, _router("x", broken))
    assert (result.claimed, result.retried) == (1, 1)
    assert _states(fresh_db) == {"pending": 1}


def test_drain_of_an_empty_queue_does_nothing(fresh_db: str) -> None:
    result = drain_sync(fresh_db, _router("x", lambda event: None))
    assert (result.batches, result.claimed) == (0, 0)


def test_drain_fails_when_events_stay_due_past_max_batches(fresh_db: str) -> None:
    def snooze(event: Event) -> None:
        raise Snooze(0)

    with CommittingProducer(fresh_db) as producer:
        producer.enqueue("x")
    with pytest.raises(AssertionError, match="still due after 3 batches"):
        drain_sync(fresh_db, _router("x", snooze), max_batches=3)


def test_drain_refuses_non_positive_max_batches(shared_db_url: str) -> None:
    with pytest.raises(ValueError, match="max_batches"):
        drain_sync(shared_db_url, _router("x", lambda event: None), max_batches=0)


async def test_async_drain_runs_async_handlers(fresh_db: str) -> None:
    seen: list[int] = []

    async def handler(event: Event) -> None:
        seen.append(event.payload["i"])

    with CommittingProducer(fresh_db) as producer:
        producer.enqueue_many([NewEvent(topic="x", payload={"i": i}) for i in range(150)])
    result = await drain(fresh_db, _router("x", handler), WorkerConfig(batch_size=100))
    assert sorted(seen) == list(range(150))
    assert (result.succeeded, result.batches) == (150, 2)


def test_work_event_prefers_the_routes_own_backoff(db: Conn) -> None:
    from conveyor import LinearBackoff

    def broken(event: Event) -> None:
        raise RuntimeError("x")

    router = Router()
    router.add("x", broken, backoff=LinearBackoff(step=7))
    Producer().enqueue(db, "x", max_attempts=3)
    assert work_event(db, router, backoff=NO_JITTER) is not None
    assert_enqueued(db, "x", delay=7, tolerance=0.01)


def test_work_event_with_tenants_claims_only_their_events(db: Conn) -> None:
    Producer().enqueue(db, "x", {"who": "initech"}, tenant="initech", priority=9)
    Producer().enqueue(db, "x", {"who": "acme"}, tenant="acme")
    worked = work_event(db, _router("x", lambda event: None), tenants=["acme"])
    assert worked is not None and worked.event.tenant == "acme"
    assert work_event(db, _router("x", lambda event: None), tenants=["acme"]) is None


# --------------------------------------------- connections with another row factory

def test_helpers_work_on_a_dict_row_connection(db: Conn) -> None:
    from psycopg.rows import dict_row

    Producer().enqueue(db, "x", {"a": 1})
    db.row_factory = dict_row  # type: ignore[assignment]
    assert assert_enqueued(db, "x", payload={"a": 1})[0].topic == "x"
    assert refute_enqueued(db, "y") == []
    worked = work_event(db, _router("x", lambda event: None))
    assert worked is not None and worked.record.state is EventState.SUCCEEDED


async def test_async_helpers_work_on_a_dict_row_connection(
    aconn: psycopg.AsyncConnection[Any],
) -> None:
    from psycopg.rows import dict_row

    await aconn.execute("DELETE FROM conveyor.events")
    await AsyncProducer().enqueue(aconn, "x")
    aconn.row_factory = dict_row  # type: ignore[assignment]
    assert len(await assert_enqueued_async(aconn, "x")) == 1

    async def handler(event: Event) -> None:
        return None

    worked = await work_event_async(aconn, _router("x", handler))
    assert worked is not None and worked.record.state is EventState.SUCCEEDED
