"""Migration 0025 on a populated table, with a producer writing through it.

`events` becomes a partitioned parent and today's table its live partition
(docs/history-partitions.md): every row stays, with its id and state; the ids
go on from where the identity stood; the ordered relay's triggers keep
stamping; and a producer writing the whole time is held back only by the
last step's brief lock, not by a scan of the table.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from conveyor import Admin, Producer
from conveyor.schema.migrator import Migrator
from migration_support import migrate_to

ROWS = 200_000


def _fill(conn: psycopg.Connection[Any]) -> None:
    conn.execute(f"""
        INSERT INTO conveyor.events (topic, payload, state, attempts, finished_at)
        SELECT 'old.done', '{{}}', 'succeeded', 1, now() - interval '1 hour'
        FROM generate_series(1, {ROWS})""")
    conn.execute("""
        INSERT INTO conveyor.events (topic, payload, state, attempts, finished_at, last_error)
        VALUES ('old.failed', '{}', 'failed', 5, now(), 'boom')""")
    conn.execute("INSERT INTO conveyor.events (topic, payload, idempotency_key)"
                 " VALUES ('old.keyed', '{}', 'k-1')")
    conn.execute("SELECT conveyor.order_topics('old.ordered')")
    conn.execute("INSERT INTO conveyor.events (topic, payload) VALUES ('old.ordered', '{}')")
    conn.execute("VACUUM ANALYZE conveyor.events")


def test_0025_keeps_every_row_and_id_while_a_producer_writes_through_it(
        empty_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    migrate_to(empty_db, 24, monkeypatch)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        _fill(conn)
        before = conn.execute("SELECT id, state, topic FROM conveyor.events ORDER BY id").fetchall()
        last_id = conn.execute("SELECT last_value FROM conveyor.events_id_seq").fetchone()

    # A producer of the version before (plain INSERTs naming `events`, which
    # work on both layouts), one transaction per event, timing each.
    stop, waits, written, errors = threading.Event(), [], [], []

    def produce() -> None:
        try:
            with psycopg.connect(empty_db, autocommit=True) as conn:
                while not stop.is_set():
                    started = time.monotonic()
                    row = conn.execute("INSERT INTO conveyor.events (topic, payload)"
                                       " VALUES ('during', '{}') RETURNING id").fetchone()
                    waits.append(time.monotonic() - started)
                    written.append(row[0] if row else None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        with psycopg.connect(empty_db, autocommit=True) as conn:
            applied = Migrator().apply(conn)
        # Producers write on after the migration too.
        deadline = time.monotonic() + 30
        count = len(written)
        while len(written) < count + 20 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        producer.join(timeout=30)
    assert errors == []
    assert applied[0].version == 25     # and those after it
    # The validating scan of 200,000 rows does not stop the producer; only
    # the rename's catalog work does, briefly.
    assert max(waits) < 2.0, sorted(waits)[-5:]

    with psycopg.connect(empty_db, autocommit=True) as conn:
        kinds = dict(conn.execute(
            "SELECT c.relname, c.relkind::text FROM pg_class c"
            " WHERE c.relnamespace = 'conveyor'::regnamespace"
            "   AND c.relname IN ('events', 'events_live', 'events_done')").fetchall())
        assert kinds == {"events": "p", "events_live": "r", "events_done": "p"}
        after = conn.execute("SELECT id, state, topic FROM conveyor.events"
                             " WHERE topic <> 'during' ORDER BY id").fetchall()
        assert after == before
        during = [r[0] for r in conn.execute(
            "SELECT id FROM conveyor.events WHERE topic = 'during' ORDER BY id")]
        assert during == sorted(written) and len(set(during)) == len(during)
        assert last_id is not None and min(during) > last_id[0]
        # The sequence as the producers look it up; and it goes on.
        assert conn.execute("SELECT pg_get_serial_sequence('conveyor.events', 'id')"
                            ).fetchone() == ("conveyor.events_id_seq",)
        # The ordered route's trigger stayed on the live partition and stamps.
        new = Producer().enqueue(conn, "old.ordered", {})
        assert new > max(during)
        assert conn.execute("SELECT xid IS NOT NULL FROM conveyor.events WHERE id = %s",
                            (new,)).fetchone() == (True,)
        # The key still deduplicates (ON CONFLICT on the live partition).
        keyed = conn.execute("SELECT id FROM conveyor.events WHERE idempotency_key = 'k-1'"
                             ).fetchone()
        assert keyed is not None
        assert Producer().enqueue(conn, "old.keyed", {}, idempotency_key="k-1") == keyed[0]
        # Status estimates a table this big from the live partition's
        # statistics (the parent has none): near the truth, not 0.
        status = Admin().status(conn)
        assert "succeeded" in status.estimated_states
        assert abs(status.counts["succeeded"] - ROWS) < ROWS * 0.05, status.counts
        assert status.counts["failed"] == 1
