"""Admin / AsyncAdmin: status, show, retry, cancel, prune.

Event states are reached through the real named queries (claim, settle) rather
than written by hand, except for timestamps that a test must move into the past.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg import sql

from claim_support import claim_params
from conveyor import (
    Admin,
    AsyncAdmin,
    EventNotFoundError,
    EventState,
    InvalidInputError,
    InvalidStateError,
    Producer,
)
from conveyor import admin as admin_module
from conveyor.db.named_queries import queries_for
from schema_reset import empty_schema, empty_schema_async

Q = queries_for("conveyor")


@pytest.fixture
def db(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """``conn`` with the shared tables emptied inside the rolled-back transaction."""
    empty_schema(conn)
    return conn


def _claim(conn: psycopg.Connection[Any], owner: str, topics: list[str] | None = None,
           ) -> list[tuple[Any, ...]]:
    return conn.execute(Q["event_claim"], claim_params(topics or ["*"], limit=1000,
                                                       owner=owner)).fetchall()


def _settle(conn: psycopg.Connection[Any], owner: str, event_id: int, attempt: int,
            state: str, error: str | None = None, delay: float | None = None) -> None:
    rows = conn.execute(Q["event_settle_many"], {
        "owner": owner, "ids": [event_id], "attempts": [attempt], "states": [state],
        "delays": [delay], "refunds": [0], "errors": [error], "tracebacks": [None],
        "results": [None]}).fetchall()
    assert rows == [(event_id,)]


def _succeed(conn: psycopg.Connection[Any], owner: str, event_id: int, attempt: int) -> list[Any]:
    return conn.execute(Q["event_succeed_many"], {
        "owner": owner, "ids": [event_id], "attempts": [attempt]}).fetchall()


def _make(conn: psycopg.Connection[Any], state: str, topic: str = "t.x",
          max_attempts: int = 3) -> int:
    """An event brought to ``state`` through the worker's own queries."""
    event_id = Producer().enqueue(conn, topic, {"n": 1}, max_attempts=max_attempts)
    if state == "pending":
        return event_id
    owner = str(uuid.uuid4())
    # Claim only this event: park every other pending one behind a future run_at.
    conn.execute("UPDATE conveyor.events SET run_at = run_at + interval '1 day'"
                 " WHERE state = 'pending' AND id <> %s", (event_id,))
    claimed = _claim(conn, owner)
    conn.execute("UPDATE conveyor.events SET run_at = run_at - interval '1 day'"
                 " WHERE state = 'pending' AND id <> %s", (event_id,))
    assert [r[0] for r in claimed] == [event_id]
    if state == "running":
        return event_id
    if state == "succeeded":
        assert _succeed(conn, owner, event_id, 1) == [(event_id,)]
    else:
        _settle(conn, owner, event_id, 1, state, error=f"{state} on purpose")
    return event_id


def _state(conn: psycopg.Connection[Any], event_id: int) -> str:
    row = conn.execute("SELECT state FROM conveyor.events WHERE id = %s", (event_id,)).fetchone()
    assert row is not None
    return str(row[0])


def _register_worker(conn: psycopg.Connection[Any], topics: list[str],
                     stale: bool = False) -> str:
    worker_id = str(uuid.uuid4())
    conn.execute(Q["worker_register"], {"id": worker_id, "name": "w", "host": "h", "pid": 1,
                                        "topics": topics, "tenants": None,
                                        "concurrency": 7})
    if stale:
        conn.execute("UPDATE conveyor.workers SET heartbeat_at = now() - interval '1 hour'"
                     " WHERE id = %s", (worker_id,))
    return worker_id


# ------------------------------------------------------------------- status

def test_status_counts_every_state(db: psycopg.Connection[Any]) -> None:
    for state in ("pending", "pending", "running", "succeeded", "failed", "cancelled"):
        event_id = _make(db, state if state != "cancelled" else "pending")
        if state == "cancelled":
            Admin().cancel(db, event_id)
    assert Admin().status(db).counts == {
        "pending": 2, "scheduled": 0, "running": 1, "succeeded": 1, "failed": 1, "cancelled": 1}


