"""The outbox promise: an event exists if and only if the caller's transaction commits."""

from __future__ import annotations

import psycopg

from conveyor import Producer


def _count(url: str) -> int:
    with psycopg.connect(url) as c:
        row = c.execute("SELECT count(*) FROM conveyor.events").fetchone()
        assert row is not None
        return int(row[0])


def test_rollback_leaves_no_event(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        conn.execute("CREATE TABLE orders (id int)")
        conn.commit()
        conn.execute("INSERT INTO orders VALUES (1)")
        Producer().enqueue(conn, "order.created", {"id": 1})
        conn.rollback()
    assert _count(fresh_db) == 0


def test_commit_leaves_exactly_one_event(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        conn.execute("CREATE TABLE orders (id int)")
        conn.execute("INSERT INTO orders VALUES (1)")
        event_id = Producer().enqueue(conn, "order.created", {"id": 1})
        conn.commit()
    assert _count(fresh_db) == 1
    with psycopg.connect(fresh_db) as c:
        row = c.execute("SELECT topic, payload FROM conveyor.events WHERE id = %s",
                        (event_id,)).fetchone()
    assert row == ("order.created", {"id": 1})
