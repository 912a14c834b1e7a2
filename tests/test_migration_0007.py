"""Migration 0007 on a populated version-6 table: no row rewritten, no index rebuilt,
every rule still enforced, and the trigger's wake-ups now sent by the producer."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from conveyor import Producer
from conveyor.schema.migrator import Migrator, migration_script
from migration_support import migrate_to, storage
from wake_support import listen_for_wakes

ROWS = 20_000
GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _snapshot(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT id, state, attempts, max_attempts, topic, traceparent, tracestate, payload"
        " FROM conveyor.events ORDER BY id").fetchall()


@pytest.fixture
def version_6(empty_db: str, monkeypatch: pytest.MonkeyPatch) -> str:
    migrate_to(empty_db, 6, monkeypatch)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO conveyor.events (topic, payload, state, attempts, max_attempts,"
            " finished_at, traceparent, tracestate)"
            " SELECT 't' || (g %% 7), jsonb_build_object('g', g),"
            "        (ARRAY['pending', 'succeeded', 'failed', 'cancelled'])[1 + g %% 4],"
            "        g %% 3, 3, CASE WHEN g %% 4 <> 0 THEN now() END,"
            "        CASE WHEN g %% 5 = 0 THEN %s END, CASE WHEN g %% 10 = 0 THEN 'k=v' END"
            " FROM generate_series(1, %s) AS g", (GOOD, ROWS))
        conn.execute("VACUUM ANALYZE conveyor.events")
    return empty_db


def test_0007_changes_the_catalog_only(version_6: str) -> None:
    with psycopg.connect(version_6, autocommit=True) as conn:
        before, rows = storage(conn), _snapshot(conn)
        assert len(rows) == ROWS
        # 0007 alone, as an upgrade from version 6 applies it (0009 rebuilds an index on purpose).
        with conn.transaction():
            conn.execute(migration_script("conveyor", 7, 7).encode())
        assert Migrator().applied_versions(conn) == list(range(1, 8))
        assert storage(conn) == before, "the table or an index was rewritten"
        assert _snapshot(conn) == rows
        assert conn.execute("SELECT count(*) FROM pg_trigger"
                            " WHERE tgrelid = 'conveyor.events'::regclass"
                            " AND NOT tgisinternal").fetchone() == (0,)
        types = dict(conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = 'conveyor.events'::regclass AND attname = ANY(%s)",
            (["attempts", "max_attempts", "traceparent", "tracestate", "state", "topic"],)
        ).fetchall())
        assert types == {"attempts": "conveyor.attempt_count",
                         "max_attempts": "conveyor.attempt_limit",
                         "traceparent": "conveyor.traceparent",
                         "tracestate": "conveyor.tracestate",
                         "state": "text", "topic": "text"}


@pytest.mark.parametrize(("column", "value", "rule"), [
    ("attempts", -1, "attempt_count_check"),
    ("max_attempts", 0, "attempt_limit_check"),
    ("traceparent", GOOD.upper(), "traceparent_check"),
    ("tracestate", "k=" + "v" * 511, "tracestate_check"),
    ("state", "done", "events_state_check"),
    ("topic", "", "events_topic_check"),
])
def test_after_0007_every_rule_still_refuses_a_bad_value(
        version_6: str, column: str, value: Any, rule: str) -> None:
    with psycopg.connect(version_6, autocommit=True) as conn:
        Migrator().apply(conn)
        event_id = conn.execute("SELECT min(id) FROM conveyor.events"
                                " WHERE state = 'pending'").fetchone()[0]  # type: ignore[index]
        with pytest.raises(psycopg.errors.CheckViolation, match=rule):
            conn.execute(f"UPDATE conveyor.events SET {column} = %s WHERE id = %s",
                         (value, event_id))
        with pytest.raises(psycopg.errors.CheckViolation, match=rule):
            conn.execute(f"INSERT INTO conveyor.events (topic, payload, {column})"
                         " VALUES ('ok.topic', '{}', %s)" if column != "topic" else
                         "INSERT INTO conveyor.events (topic, payload) VALUES (%s, '{}')",
                         (value,))


def test_after_0007_an_enqueue_on_the_upgraded_table_wakes_its_listener(version_6: str) -> None:
    with psycopg.connect(version_6, autocommit=True) as listener, \
            psycopg.connect(version_6) as conn:
        Migrator().apply(conn)
        conn.commit()
        listen_for_wakes(listener)     # LISTEN, and wait as a worker does (the wake gate)
        event_id = Producer().enqueue(conn, "after.upgrade", {"ok": True})
        conn.commit()
        assert [n.payload for n in listener.notifies(timeout=5, stop_after=1)] == ["after.upgrade"]
        assert conn.execute("SELECT state, attempts, max_attempts FROM conveyor.events"
                            " WHERE id = %s", (event_id,)).fetchone() == ("pending", 0, 5)