def test_status_of_empty_queue_is_all_zero(db: psycopg.Connection[Any]) -> None:
    status = Admin().status(db)
    assert set(status.counts.values()) == {0}
    assert status.by_topic == [] and status.oldest_pending_age_s is None


def test_status_groups_by_topic_and_state(db: psycopg.Connection[Any]) -> None:
    _make(db, "pending", "a.x")
    _make(db, "pending", "a.x")
    _make(db, "failed", "b.y")
    by_topic = [(t.topic, t.state, t.count) for t in Admin().status(db).by_topic]
    assert by_topic == [("a.x", EventState.PENDING, 2), ("b.y", EventState.FAILED, 1)]


def test_status_reports_age_of_oldest_due_pending_event(db: psycopg.Connection[Any]) -> None:
    old = Producer().enqueue(db, "x")
    Producer().enqueue(db, "x")
    Producer().enqueue(db, "x", delay=3600)  # scheduled, not yet waiting
    db.execute("UPDATE conveyor.events SET run_at = now() - interval '90 seconds'"
               " WHERE id = %s", (old,))
    assert Admin().status(db).oldest_pending_age_s == pytest.approx(90, abs=0.01)


def test_status_counts_scheduled_events_apart_from_due_ones(
    db: psycopg.Connection[Any],
) -> None:
    for _ in range(2):
        Producer().enqueue(db, "a.x")
    for _ in range(3):
        Producer().enqueue(db, "a.x", delay=3600)
    Producer().enqueue(db, "b.y", delay=60)
    status = Admin().status(db)
    assert (status.counts["pending"], status.counts["scheduled"]) == (2, 4)
    assert [(t.topic, t.state, t.count, t.scheduled) for t in status.by_topic] == [
        ("a.x", EventState.PENDING, 2, 3), ("b.y", EventState.PENDING, 0, 1)]
    data = status.to_json()
    assert data["counts"]["scheduled"] == 4
    # Nothing of b.y is due: no lag; a.x's two due events came due at this
    # transaction's now(), so they have waited 0 s.
    assert data["by_topic"][1] == {"topic": "b.y", "state": "pending", "count": 0,
                                   "scheduled": 1, "oldest_due_s": None, "capped": False}
    assert data["by_topic"][0]["oldest_due_s"] == 0


def test_status_counts_only_workers_with_recent_heartbeat(db: psycopg.Connection[Any]) -> None:
    alive = _register_worker(db, ["a.*"])
    _register_worker(db, ["b.*"], stale=True)
    status = Admin().status(db)
    assert [w.id for w in status.workers] == [alive]
    assert status.workers[0].concurrency == 7
    assert status.to_json()["workers_alive"] == 1
    assert status.to_json()["workers"][0]["concurrency"] == 7


def test_status_lists_pending_topics_no_alive_worker_handles(
    db: psycopg.Connection[Any],
) -> None:
    _register_worker(db, ["email.*", "sms.send"])
    _register_worker(db, ["report.build"], stale=True)
    for topic in ("email.send", "sms.send", "sms.bulk", "report.build"):
        Producer().enqueue(db, topic)
    _make(db, "failed", "push.send")  # not pending: not reported
    assert Admin().status(db).unhandled_topics == ["report.build", "sms.bulk"]


def test_unhandled_topics_ignore_events_not_yet_due(db: psycopg.Connection[Any]) -> None:
    """A topic whose only events are scheduled is no warning yet: nothing waits."""
    _register_worker(db, ["email.*"])
    Producer().enqueue(db, "report.build", delay=3600)
    Producer().enqueue(db, "sms.send", delay=3600)
    Producer().enqueue(db, "sms.send")
    assert Admin().status(db).unhandled_topics == ["sms.send"]


def test_star_worker_handles_every_topic(db: psycopg.Connection[Any]) -> None:
    _register_worker(db, ["*"])
    Producer().enqueue(db, "anything.else")
    assert Admin().status(db).unhandled_topics == []


# --------------------------------------------------------------------- show

