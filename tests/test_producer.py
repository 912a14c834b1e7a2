"""Producer / AsyncProducer: events written in the caller's transaction.

Rolled-back tests use ``conn`` / ``aconn``; anything that needs a commit or
LISTEN/NOTIFY uses a ``fresh_db`` of its own.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.pq import TransactionStatus

from conveyor import (
    AsyncCommittingProducer,
    AsyncProducer,
    CommittingProducer,
    DatabaseError,
    InvalidInputError,
    NewEvent,
    PayloadTooLargeError,
    Producer,
    ProducerConfig,
)
from conveyor.producer import COPY_THRESHOLD
from conveyor.producer_core import prepare, prepare_one
from wake_support import listen_for_wakes

CHANNEL = sql.Identifier("conveyor.events")


def _rows(conn: psycopg.Connection[Any], ids: list[int]) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT id, tenant, topic, payload, priority, max_attempts, idempotency_key, state"
        " FROM conveyor.events WHERE id = ANY(%s) ORDER BY id", (ids,)).fetchall()


def _count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM conveyor.events").fetchone()
    assert row is not None
    return int(row[0])


def _delay_of(conn: psycopg.Connection[Any], event_id: int) -> float:
    # now() is fixed for the transaction, so run_at - now() is exactly the delay.
    row = conn.execute("SELECT extract(epoch FROM run_at - now())::float8 FROM conveyor.events"
                       " WHERE id = %s", (event_id,)).fetchone()
    assert row is not None
    return float(row[0])


@pytest.fixture
def statements(conn: psycopg.Connection[Any]) -> Iterator[list[str]]:
    """The text of every top-level statement that inserts into the events table.

    A statement-level trigger raises a NOTICE carrying ``current_query()``; the
    trigger lives in the test's transaction and is rolled back with it.
    """
    seen: list[str] = []
    conn.add_notice_handler(lambda diag: seen.append(diag.message_primary or ""))
    conn.execute("""
        CREATE FUNCTION pg_temp.report_statement() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE NOTICE '%', current_query(); RETURN NULL; END $$""")
    conn.execute("CREATE TRIGGER report_statement AFTER INSERT ON conveyor.events_live"
                 " FOR EACH STATEMENT EXECUTE FUNCTION pg_temp.report_statement()")
    yield seen


def _listen(url: str) -> psycopg.Connection[Any]:
    listener = psycopg.connect(url, autocommit=True)
    listen_for_wakes(listener)
    return listener


def _notifications(listener: psycopg.Connection[Any], expected: int = 1,
                   timeout: float = 2.0) -> list[str]:
    """Up to ``expected`` notifications, then anything else arriving within 0.1 s."""
    got = [n.payload for n in listener.notifies(timeout=timeout, stop_after=expected)]
    return got + [n.payload for n in listener.notifies(timeout=0.1)]


# -------------------------------------------------------- the caller's transaction

def test_enqueue_returns_id_of_the_written_row(conn: psycopg.Connection[Any]) -> None:
    event_id = Producer().enqueue(conn, "order.created", {"order": 7}, tenant="acme")
    assert _rows(conn, [event_id]) == [
        (event_id, "acme", "order.created", {"order": 7}, 0, 5, None, "pending")]


def test_enqueue_without_payload_stores_empty_object(conn: psycopg.Connection[Any]) -> None:
    event_id = Producer().enqueue(conn, "ping")
    assert _rows(conn, [event_id])[0][3] == {}


def test_enqueue_rolled_back_leaves_no_event(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        Producer().enqueue(conn, "order.created", {"id": 1})
        conn.rollback()
        assert _count(conn) == 0


def test_enqueue_committed_leaves_exactly_one_event(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        event_id = Producer().enqueue(conn, "order.created", {"id": 1})
        conn.commit()
    with psycopg.connect(fresh_db) as other:
        assert other.execute("SELECT array_agg(id) FROM conveyor.events").fetchone() == (
            [event_id],)


def test_enqueue_is_invisible_to_others_until_commit(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn, psycopg.connect(fresh_db, autocommit=True) as other:
        Producer().enqueue(conn, "order.created")
        assert _count(other) == 0
        conn.commit()
        assert _count(other) == 1


async def test_async_enqueue_rolled_back_leaves_no_event(fresh_db: str) -> None:
    async with await psycopg.AsyncConnection.connect(fresh_db) as aconn:
        await AsyncProducer().enqueue(aconn, "order.created", {"id": 1})
        await aconn.rollback()
    with psycopg.connect(fresh_db) as conn:
        assert _count(conn) == 0


async def test_async_enqueue_committed_leaves_exactly_one_event(fresh_db: str) -> None:
    async with await psycopg.AsyncConnection.connect(fresh_db) as aconn:
        event_id = await AsyncProducer().enqueue(aconn, "order.created", {"id": 1})
        await aconn.commit()
    with psycopg.connect(fresh_db) as conn:
        assert [r[0] for r in _rows(conn, [event_id])] == [event_id]
        assert _count(conn) == 1


async def test_async_enqueue_writes_all_options(aconn: psycopg.AsyncConnection[Any]) -> None:
    event_id = await AsyncProducer().enqueue(
        aconn, "a.b", [1], tenant="t1", idempotency_key="k", priority=3, max_attempts=2)
    cur = await aconn.execute(
        "SELECT tenant, topic, payload, priority, max_attempts, idempotency_key"
        " FROM conveyor.events WHERE id = %s", (event_id,))
    assert await cur.fetchone() == ("t1", "a.b", [1], 3, 2, "k")


# ----------------------------------------------------------------- idempotency

def test_same_idempotency_key_twice_returns_first_id(conn: psycopg.Connection[Any]) -> None:
    producer = Producer()
    first = producer.enqueue(conn, "order.created", {"v": 1}, tenant="acme", idempotency_key="o-1")
    second = producer.enqueue(conn, "order.created", {"v": 2}, tenant="acme",
                              idempotency_key="o-1")
    assert second == first
    assert _count(conn) == 1
    assert _rows(conn, [first])[0][3] == {"v": 1}


def test_idempotency_key_is_scoped_per_tenant(conn: psycopg.Connection[Any]) -> None:
    producer = Producer()
    ids = {producer.enqueue(conn, "x", tenant=t, idempotency_key="same") for t in ("a", "b", None)}
    assert len(ids) == 3


def test_idempotency_key_without_tenant_is_one_scope(conn: psycopg.Connection[Any]) -> None:
    producer = Producer()
    first = producer.enqueue(conn, "x", idempotency_key="k")
    assert producer.enqueue(conn, "x", idempotency_key="k") == first
    assert _count(conn) == 1


def test_idempotency_key_committed_earlier_returns_that_id(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        first = Producer().enqueue(conn, "x", tenant="acme", idempotency_key="k")
        conn.commit()
    with psycopg.connect(fresh_db) as conn:
        assert Producer().enqueue(conn, "x", tenant="acme", idempotency_key="k") == first
        conn.commit()
        assert _count(conn) == 1


async def test_async_same_idempotency_key_returns_first_id(
    aconn: psycopg.AsyncConnection[Any],
) -> None:
    producer = AsyncProducer()
    first = await producer.enqueue(aconn, "x", tenant="acme", idempotency_key="k")
    assert await producer.enqueue(aconn, "x", tenant="acme", idempotency_key="k") == first


def test_enqueue_many_repeated_key_in_one_batch_yields_one_row(
    conn: psycopg.Connection[Any],
) -> None:
    ids = Producer().enqueue_many(conn, [
        NewEvent(topic="x", tenant="acme", idempotency_key="dup", payload=1),
        NewEvent(topic="x", tenant="acme", idempotency_key="other"),
        NewEvent(topic="x", tenant="acme", idempotency_key="dup", payload=2),
    ])
    assert ids[2] == ids[0] != ids[1]
    assert _count(conn) == 2
    assert _rows(conn, [ids[0]])[0][3] == 1


def test_enqueue_many_key_existing_before_returns_existing_id(
    conn: psycopg.Connection[Any],
) -> None:
    producer = Producer()
    existing = producer.enqueue(conn, "x", idempotency_key="k")
    ids = producer.enqueue_many(conn, [{"topic": "y"}, {"topic": "x", "idempotency_key": "k"}])
    assert ids[1] == existing
    assert _count(conn) == 2


async def test_async_enqueue_many_repeated_key_yields_first_id(
    aconn: psycopg.AsyncConnection[Any],
) -> None:
    ids = await AsyncProducer().enqueue_many(aconn, [
        NewEvent(topic="x", idempotency_key="dup"), NewEvent(topic="x", idempotency_key="dup")])
    assert ids[0] == ids[1]


# ------------------------------------------------- delay, priority, attempts

def test_delayed_event_runs_at_now_plus_delay(conn: psycopg.Connection[Any]) -> None:
    event_id = Producer().enqueue(conn, "x", delay=90.5)
    assert _delay_of(conn, event_id) == pytest.approx(90.5, abs=1e-3)


def test_undelayed_event_is_due_now(conn: psycopg.Connection[Any]) -> None:
    assert _delay_of(conn, Producer().enqueue(conn, "x")) == 0


def _run_at(conn: psycopg.Connection[Any], ids: list[int]) -> list[datetime]:
    rows = conn.execute("SELECT run_at FROM conveyor.events WHERE id = ANY(%s) ORDER BY id", (ids,))
    return [r[0] for r in rows.fetchall()]


AT = datetime(2031, 3, 30, 1, 30, tzinfo=timezone(timedelta(hours=2)))


def test_run_at_is_stored_as_that_moment_on_every_path(conn: psycopg.Connection[Any]) -> None:
    producer = Producer()
    single = producer.enqueue(conn, "x", run_at=AT)
    keyed = producer.enqueue(conn, "x", run_at=AT, idempotency_key="k1")
    many = producer.enqueue_many(conn, [NewEvent(topic="x", run_at=AT + timedelta(minutes=i))
                                        for i in range(COPY_THRESHOLD + 5)])
    written = producer.enqueue_bulk(conn, [{"topic": "y", "run_at": AT}] * (COPY_THRESHOLD + 2))
    assert _run_at(conn, [single, keyed]) == [AT, AT]
    assert _run_at(conn, many) == [AT + timedelta(minutes=i) for i in range(COPY_THRESHOLD + 5)]
    assert written == COPY_THRESHOLD + 2
    assert conn.execute("SELECT count(*) FROM conveyor.events WHERE topic = 'y' AND run_at = %s",
                        (AT,)).fetchone() == (COPY_THRESHOLD + 2,)


def test_run_at_in_the_past_is_due_now_and_wakes_without_a_due_time(
        conn: psycopg.Connection[Any]) -> None:
    past = datetime.now(UTC) - timedelta(hours=1)
    event_id = Producer().enqueue(conn, "x", run_at=past)
    assert _run_at(conn, [event_id]) == [past]
    row = conn.execute("SELECT run_at <= now() FROM conveyor.events WHERE id = %s",
                       (event_id,)).fetchone()
    assert row == (True,)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"run_at": datetime(2031, 1, 1)}, "run_at must be timezone-aware (a naive datetime names no moment)"),
    ({"run_at": "2031-01-01T00:00:00Z"},
     "run_at must be a timezone-aware datetime, got '2031-01-01T00:00:00Z'"),
    ({"run_at": AT, "delay": 5}, "give delay or run_at, not both: delay=5"),
])
def test_a_bad_run_at_is_refused_naming_it(conn: psycopg.Connection[Any], kwargs: dict[str, Any],
                                           message: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        Producer().enqueue(conn, "x", **kwargs)
    with pytest.raises(InvalidInputError, match=re.escape("event #1: " + message)):
        Producer().enqueue_many(conn, [NewEvent(topic="x"), NewEvent(topic="x", **kwargs)])
    assert conn.execute("SELECT count(*) FROM conveyor.events").fetchone() == (0,)


def test_priority_is_stored(conn: psycopg.Connection[Any]) -> None:
    event_id = Producer().enqueue(conn, "x", priority=-7)
    assert _rows(conn, [event_id])[0][4] == -7


def test_max_attempts_defaults_to_producer_config(conn: psycopg.Connection[Any]) -> None:
    event_id = Producer(ProducerConfig(max_attempts=9)).enqueue(conn, "x")
    assert _rows(conn, [event_id])[0][5] == 9


def test_max_attempts_argument_overrides_config(conn: psycopg.Connection[Any]) -> None:
    event_id = Producer(ProducerConfig(max_attempts=9)).enqueue(conn, "x", max_attempts=1)
    assert _rows(conn, [event_id])[0][5] == 1


# ----------------------------------------------------------------- enqueue_many

def test_enqueue_many_plain_batch_uses_copy(
    conn: psycopg.Connection[Any], statements: list[str],
) -> None:
    Producer().enqueue_many(conn, [NewEvent(topic="bulk") for _ in range(COPY_THRESHOLD)])
    assert len(statements) == 1 and statements[0].lstrip().upper().startswith("COPY")


def test_enqueue_many_copy_ids_are_in_input_order_and_match_rows(
    conn: psycopg.Connection[Any],
) -> None:
    events = [NewEvent(topic=f"bulk.t{i % 3}", payload={"i": i}, tenant="acme", priority=i % 5)
              for i in range(150)]
    ids = Producer().enqueue_many(conn, events)
    assert len(ids) == len(set(ids)) == 150
    by_id = {r[0]: r for r in _rows(conn, ids)}
    for i, event_id in enumerate(ids):
        row = by_id[event_id]
        assert row[1:6] == ("acme", f"bulk.t{i % 3}", {"i": i}, i % 5, 5)


def test_enqueue_many_small_batch_uses_unnest_insert(
    conn: psycopg.Connection[Any], statements: list[str],
) -> None:
    Producer().enqueue_many(conn, [NewEvent(topic="small") for _ in range(COPY_THRESHOLD - 1)])
    assert len(statements) == 1 and "unnest" in statements[0]


def test_enqueue_many_with_keys_uses_unnest_even_when_large(
    conn: psycopg.Connection[Any], statements: list[str],
) -> None:
    events = [NewEvent(topic="k", idempotency_key=f"k{i}") for i in range(100)]
    Producer().enqueue_many(conn, events)
    assert len(statements) == 1 and "unnest" in statements[0]


def test_enqueue_many_with_delays_uses_unnest_and_stores_each_delay(
    conn: psycopg.Connection[Any], statements: list[str],
) -> None:
    events = [NewEvent(topic="d", delay=float(i)) for i in range(100)]
    ids = Producer().enqueue_many(conn, events)
    assert "unnest" in statements[0]
    assert [round(_delay_of(conn, event_id), 3) for event_id in ids[:5]] == [0, 1, 2, 3, 4]


def test_enqueue_many_unnest_ids_are_in_input_order(conn: psycopg.Connection[Any]) -> None:
    events = [NewEvent(topic="x", payload=i, idempotency_key=f"k{i}") for i in range(10)]
    ids = Producer().enqueue_many(conn, events)
    assert [r[3] for r in sorted(_rows(conn, ids), key=lambda r: ids.index(r[0]))] == list(
        range(10))


def test_enqueue_many_accepts_mappings(conn: psycopg.Connection[Any]) -> None:
    ids = Producer().enqueue_many(conn, [{"topic": "m", "payload": [1], "priority": 2}])
    assert _rows(conn, ids)[0][2:5] == ("m", [1], 2)


def test_enqueue_many_empty_runs_no_sql(conn: psycopg.Connection[Any]) -> None:
    assert Producer().enqueue_many(conn, []) == []
    assert conn.info.transaction_status == TransactionStatus.IDLE


async def test_async_enqueue_many_copy_path_ids_match_rows(
    aconn: psycopg.AsyncConnection[Any],
) -> None:
    ids = await AsyncProducer().enqueue_many(
        aconn, [NewEvent(topic="bulk", payload=i) for i in range(100)])
    cur = await aconn.execute(
        "SELECT id, payload FROM conveyor.events WHERE id = ANY(%s)", (ids,))
    stored = dict(await cur.fetchall())
    assert [stored[event_id] for event_id in ids] == list(range(100))


async def test_async_enqueue_many_unnest_path_stores_delays(
    aconn: psycopg.AsyncConnection[Any],
) -> None:
    ids = await AsyncProducer().enqueue_many(aconn, [NewEvent(topic="d", delay=30)])
    cur = await aconn.execute(
        "SELECT extract(epoch FROM run_at - now())::float8 FROM conveyor.events WHERE id = %s",
        (ids[0],))
    assert await cur.fetchone() == (pytest.approx(30, abs=1e-3),)


# ------------------------------------------------------------ enqueue_bulk

def test_enqueue_bulk_writes_a_plain_batch_with_one_copy_and_returns_the_count(
    conn: psycopg.Connection[Any], statements: list[str],
) -> None:
    events = [NewEvent(topic=f"bulk.t{i % 3}", payload={"i": i}, tenant="acme", priority=i % 5)
              for i in range(150)]
    assert Producer().enqueue_bulk(conn, events) == 150
    assert len(statements) == 1 and statements[0].lstrip().upper().startswith("COPY")
    rows = conn.execute("SELECT tenant, topic, payload, priority, max_attempts, state"
                        " FROM conveyor.events ORDER BY id").fetchall()
    assert rows == [("acme", f"bulk.t{i % 3}", {"i": i}, i % 5, 5, "pending")
                    for i in range(150)]


def test_enqueue_bulk_sends_a_non_default_max_attempts(conn: psycopg.Connection[Any]) -> None:
    Producer(ProducerConfig(max_attempts=7)).enqueue_bulk(conn, [NewEvent(topic="m")] * 70)
    Producer().enqueue_bulk(conn, [NewEvent(topic="n")] * 70)
    rows = conn.execute("SELECT topic, max_attempts, priority, tenant, count(*)"
                        " FROM conveyor.events GROUP BY 1, 2, 3, 4 ORDER BY 1").fetchall()
    assert rows == [("m", 7, 0, None, 70), ("n", 5, 0, None, 70)]


def test_columns_left_out_of_a_bulk_copy_have_the_defaults_the_producer_assumes(
    conn: psycopg.Connection[Any],
) -> None:
    from conveyor.config import MAX_ATTEMPTS_DEFAULT
    from conveyor.producer_core import COLUMN_DEFAULTS
    rows = conn.execute(
        "SELECT column_name, column_default FROM information_schema.columns"
        " WHERE table_schema = 'conveyor' AND table_name = 'events'"
        " AND column_name = ANY(%s)", (list(COLUMN_DEFAULTS),)).fetchall()
    assert dict(rows) == {"tenant": None, "priority": "0",
                          "max_attempts": str(MAX_ATTEMPTS_DEFAULT)}
    assert COLUMN_DEFAULTS == {"tenant": None, "priority": 0, "max_attempts": MAX_ATTEMPTS_DEFAULT}


def test_enqueue_bulk_skips_and_does_not_count_existing_keys(
    conn: psycopg.Connection[Any],
) -> None:
    producer = Producer()
    producer.enqueue(conn, "k", idempotency_key="k0")
    events = [NewEvent(topic="k", idempotency_key=f"k{i % 80}") for i in range(100)]
    assert producer.enqueue_bulk(conn, events) == 79      # k0 existed, k0..k19 repeat
    assert _count(conn) == 80


def test_enqueue_bulk_with_delays_stores_each_delay(conn: psycopg.Connection[Any]) -> None:
    assert Producer().enqueue_bulk(conn, [NewEvent(topic="d", delay=float(i))
                                          for i in range(100)]) == 100
    delays = conn.execute("SELECT extract(epoch FROM run_at - now())::float8"
                          " FROM conveyor.events ORDER BY id LIMIT 3").fetchall()
    assert [round(d[0], 3) for d in delays] == [0, 1, 2]


def test_enqueue_bulk_rolled_back_leaves_nothing_and_committed_leaves_all(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        Producer().enqueue_bulk(conn, [NewEvent(topic="r") for _ in range(100)])
        conn.rollback()
        assert _count(conn) == 0
    with CommittingProducer(fresh_db) as producer:
        assert producer.enqueue_bulk([NewEvent(topic="c") for _ in range(100)]) == 100
    with psycopg.connect(fresh_db) as conn:
        assert _count(conn) == 100


async def test_async_enqueue_bulk_mirrors_the_sync_one(fresh_db: str) -> None:
    async with AsyncCommittingProducer(fresh_db) as producer:
        assert await producer.enqueue_bulk(
            [NewEvent(topic="a", payload=i) for i in range(120)]) == 120
        assert await producer.enqueue_bulk([]) == 0
    async with await psycopg.AsyncConnection.connect(fresh_db) as aconn:
        assert await AsyncProducer().enqueue_bulk(
            aconn, [NewEvent(topic="a", idempotency_key="x")] * 2) == 1
        cur = await aconn.execute("SELECT payload FROM conveyor.events WHERE topic = 'a'"
                                  " AND idempotency_key IS NULL ORDER BY id")
        assert [r[0] for r in await cur.fetchall()] == list(range(120))


def test_enqueue_bulk_takes_topic_payload_pairs(
    conn: psycopg.Connection[Any], statements: list[str],
) -> None:
    pairs = [(f"pair.t{i % 2}", {"i": i} if i % 3 else None) for i in range(100)]
    assert Producer().enqueue_bulk(conn, iter(pairs)) == 100   # any iterable
    assert len(statements) == 1 and statements[0].lstrip().upper().startswith("COPY")
    rows = conn.execute("SELECT tenant, topic, payload, priority, max_attempts, state"
                        " FROM conveyor.events ORDER BY id").fetchall()
    assert rows == [(None, f"pair.t{i % 2}", {"i": i} if i % 3 else {}, 0, 5, "pending")
                    for i in range(100)]


def test_pairs_mix_with_events_and_mappings_in_every_batch_write(
    conn: psycopg.Connection[Any],
) -> None:
    producer = Producer()
    mixed: list[Any] = [("mix.a", 1), NewEvent(topic="mix.b", payload=2, priority=3),
                        {"topic": "mix.c", "payload": 3, "tenant": "acme"}] * 30
    assert producer.enqueue_bulk(conn, mixed) == 90            # full path: priority, tenant
    ids = producer.enqueue_many(conn, mixed[:3])
    rows = conn.execute("SELECT topic, payload, priority, tenant FROM conveyor.events"
                        " WHERE id = ANY(%s) ORDER BY id", (ids,)).fetchall()
    assert rows == [("mix.a", 1, 0, None), ("mix.b", 2, 3, None), ("mix.c", 3, 0, "acme")]
    assert _count(conn) == 93


@pytest.mark.parametrize("bad", [("only.topic",), ("t", 1, 2), ["t", 1], "t.x", 7])
def test_a_batch_item_that_is_no_event_is_named_before_any_sql(
    conn: psycopg.Connection[Any], bad: Any,
) -> None:
    events: list[Any] = [("ok", {})] * 70 + [bad]
    for write in (Producer().enqueue_many, Producer().enqueue_bulk):
        with pytest.raises(InvalidInputError,
                           match=r"^event #70: expected NewEvent, a mapping or a \(topic, payload\) pair"):
            write(conn, events)
    assert conn.info.transaction_status == TransactionStatus.IDLE


@pytest.mark.parametrize(("label", "kwargs"), [c for c in [
    ("new topic", {"topic": "bad topic"}), ("topic type", {"topic": 5}),
    ("payload", {"payload": {"s": {1}}}), ("nul", {"payload": "\x00"}),
    ("escaped nul", {"payload": {"k": "a\x00b"}}), ("surrogate", {"payload": "\ud800"}),
    ("nan", {"payload": float("nan")}), ("too big", {"payload": "x" * 2000}),
    ("too big, not ascii", {"payload": "\u00e9" * 600}),   # 600 characters, 1,202 bytes
    ("too deep", {"payload": [[[[[[[[[[]]]]]]]]]]}),
]], ids=lambda c: c if isinstance(c, str) else "")
def test_a_bad_pair_is_refused_as_a_single_enqueue_refuses_it(
    conn: psycopg.Connection[Any], label: str, kwargs: dict[str, Any],
) -> None:
    producer = Producer(ProducerConfig(max_payload_bytes=1000, max_payload_depth=8))
    topic, payload = kwargs.get("topic", "known.pair"), kwargs.get("payload")
    with pytest.raises(InvalidInputError) as single:
        producer.enqueue(conn, topic, payload)
    with pytest.raises(InvalidInputError) as batch:
        producer.enqueue_bulk(conn, [("known.pair", {})] * 70 + [(topic, payload)])
    assert str(batch.value) == f"event #70: {single.value}"
    assert type(batch.value) is type(single.value)
    assert conn.info.transaction_status == TransactionStatus.IDLE


@pytest.mark.parametrize("option", [
    {"priority": True}, {"priority": "1"}, {"delay": -1.0}, {"delay": float("nan")},
    {"max_attempts": 0}, {"tenant": "Not A Label"}, {"idempotency_key": ""},
    {"payload": {"n": object()}}, {"run_at": datetime(2026, 1, 1)},
], ids=lambda o: ",".join(o))
def test_an_enqueue_of_a_known_topic_still_checks_every_option_it_is_given(
    conn: psycopg.Connection[Any], option: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The common event's shortcut (producer_core.prepare_one) is taken only
    # when every option is at its default: one that is not is checked in full.
    monkeypatch.setattr("conveyor.producer_core.KNOWN_TOPICS", {"known.options"})
    producer = Producer()
    kwargs = {"payload": {}, **option}
    with pytest.raises(InvalidInputError):
        producer.enqueue(conn, "known.options", **kwargs)


def test_the_common_event_is_written_as_the_full_checks_would_write_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Known to this test whatever the shared set holds (it stops growing at its cap).
    monkeypatch.setattr("conveyor.producer_core.KNOWN_TOPICS", {"known.common"})
    config = ProducerConfig(max_attempts=7)
    defaults: dict[str, Any] = {"tenant": None, "idempotency_key": None, "delay": 0,
                                "priority": 0, "max_attempts": None, "run_at": None}
    for payload in ({"n": 1}, None, [1, "two"]):
        assert prepare_one(config, "known.common", payload, **defaults) == prepare(
            config, NewEvent(topic="known.common", payload=payload))


def test_a_refused_bulk_batch_inside_an_open_transaction_leaves_it_as_it_was(
    conn: psycopg.Connection[Any],
) -> None:
    producer = Producer()
    first = producer.enqueue(conn, "business.write", {"kept": True})
    bad = [("tx.bulk", {"i": i}) for i in range(200)] + [("tx.bulk", {"s": {1}})]
    with pytest.raises(InvalidInputError, match=r"^event #200: payload is not JSON"):
        producer.enqueue_bulk(conn, bad)
    assert conn.info.transaction_status == TransactionStatus.INTRANS   # not aborted
    assert producer.enqueue_bulk(conn, bad[:200]) == 200               # still usable
    assert conn.execute("SELECT topic, count(*) FROM conveyor.events GROUP BY 1 ORDER BY 1"
                        ).fetchall() == [("business.write", 1), ("tx.bulk", 200)]
    assert _rows(conn, [first])[0][2:4] == ("business.write", {"kept": True})


def test_a_bulk_batch_that_begins_the_transaction_streams_and_a_refusal_rolls_it_back(
    fresh_db: str,
) -> None:
    producer = Producer()
    bad = [("own.bulk", {"i": i}) for i in range(5000)] + [("own.bulk", float("inf"))]
    with psycopg.connect(fresh_db) as conn:
        with pytest.raises(InvalidInputError, match=r"^event #5000: payload is not JSON"):
            producer.enqueue_bulk(conn, bad)
        assert conn.info.transaction_status == TransactionStatus.IDLE
        # A non-plain event after streaming began: the stream is dropped and the
        # whole batch takes the full path, in the same (still uncommitted) call.
        mixed: list[Any] = [*bad[:5000], NewEvent(topic="own.bulk", tenant="acme")]
        assert producer.enqueue_bulk(conn, mixed) == 5001
        conn.commit()
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        with pytest.raises(InvalidInputError, match=r"^event #5000"):
            producer.enqueue_bulk(conn, bad)                       # one COPY, abandoned
        assert conn.info.transaction_status == TransactionStatus.IDLE
        assert producer.enqueue_bulk(conn, bad[:100]) == 100
        assert conn.execute("SELECT count(*), count(tenant) FROM conveyor.events"
                            ).fetchone() == (5101, 1)


async def test_async_bulk_refusals_leave_the_transaction_as_it_was(fresh_db: str) -> None:
    producer = AsyncProducer()
    bad = [("a.bulk", {"i": i}) for i in range(300)] + [("a.bulk", "\x00")]
    async with await psycopg.AsyncConnection.connect(fresh_db) as aconn:
        with pytest.raises(InvalidInputError, match=r"^event #300: payload contains a NUL"):
            await producer.enqueue_bulk(aconn, bad)                 # streamed, rolled back
        assert aconn.info.transaction_status == TransactionStatus.IDLE
        await producer.enqueue(aconn, "a.first")
        with pytest.raises(InvalidInputError, match=r"^event #300"):
            await producer.enqueue_bulk(aconn, bad)                 # checked first
        assert aconn.info.transaction_status == TransactionStatus.INTRANS
        assert await producer.enqueue_bulk(aconn, bad[:300]) == 300
        await aconn.commit()
        cur = await aconn.execute("SELECT topic, count(*) FROM conveyor.events GROUP BY 1 ORDER BY 1")
        assert await cur.fetchall() == [("a.bulk", 300), ("a.first", 1)]


# A topic already seen valid takes the batch fast path; every other field must
# still be checked there, exactly as a single enqueue checks it.
FAST_PATH_BAD = [
    ("bool priority", {"priority": True}),
    ("priority range", {"priority": 40000}),
    ("bool delay", {"delay": True}),
    ("negative delay", {"delay": -1}),
    ("tenant", {"tenant": "ACME"}),
    ("max_attempts", {"max_attempts": 0}),
    ("payload", {"payload": {"s": {1}}}),
    ("nul", {"payload": "\x00"}),
    ("nan", {"payload": float("nan")}),
]


@pytest.mark.parametrize(("label", "kwargs"), FAST_PATH_BAD, ids=[c[0] for c in FAST_PATH_BAD])
def test_batch_with_a_known_topic_still_checks_every_field(
    conn: psycopg.Connection[Any], label: str, kwargs: dict[str, Any],
) -> None:
    producer = Producer()
    with pytest.raises(InvalidInputError) as single:
        producer.enqueue(conn, "known.topic", **kwargs)
    events = [NewEvent(topic="known.topic") for _ in range(70)]
    events.append(NewEvent(topic="known.topic", **kwargs))
    for write in (producer.enqueue_many, producer.enqueue_bulk):
        with pytest.raises(InvalidInputError) as batch:
            write(conn, events)
        assert str(batch.value) == f"event #70: {single.value}"
    assert conn.info.transaction_status == TransactionStatus.IDLE


# ---------------------------------------------------- refused before any SQL

BAD_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("bad topic", {"topic": "no spaces"}),
    ("bad tenant", {"topic": "x", "tenant": "ACME"}),
    ("bad key", {"topic": "x", "idempotency_key": "a\nb"}),
    ("negative delay", {"topic": "x", "delay": -1}),
    ("priority", {"topic": "x", "priority": 40000}),
    ("max_attempts", {"topic": "x", "max_attempts": 0}),
    ("payload", {"topic": "x", "payload": {"s": {1}}}),
    ("nul", {"topic": "x", "payload": "\x00"}),
    ("colliding keys", {"topic": "x", "payload": {"n": {1: "int", "1": "str"}}}),
    ("C1 control in key", {"topic": "x", "idempotency_key": "order\x8542"}),
    ("line separator in key", {"topic": "x", "idempotency_key": "order\u202842"}),
]


@pytest.mark.parametrize(("label", "kwargs"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_enqueue_is_refused_before_any_sql(
    conn: psycopg.Connection[Any], label: str, kwargs: dict[str, Any],
) -> None:
    topic = kwargs.pop("topic")
    with pytest.raises(InvalidInputError):
        Producer().enqueue(conn, topic, **kwargs)
    assert conn.info.transaction_status == TransactionStatus.IDLE


def test_bad_row_in_batch_is_refused_before_any_sql_naming_its_index(
    conn: psycopg.Connection[Any],
) -> None:
    events = [NewEvent(topic="ok") for _ in range(5)] + [NewEvent(topic="bad topic")]
    with pytest.raises(InvalidInputError, match="event #5: malformed topic 'bad topic'"):
        Producer().enqueue_many(conn, events)
    assert conn.info.transaction_status == TransactionStatus.IDLE


def test_unknown_field_in_mapping_is_refused_before_any_sql(
    conn: psycopg.Connection[Any],
) -> None:
    with pytest.raises(InvalidInputError, match="event #0"):
        Producer().enqueue_many(conn, [{"topic": "x", "colour": "red"}])
    assert conn.info.transaction_status == TransactionStatus.IDLE


def test_payload_over_config_limit_is_refused_before_any_sql(
    conn: psycopg.Connection[Any],
) -> None:
    with pytest.raises(PayloadTooLargeError):
        Producer(ProducerConfig(max_payload_bytes=10)).enqueue(conn, "x", "x" * 20)
    assert conn.info.transaction_status == TransactionStatus.IDLE


async def test_async_bad_enqueue_is_refused_before_any_sql(
    aconn: psycopg.AsyncConnection[Any],
) -> None:
    with pytest.raises(InvalidInputError):
        await AsyncProducer().enqueue(aconn, "x", tenant="Not A Label")
    assert aconn.info.transaction_status == TransactionStatus.IDLE


def test_database_refusal_is_wrapped_in_database_error(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(DatabaseError, match="enqueue of topic 'x' failed") as info:
        Producer(ProducerConfig(schema="not_migrated")).enqueue(conn, "x")
    assert isinstance(info.value.__cause__, psycopg.Error)


# ---------------------------------------------------------------------- NOTIFY

def test_commit_sends_notify_with_the_topic(fresh_db: str) -> None:
    with _listen(fresh_db) as listener, psycopg.connect(fresh_db) as conn:
        Producer().enqueue(conn, "email.send", {"body": "x" * 5000})
        assert _notifications(listener, 0, 0.1) == []
        conn.commit()
        assert _notifications(listener) == ["email.send"]


def test_rollback_sends_no_notify(fresh_db: str) -> None:
    with _listen(fresh_db) as listener, psycopg.connect(fresh_db) as conn:
        Producer().enqueue(conn, "email.send")
        conn.rollback()
        assert _notifications(listener, 0, 0.1) == []


def test_delayed_event_notify_carries_topic_and_due_epoch(fresh_db: str) -> None:
    with _listen(fresh_db) as listener, psycopg.connect(fresh_db) as conn:
        before = time.time()
        Producer().enqueue(conn, "report.build", delay=120)
        conn.commit()
        (payload,) = _notifications(listener)
    topic, _, due = payload.partition("|")
    assert topic == "report.build"
    assert before + 119 < float(due) < time.time() + 121


def test_batch_sends_one_notify_per_topic(fresh_db: str) -> None:
    with _listen(fresh_db) as listener, psycopg.connect(fresh_db) as conn:
        Producer().enqueue_many(conn, [NewEvent(topic=f"t{i % 2}") for i in range(200)])
        conn.commit()
        assert sorted(_notifications(listener, 2)) == ["t0", "t1"]


# --------------------------------------------------------- committing producers

def test_committing_producer_commits_each_enqueue(fresh_db: str) -> None:
    with CommittingProducer(fresh_db) as producer:
        event_id = producer.enqueue("x", {"a": 1}, tenant="acme", priority=2)
        with psycopg.connect(fresh_db) as other:
            assert _rows(other, [event_id])[0][1:5] == ("acme", "x", {"a": 1}, 2)


def test_committing_producer_batch_is_all_or_nothing(fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as admin:
        admin.execute("ALTER TABLE conveyor.events ADD CONSTRAINT no_poison"
                      " CHECK (topic <> 'poison')")
    with CommittingProducer(fresh_db) as producer:
        with pytest.raises(DatabaseError):
            producer.enqueue_many([NewEvent(topic="fine"), NewEvent(topic="poison")])
        assert len(producer.enqueue_many([NewEvent(topic="fine")])) == 1
    with psycopg.connect(fresh_db) as other:
        assert _count(other) == 1


def test_committing_producer_reconnects_after_close(fresh_db: str) -> None:
    producer = CommittingProducer(fresh_db)
    try:
        producer.enqueue("x")
        producer.close()
        producer.enqueue("x")
    finally:
        producer.close()
    with psycopg.connect(fresh_db) as other:
        assert _count(other) == 2


async def test_async_committing_producer_commits_each_enqueue(fresh_db: str) -> None:
    async with AsyncCommittingProducer(fresh_db) as producer:
        first = await producer.enqueue("x", idempotency_key="k")
        assert await producer.enqueue("x", idempotency_key="k") == first
        ids = await producer.enqueue_many([NewEvent(topic="y"), NewEvent(topic="z")])
    with psycopg.connect(fresh_db) as other:
        assert sorted(r[0] for r in _rows(other, [first, *ids])) == sorted([first, *ids])
        assert _count(other) == 3


async def test_async_committing_producer_refuses_bad_input(fresh_db: str) -> None:
    async with AsyncCommittingProducer(fresh_db) as producer:
        with pytest.raises(InvalidInputError):
            await producer.enqueue("bad topic")
        assert len(await producer.enqueue_many([NewEvent(topic="ok")])) == 1


# ------------------------------------------ idempotency across open transactions

def _enqueue_in_thread(url: str, key: str, out: list[int]) -> threading.Thread:
    def run() -> None:
        with psycopg.connect(url) as conn:
            out.append(Producer().enqueue(conn, "x", idempotency_key=key))
            conn.commit()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _waiting_on_lock(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                           " AND wait_event_type = 'Lock'").fetchone()
        return bool(row and row[0])


def _wait_until_blocked(url: str) -> None:
    deadline = time.monotonic() + 10
    while not _waiting_on_lock(url):
        assert time.monotonic() < deadline, "second enqueue never waited for the first"
        time.sleep(0.02)


@pytest.mark.slow
def test_same_key_in_concurrent_transaction_waits_and_returns_the_committed_id(
    fresh_db: str,
) -> None:
    got: list[int] = []
    with psycopg.connect(fresh_db) as first:
        first_id = Producer().enqueue(first, "x", idempotency_key="race")
        thread = _enqueue_in_thread(fresh_db, "race", got)
        _wait_until_blocked(fresh_db)
        first.commit()
    thread.join(timeout=10)
    assert got == [first_id]


@pytest.mark.slow
def test_same_key_after_concurrent_rollback_writes_its_own_event(fresh_db: str) -> None:
    got: list[int] = []
    with psycopg.connect(fresh_db) as first:
        first_id = Producer().enqueue(first, "x", idempotency_key="race")
        thread = _enqueue_in_thread(fresh_db, "race", got)
        _wait_until_blocked(fresh_db)
        first.rollback()
    thread.join(timeout=10)
    assert len(got) == 1 and got[0] != first_id
    with psycopg.connect(fresh_db) as conn:
        assert _rows(conn, got)[0][6] == "race" and _count(conn) == 1


# --------------------------------------------- connections with another row factory

DICT_ROW_BUG = ("BUG: the producer indexes rows by position (found[0], r[0]), so on a "
                "connection with row_factory=dict_row (common in applications) it raises "
                "KeyError: 0; fix: run its queries on conn.cursor(row_factory=tuple_row)")


def test_enqueue_on_a_dict_row_connection_returns_the_id(conn: psycopg.Connection[Any]) -> None:
    from psycopg.rows import dict_row

    conn.row_factory = dict_row  # type: ignore[assignment]
    event_id = Producer().enqueue(conn, "x")
    assert isinstance(event_id, int)


def test_enqueue_many_on_a_dict_row_connection_returns_ids(conn: psycopg.Connection[Any]) -> None:
    from psycopg.rows import dict_row

    conn.row_factory = dict_row  # type: ignore[assignment]
    assert len(Producer().enqueue_many(conn, [NewEvent(topic="x")] * 3)) == 3


async def test_async_enqueue_on_a_dict_row_connection_returns_the_id(
    aconn: psycopg.AsyncConnection[Any],
) -> None:
    from psycopg.rows import dict_row

    aconn.row_factory = dict_row  # type: ignore[assignment]
    assert isinstance(await AsyncProducer().enqueue(aconn, "x"), int)


def test_many_enqueues_of_one_topic_in_a_transaction_send_one_notify(fresh_db: str) -> None:
    # PostgreSQL folds identical notifications of one transaction into one.
    with _listen(fresh_db) as listener, psycopg.connect(fresh_db) as conn:
        for i in range(50):
            Producer().enqueue(conn, "email.send", {"i": i})
        conn.commit()
        assert _notifications(listener) == ["email.send"]


# ------------------------------------------------------------ payload fidelity

# Each of these came back changed before: floats from 1e16 up as ints (jsonb
# prints 1e+16 as 10000000000000000), 1e300 as a 301-digit int.
FLOATS = {"f16": 1e16, "f300": 1e300, "neg": -2.5e20, "max": 1.7976931348623157e308,
          "tiny": 5e-324, "small": 1e-07, "plain": 1234.5, "whole": 3.0,
          "ints": [10**20, -(10**30), 0], "text": "1e+16"}


def _stored_payloads(conn: psycopg.Connection[Any], topic: str) -> list[Any]:
    return [r[0] for r in conn.execute(
        "SELECT payload FROM conveyor.events WHERE topic = %s ORDER BY id", (topic,))]


def _assert_same_types(stored: Any, sent: Any) -> None:
    assert stored == sent
    if isinstance(sent, dict):
        for key in sent:
            _assert_same_types(stored[key], sent[key])
    elif isinstance(sent, list):
        for got, want in zip(stored, sent, strict=True):
            _assert_same_types(got, want)
    else:
        assert type(stored) is type(sent), (stored, sent)


def test_floats_come_back_as_the_same_floats(conn: psycopg.Connection[Any]) -> None:
    Producer().enqueue(conn, "fidelity.one", FLOATS)
    [stored] = _stored_payloads(conn, "fidelity.one")
    _assert_same_types(stored, FLOATS)


def test_floats_come_back_as_the_same_floats_from_a_bulk_copy(
    conn: psycopg.Connection[Any],
) -> None:
    assert Producer().enqueue_bulk(conn, [("fidelity.bulk", FLOATS)] * COPY_THRESHOLD) \
        == COPY_THRESHOLD
    for stored in _stored_payloads(conn, "fidelity.bulk"):
        _assert_same_types(stored, FLOATS)


def test_non_string_keys_come_back_as_strings(conn: psycopg.Connection[Any]) -> None:
    Producer().enqueue(conn, "fidelity.keys", {1: "a", 2.5: "b", None: "c", False: "d"})
    assert _stored_payloads(conn, "fidelity.keys") == [
        {"1": "a", "2.5": "b", "null": "c", "false": "d"}]


def test_colliding_keys_in_a_batch_are_refused_naming_the_event_and_key(
    conn: psycopg.Connection[Any],
) -> None:
    events = [("fidelity.batch", {"i": i}) for i in range(100)]
    events[70] = ("fidelity.batch", {"i": {1: "int-key", "1": "str-key"}})
    with pytest.raises(InvalidInputError,
                       match=r"^event #70: payload has two keys that are both '1' in JSON"):
        Producer().enqueue_bulk(conn, events)
    assert conn.info.transaction_status == TransactionStatus.IDLE


# ---------------------------------------------- any exception leaves it idle

class ExplodingDict(dict[str, Any]):
    """A payload whose serialisation raises something other than InvalidInputError."""

    def items(self) -> Any:
        raise RuntimeError("items exploded")


def _exploding_batch(topic: str) -> list[Any]:
    events: list[Any] = [(topic, {"i": i}) for i in range(100)]
    events[70] = (topic, ExplodingDict(i=70))
    return events


def test_a_bulk_batch_that_begins_the_transaction_is_rolled_back_on_any_error(
    fresh_db: str,
) -> None:
    """Regression (F11): an error other than InvalidInputError left the connection INERROR."""
    producer = Producer()
    with psycopg.connect(fresh_db) as conn:
        with pytest.raises(RuntimeError, match="items exploded"):
            producer.enqueue_bulk(conn, _exploding_batch("boom.sync"))
        assert conn.info.transaction_status == TransactionStatus.IDLE
        assert producer.enqueue_bulk(conn, _exploding_batch("boom.sync")[:70]) == 70
        conn.commit()
        assert _count(conn) == 70


async def test_async_bulk_batch_that_begins_the_transaction_is_rolled_back_on_any_error(
    fresh_db: str,
) -> None:
    producer = AsyncProducer()
    async with await psycopg.AsyncConnection.connect(fresh_db) as aconn:
        with pytest.raises(RuntimeError, match="items exploded"):
            await producer.enqueue_bulk(aconn, _exploding_batch("boom.async"))
        assert aconn.info.transaction_status == TransactionStatus.IDLE
        assert await producer.enqueue_bulk(aconn, _exploding_batch("boom.async")[:70]) == 70
        await aconn.commit()
        cur = await aconn.execute("SELECT count(*) FROM conveyor.events")
        assert await cur.fetchone() == (70,)


def test_an_error_inside_an_open_transaction_leaves_it_as_it_was(fresh_db: str) -> None:
    producer = Producer()
    with psycopg.connect(fresh_db) as conn:
        producer.enqueue(conn, "boom.first")
        with pytest.raises(RuntimeError, match="items exploded"):
            producer.enqueue_bulk(conn, _exploding_batch("boom.open"))
        assert conn.info.transaction_status == TransactionStatus.INTRANS
        conn.commit()
        assert _count(conn) == 1
