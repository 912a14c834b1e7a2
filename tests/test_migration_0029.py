"""Migration 0029 on a populated version-28 table: the state and topic rules now kept by
domains the table's CHECKs cast to; nothing read or rewritten, every rule still enforced.

What it buys is CPU per statement (docs/benchmarks.md, benchmarks/insert_costs.py):
PostgreSQL rebuilds each table CHECK from its stored expression at the start of
every statement that writes the table. The size of what it rebuilds is counted
here; the time it takes is the benchmark's.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from conveyor.db.named_queries import queries_for
from conveyor.schema.migrator import Migrator, migration_script
from conveyor.worker.pruner import HISTORY_AHEAD
from migration_support import migrate_to

LIVE, FINISHED = 5_000, 5_000
RULES = ("events_state_check", "events_topic_check")


def _storage(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """relfilenode of every table and index of the schema: a new one means a rewrite."""
    return dict(conn.execute(
        "SELECT relname, relfilenode FROM pg_class"
        " WHERE relnamespace = 'conveyor'::regnamespace AND relkind IN ('r', 'i')").fetchall())


def _rows(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT id, state, topic, done FROM conveyor.events ORDER BY id").fetchall()


def _stored_rules(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """The length of each rule's stored expression on the parent, what every
    statement writing the table reads back and plans."""
    return dict(conn.execute(
        "SELECT conname, length(conbin) FROM pg_constraint"
        " WHERE conrelid = 'conveyor.events'::regclass AND conname = ANY(%s)",
        (list(RULES),)).fetchall())


@pytest.fixture
def version_28(empty_db: str, monkeypatch: pytest.MonkeyPatch) -> str:
    migrate_to(empty_db, 28, monkeypatch)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute(queries_for("conveyor")["history_make"], {"ahead": HISTORY_AHEAD})
        conn.execute(
            "INSERT INTO conveyor.events (topic, payload, state)"
            " SELECT 't' || (g %% 7), '{}', (ARRAY['pending', 'failed', 'waiting'])[1 + g %% 3]"
            " FROM generate_series(1, %s) AS g", (LIVE,))
        conn.execute(
            "INSERT INTO conveyor.events (topic, payload, state, finished_at, done)"
            " SELECT 't' || (g %% 7), '{}', (ARRAY['succeeded', 'cancelled'])[1 + g %% 2],"
            "        now(), true FROM generate_series(1, %s) AS g", (FINISHED,))
    return empty_db


def test_0029_changes_the_catalog_only(version_28: str) -> None:
    with psycopg.connect(version_28, autocommit=True) as conn:
        before, rows, rules = _storage(conn), _rows(conn), _stored_rules(conn)
        assert len(rows) == LIVE + FINISHED and sum(1 for r in rows if r[3]) == FINISHED
        with conn.transaction():
            conn.execute(migration_script("conveyor", 29, 29).encode())
        assert Migrator().applied_versions(conn) == list(range(1, 30))
        assert _storage(conn) == before, "a table or an index was rewritten"
        assert _rows(conn) == rows
        # Added without reading the table: NOT VALID on every partition.
        validated = conn.execute(
            "SELECT DISTINCT convalidated FROM pg_constraint"
            " WHERE conrelid <> 0 AND conname = ANY(%s)", (list(RULES),)).fetchall()
        assert validated == [(False,)]
        after = _stored_rules(conn)
    # Measured 2026-12-06: 1,400 and 1,109 characters before, 295 each after.
    assert after["events_state_check"] <= rules["events_state_check"] / 3, (rules, after)
    assert after["events_topic_check"] <= rules["events_topic_check"] / 3, (rules, after)


@pytest.mark.parametrize(("sql", "rule"), [
    ("INSERT INTO conveyor.events_live (topic, payload, state) VALUES ('ok', '{}', 'done')",
     "events_state_check"),
    ("INSERT INTO conveyor.events (topic, payload) VALUES ('', '{}')", "events_topic_check"),
    ("INSERT INTO conveyor.events (topic, payload) VALUES (repeat('t', 101), '{}')",
     "events_topic_check"),
    ("UPDATE conveyor.events SET state = 'paused' WHERE id = (SELECT min(id)"
     " FROM conveyor.events WHERE state = 'pending')", "events_state_check"),
    # The history, made by the day-maker before 0029, and a day it makes after.
    ("UPDATE conveyor.events SET topic = '' WHERE id = (SELECT min(id)"
     " FROM conveyor.events WHERE done)", "events_topic_check"),
    ("INSERT INTO conveyor.events (topic, payload, state, finished_at, done)"
     " VALUES ('', '{}', 'succeeded', now() + interval '1 day', true)", "events_topic_check"),
])
def test_after_0029_every_rule_still_refuses_a_bad_value(version_28: str, sql: str,
                                                         rule: str) -> None:
    with psycopg.connect(version_28, autocommit=True) as conn:
        Migrator().apply(conn)
        conn.execute(queries_for("conveyor")["history_make"], {"ahead": HISTORY_AHEAD})
        with pytest.raises(psycopg.errors.CheckViolation, match=rule):
            conn.execute(sql)


def test_after_0029_a_copy_of_a_bad_state_is_refused_whole(version_28: str) -> None:
    with psycopg.connect(version_28) as conn:
        Migrator().apply(conn)
        count = conn.execute("SELECT count(*) FROM conveyor.events").fetchone()
        with pytest.raises(psycopg.errors.CheckViolation, match="events_state_check"), \
                conn.cursor().copy("COPY conveyor.events_live (topic, payload, state)"
                                   " FROM STDIN") as copy:
            copy.write_row(("ok", "{}", "pending"))
            copy.write_row(("ok", "{}", "bogus"))
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM conveyor.events").fetchone() == count