def test_history_span_is_checked_before_any_sql(conn: psycopg.Connection[Any]) -> None:
    admin = Admin()
    for bad, shown in ((True, "True"), ("1h", "'1h'"), (0, "got 0 seconds"),
                       (59, "got 59 seconds"), (420, "got 420 seconds"),
                       (90.5, "got 90.5 seconds"), (2 * 86_400, "got 172800 seconds"),
                       (-3600, "got -3600 seconds")):
        with pytest.raises(InvalidInputError, match="history span must be") as caught:
            admin.set_history_span(conn, bad)
        assert shown in str(caught.value) and "\n" not in str(caught.value)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE   # no SQL ran


def test_history_span_set_and_read_back(db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    assert (admin.history(db).span, admin.history(db).until) == (86_400, None)
    layout = admin.set_history_span(db, 900.0)
    assert (layout.span, layout.partitions) == (900, ())
    assert admin.history(db).to_json() == {"span": 900, "until": None, "replayable": False,
                                           "partitions": []}
    # Replayable (0027): no partition yet, so no index made now; later ones get it.
    assert admin.set_history_replayable(db) == 0
    assert admin.history(db).replayable is True


def test_show_returns_the_full_record(db: psycopg.Connection[Any]) -> None:
    event_id = Producer().enqueue(db, "x.y", {"a": [1]}, tenant="acme", idempotency_key="k",
                                  priority=4, max_attempts=2)
    record = Admin().show(db, event_id)
    assert (record.id, record.tenant, record.topic, record.payload, record.state,
            record.attempts, record.max_attempts, record.priority, record.idempotency_key,
            record.errors, record.finished_at) == (
        event_id, "acme", "x.y", {"a": [1]}, EventState.PENDING, 0, 2, 4, "k", [], None)


def test_show_includes_error_history_of_every_attempt(db: psycopg.Connection[Any]) -> None:
    event_id = Producer().enqueue(db, "x", max_attempts=2)
    owner = str(uuid.uuid4())
    _claim(db, owner)
    _settle(db, owner, event_id, 1, "pending", error="first boom", delay=0)
    _claim(db, owner)
    _settle(db, owner, event_id, 2, "failed", error="second boom")
    record = Admin().show(db, event_id)
    assert record.state is EventState.FAILED and record.attempts == 2
    assert record.last_error == "second boom"
    assert [(e.attempt, e.error, e.worker) for e in record.errors] == [
        (1, "first boom", owner), (2, "second boom", owner)]
    assert all(e.at for e in record.errors)


def test_show_record_serialises_to_json_types(db: psycopg.Connection[Any]) -> None:
    data = Admin().show(db, _make(db, "failed")).to_json()
    assert data["state"] == "failed" and isinstance(data["created_at"], str)
    assert data["errors"][0]["error"] == "failed on purpose"


def test_show_missing_event_raises_not_found(db: psycopg.Connection[Any]) -> None:
    with pytest.raises(EventNotFoundError, match="event 987654321 not found"):
        Admin().show(db, 987654321)


def test_show_refuses_malformed_id_before_sql(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(InvalidInputError, match="'abc'"):
        Admin().show(conn, "abc")  # type: ignore[arg-type]
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


# -------------------------------------------------------------------- retry

def test_retry_failed_event_makes_it_pending_and_due_now(db: psycopg.Connection[Any]) -> None:
    event_id = _make(db, "failed", max_attempts=1)
    Admin().retry(db, event_id)
    record = Admin().show(db, event_id)
    assert record.state is EventState.PENDING and record.finished_at is None
    assert record.max_attempts == 2  # one more attempt granted when all were spent
    assert [r[0] for r in _claim(db, str(uuid.uuid4()))] == [event_id]


def test_retry_cancelled_event_makes_it_pending(db: psycopg.Connection[Any]) -> None:
    event_id = _make(db, "pending")
    Admin().cancel(db, event_id)
    Admin().retry(db, event_id)
    assert _state(db, event_id) == "pending"


def test_retry_scheduled_event_makes_it_due_now(db: psycopg.Connection[Any]) -> None:
    event_id = Producer().enqueue(db, "x", delay=3600)
    Admin().retry(db, event_id)
    assert [r[0] for r in _claim(db, str(uuid.uuid4()))] == [event_id]


@pytest.mark.parametrize("state", ["succeeded", "running"])
def test_retry_refuses_succeeded_and_running_events(db: psycopg.Connection[Any],
                                                     state: str) -> None:
    event_id = _make(db, state)
    with pytest.raises(InvalidStateError, match=f"event {event_id} is {state}"):
        Admin().retry(db, event_id)
    assert _state(db, event_id) == state


def test_retry_missing_event_raises_not_found(db: psycopg.Connection[Any]) -> None:
    with pytest.raises(EventNotFoundError):
        Admin().retry(db, 987654321)


def test_retry_notifies_workers(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        event_id = _make(conn, "failed")
        conn.commit()
        with psycopg.connect(fresh_db, autocommit=True) as listener:
            listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier("conveyor.events")))
            Admin().retry(conn, event_id)
            conn.commit()
            assert [n.payload for n in listener.notifies(timeout=20, stop_after=1)] == ["*"]


def test_retry_failed_retries_every_failed_event(db: psycopg.Connection[Any]) -> None:
    failed = {_make(db, "failed", "a.x"), _make(db, "failed", "b.y")}
    done = _make(db, "succeeded")
    assert set(Admin().retry_failed(db)) == failed
    assert {_state(db, i) for i in failed} == {"pending"} and _state(db, done) == "succeeded"


def test_retry_failed_with_topic_retries_only_that_topic(db: psycopg.Connection[Any]) -> None:
    mine = _make(db, "failed", "a.x")
    other = _make(db, "failed", "b.y")
    assert Admin().retry_failed(db, topic="a.x") == [mine]
    assert _state(db, other) == "failed"


def test_retry_failed_with_nothing_failed_returns_empty(db: psycopg.Connection[Any]) -> None:
    _make(db, "pending")
    assert Admin().retry_failed(db) == []


def test_retry_failed_refuses_malformed_topic(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(InvalidInputError, match="'a b'"):
        Admin().retry_failed(conn, topic="a b")


# ------------------------------------------------------------------- cancel

@pytest.mark.parametrize("state", ["pending", "running", "failed"])
def test_cancel_pending_running_or_failed_event(db: psycopg.Connection[Any], state: str) -> None:
    event_id = _make(db, state)
    Admin().cancel(db, event_id)
    record = Admin().show(db, event_id)
    assert record.state is EventState.CANCELLED
    assert record.finished_at is not None and record.lease_owner is None


def test_cancelled_running_event_fences_out_its_worker(db: psycopg.Connection[Any]) -> None:
    event_id = Producer().enqueue(db, "x")
    owner = str(uuid.uuid4())
    _claim(db, owner)
    Admin().cancel(db, event_id)
    assert _succeed(db, owner, event_id, 1) == []
    assert _state(db, event_id) == "cancelled"


def test_cancel_refuses_succeeded_event(db: psycopg.Connection[Any]) -> None:
    event_id = _make(db, "succeeded")
    with pytest.raises(InvalidStateError,
                       match=f"event {event_id} is succeeded; only pending, running or failed"):
        Admin().cancel(db, event_id)


def test_cancelling_a_cancelled_event_again_is_a_no_op(db: psycopg.Connection[Any]) -> None:
    event_id = _make(db, "pending")
    Admin().cancel(db, event_id)
    finished = Admin().show(db, event_id).finished_at
    Admin().cancel(db, event_id)
    record = Admin().show(db, event_id)
    assert record.state is EventState.CANCELLED and record.finished_at == finished


def test_cancel_missing_event_raises_not_found(db: psycopg.Connection[Any]) -> None:
    with pytest.raises(EventNotFoundError, match="event 987654321 not found"):
        Admin().cancel(db, 987654321)


# -------------------------------------------------------------------- prune

def _finished_ago(conn: psycopg.Connection[Any], event_id: int, seconds: int) -> None:
    conn.execute("UPDATE conveyor.events SET finished_at = now() - %s * interval '1 second'"
                 " WHERE id = %s", (seconds, event_id))


def _ids(conn: psycopg.Connection[Any]) -> set[int]:
    return {r[0] for r in conn.execute("SELECT id FROM conveyor.events")}


def test_prune_deletes_succeeded_and_cancelled_events_older_than_age(
    db: psycopg.Connection[Any],
) -> None:
    old_done, old_cancelled, new_done = (_make(db, "succeeded"), _make(db, "pending"),
                                         _make(db, "succeeded"))
    Admin().cancel(db, old_cancelled)
    pending = _make(db, "pending")
    _finished_ago(db, old_done, 7200)
    _finished_ago(db, old_cancelled, 7200)
    assert Admin().prune(db, older_than=3600) == 2
    assert _ids(db) == {new_done, pending}


def test_prune_without_states_keeps_failed_events(db: psycopg.Connection[Any]) -> None:
    """Failed events wait for an operator: only an explicit "failed" deletes them."""
    old_failed, old_done = _make(db, "failed"), _make(db, "succeeded")
    _finished_ago(db, old_failed, 7200)
    _finished_ago(db, old_done, 7200)
    assert Admin().prune(db, older_than=60) == 1
    assert _ids(db) == {old_failed}
    assert Admin().prune(db, older_than=60, states=["failed"]) == 1
    assert _ids(db) == set()


def test_prune_dry_run_counts_what_would_go_and_deletes_nothing(
    db: psycopg.Connection[Any],
) -> None:
    for state in ("succeeded", "succeeded", "failed"):
        _finished_ago(db, _make(db, state), 7200)
    _make(db, "succeeded")                               # too young
    before = _ids(db)
    assert Admin().prune(db, older_than=3600, dry_run=True) == 2
    assert Admin().prune(db, older_than=3600, states=["failed", "succeeded"],
                         dry_run=True) == 3
    assert _ids(db) == before
    assert Admin().prune(db, older_than=3600) == 2


def test_prune_reports_progress_after_each_batch(db: psycopg.Connection[Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin_module, "PRUNE_BATCH", 2)
    for _ in range(5):
        _finished_ago(db, _make(db, "succeeded"), 100)
    seen: list[int] = []
    assert Admin().prune(db, older_than=10, progress=seen.append) == 5
    assert seen == [2, 4, 5]
    dry: list[int] = []
    assert Admin().prune(db, older_than=10, dry_run=True, progress=dry.append) == 0
    assert dry == [0]


def test_prune_refuses_a_progress_that_is_not_callable(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(InvalidInputError, match="expected progress to be callable, got 5"):
        Admin().prune(conn, older_than=10, progress=5)  # type: ignore[arg-type]


def test_prune_with_states_deletes_only_those_states(db: psycopg.Connection[Any]) -> None:
    done, failed = _make(db, "succeeded"), _make(db, "failed")
    _finished_ago(db, done, 7200)
    _finished_ago(db, failed, 7200)
    assert Admin().prune(db, older_than=60, states=["succeeded"]) == 1
    assert _ids(db) == {failed}


def test_prune_works_through_several_batches(db: psycopg.Connection[Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admin_module, "PRUNE_BATCH", 2)
    for _ in range(5):
        _finished_ago(db, _make(db, "succeeded"), 100)
    assert Admin().prune(db, older_than=10) == 5
    assert _ids(db) == set()


@pytest.mark.parametrize("states", [["pending"], ["running"], ["bogus"]])
def test_prune_refuses_unfinished_or_unknown_states(conn: psycopg.Connection[Any],
                                                    states: list[str]) -> None:
    with pytest.raises(InvalidInputError, match=repr(states[0])):
        Admin().prune(conn, older_than=0, states=states)


@pytest.mark.parametrize("age", [-1, float("nan"), "1h", float("inf"), 10**400, 1e300, True],
                         ids=["negative", "nan", "text", "inf", "huge-int", "1e300", "bool"])
def test_prune_refuses_invalid_age(conn: psycopg.Connection[Any], age: Any) -> None:
    with pytest.raises(InvalidInputError, match="older_than"):
        Admin().prune(conn, older_than=age)


def test_admin_refuses_malicious_schema() -> None:
    with pytest.raises(InvalidInputError):
        Admin(schema='x"; drop table t; --')


# -------------------------------------------------------------------- async

@pytest.fixture
async def adb(aconn: psycopg.AsyncConnection[Any]) -> psycopg.AsyncConnection[Any]:
    await empty_schema_async(aconn)
    return aconn


async def _aclaim_fail(aconn: psycopg.AsyncConnection[Any], event_id: int) -> None:
    owner = str(uuid.uuid4())
    await aconn.execute(Q["event_claim"], claim_params(limit=10, owner=owner))
    await aconn.execute(Q["event_settle_many"], {
        "owner": owner, "ids": [event_id], "attempts": [1], "states": ["failed"],
        "delays": [None], "refunds": [0], "errors": ["boom"], "tracebacks": [None],
        "results": [None]})


async def test_async_status_counts_states(adb: psycopg.AsyncConnection[Any]) -> None:
    from conveyor import AsyncProducer

    await AsyncProducer().enqueue(adb, "x")
    status = await AsyncAdmin().status(adb)
    assert status.counts["pending"] == 1 and status.unhandled_topics == ["x"]


async def test_async_show_retry_and_retry_failed(adb: psycopg.AsyncConnection[Any]) -> None:
    from conveyor import AsyncProducer

    event_id = await AsyncProducer().enqueue(adb, "x", max_attempts=1)
    await _aclaim_fail(adb, event_id)
    admin = AsyncAdmin()
    assert (await admin.show(adb, event_id)).errors[0].error == "boom"
    await admin.retry(adb, event_id)
    assert (await admin.show(adb, event_id)).state is EventState.PENDING
    assert await admin.retry_failed(adb) == []


async def test_async_cancel_and_prune(adb: psycopg.AsyncConnection[Any]) -> None:
    from conveyor import AsyncProducer

    event_id = await AsyncProducer().enqueue(adb, "x")
    admin = AsyncAdmin()
    await admin.cancel(adb, event_id)
    await admin.cancel(adb, event_id)                  # already cancelled: a no-op
    await adb.execute("UPDATE conveyor.events SET finished_at = now() - interval '1 hour'")
    assert await admin.prune(adb, older_than=60, dry_run=True) == 1
    seen: list[int] = []
    assert await admin.prune(adb, older_than=60, states=["cancelled"], progress=seen.append) == 1
    assert seen == [1]


async def test_async_not_found_errors(adb: psycopg.AsyncConnection[Any]) -> None:
    admin = AsyncAdmin()
    for operation in (admin.show, admin.retry, admin.cancel):
        with pytest.raises(EventNotFoundError):
            await operation(adb, 987654321)


# --------------------------------------------- connections with another row factory

DICT_ROW_BUG = ("BUG: Admin indexes rows by position (row[0], _record(row)), so on a "
                "connection with row_factory=dict_row it raises KeyError; fix: run its "
                "queries on conn.cursor(row_factory=tuple_row)")


def test_status_on_a_dict_row_connection(db: psycopg.Connection[Any]) -> None:
    from psycopg.rows import dict_row

    _make(db, "pending")
    db.row_factory = dict_row  # type: ignore[assignment]
    assert Admin().status(db).counts["pending"] == 1


def test_show_on_a_dict_row_connection(db: psycopg.Connection[Any]) -> None:
    from psycopg.rows import dict_row

    event_id = _make(db, "pending")
    db.row_factory = dict_row  # type: ignore[assignment]
    assert Admin().show(db, event_id).id == event_id


async def test_status_reports_topic_pending_only_for_tenants_no_worker_serves(
    fresh_db: str,
) -> None:
    import asyncio

    from conveyor import Router, Worker, WorkerConfig

    with psycopg.connect(fresh_db) as conn:
        Producer().enqueue(conn, "x", tenant="globex")
        conn.commit()
    router = Router()
    router.add("x", lambda event: None)
    worker = Worker(fresh_db, router, WorkerConfig(tenants=("acme",), poll_interval=0.1))
    running = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.started.wait(), 10)
        with psycopg.connect(fresh_db, autocommit=True) as conn:
            status = Admin().status(conn)
        assert len(status.workers) == 1
        assert status.unhandled_topics == ["x"]
    finally:
        worker.request_stop()
        await asyncio.wait_for(running, 30)


# --------------------------------------------------------------- reschedule

def _due(conn: psycopg.Connection[Any], event_id: int) -> tuple[Any, ...]:
    row = conn.execute("SELECT run_at, state, max_attempts, finished_at FROM conveyor.events"
                       " WHERE id = %s", (event_id,)).fetchone()
    assert row is not None
    return tuple(row)


def test_reschedule_to_a_moment_or_a_delay(db: psycopg.Connection[Any]) -> None:
    at = datetime(2031, 3, 30, 9, 0, tzinfo=timezone(timedelta(hours=2)))
    pending = Producer().enqueue(db, "x")
    assert Admin().reschedule(db, pending, run_at=at) == at
    assert _due(db, pending)[:2] == (at, "pending")
    assert _claim(db, str(uuid.uuid4())) == []              # no longer due
    later = Admin().reschedule(db, pending, delay=90)
    row = db.execute("SELECT extract(epoch FROM run_at - now()) FROM conveyor.events WHERE id = %s",
                     (pending,)).fetchone()
    assert row is not None and 89.9 < row[0] < 90.1 and later == _due(db, pending)[0]


def test_reschedule_brings_a_failed_event_back_with_an_attempt(db: psycopg.Connection[Any]) -> None:
    event_id = _make(db, "failed", max_attempts=1)
    Admin().reschedule(db, event_id, delay=0)
    _, state, max_attempts, finished_at = _due(db, event_id)
    assert (state, max_attempts, finished_at) == ("pending", 2, None)
    assert [r[0] for r in _claim(db, str(uuid.uuid4()))] == [event_id]


def test_reschedule_wakes_the_workers_with_the_due_time(fresh_db: str) -> None:
    # A database of its own: the NOTIFY comes only with a COMMIT.
    at = datetime.now(UTC) + timedelta(hours=1)
    with psycopg.connect(fresh_db, autocommit=True) as conn, \
            psycopg.connect(fresh_db, autocommit=True) as listener:
        event_id = Producer().enqueue(conn, "wake.me", delay=60)
        listener.execute('LISTEN "conveyor.events"')
        with conn.transaction():
            Admin().reschedule(conn, event_id, run_at=at)
        heard = [n.payload for n in listener.notifies(timeout=20, stop_after=1)]
    assert len(heard) == 1 and heard[0].startswith("wake.me|")
    assert abs(float(heard[0].split("|")[1]) - at.timestamp()) < 0.001


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({}, InvalidInputError, "give run_at or delay to reschedule to, not neither"),
    ({"run_at": datetime(2031, 1, 1, tzinfo=UTC), "delay": 5}, InvalidInputError,
     "not both"),
    ({"run_at": datetime(2031, 1, 1)}, InvalidInputError, "run_at must be timezone-aware"),
    ({"delay": -1}, InvalidInputError, "delay must be from"),
])
def test_reschedule_refuses_bad_times(db: psycopg.Connection[Any], kwargs: dict[str, Any],
                                      error: type[Exception], message: str) -> None:
    event_id = Producer().enqueue(db, "x")
    with pytest.raises(error, match=message):
        Admin().reschedule(db, event_id, **kwargs)


@pytest.mark.parametrize("state", ["succeeded", "running"])
def test_reschedule_refuses_succeeded_and_running_events(db: psycopg.Connection[Any],
                                                          state: str) -> None:
    event_id = _make(db, state)
    with pytest.raises(InvalidStateError, match=f"event {event_id} is {state}; only pending, "
                                                "failed or cancelled events can be rescheduled"):
        Admin().reschedule(db, event_id, delay=10)
    with pytest.raises(EventNotFoundError):
        Admin().reschedule(db, 987_654_321, delay=10)
