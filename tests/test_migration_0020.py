"""Migration 0020: a new event's error history and update time are written when it has them.

The row stores NULL for both until they mean something; Conveyor's readers
(Admin, the CLI, conveyor.testing) still give an empty history and the
creation time, and the first failed attempt starts the history.
"""

from __future__ import annotations

import psycopg

from claim_support import claim_params
from conveyor import Admin, Producer
from conveyor.db.named_queries import queries_for

Q = queries_for("conveyor")


def test_a_new_event_stores_neither_and_reads_as_before(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        event_id = Producer().enqueue(conn, "orders.created", {"n": 1})
        conn.commit()
        assert conn.execute("SELECT errors, updated_at FROM conveyor.events WHERE id = %s",
                            (event_id,)).fetchone() == (None, None)
        record = Admin().show(conn, event_id)
        assert record.errors == [] and record.updated_at == record.created_at
        [summary] = Admin().events(conn).events
        assert summary.updated_at == summary.created_at
        # The first failed attempt writes the history from an empty one.
        owner = "00000000-0000-0000-0000-000000000001"
        claimed = conn.execute(Q["event_claim"], claim_params(limit=1, owner=owner)).fetchall()
        assert [r[0] for r in claimed] == [event_id]
        conn.execute(Q["event_settle_many"], {
            "owner": owner, "ids": [event_id], "attempts": [1], "states": ["pending"],
            "delays": [0.0], "refunds": [0], "errors": ["ValueError: no"],
            "tracebacks": [None], "results": [None]})
        conn.commit()
        record = Admin().show(conn, event_id)
    assert [(e.attempt, e.error) for e in record.errors] == [(1, "ValueError: no")]
    assert record.updated_at > record.created_at
