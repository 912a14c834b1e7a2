"""Migration 0019: the ordered relay's xid and index only for the topics of ordered routes.

Without an ordered route an event carries no xid and adds nothing to
events_relay_order_idx (a bulk enqueue wrote about 94 bytes of WAL per event
into it before); a route's trigger (order_topics) gives its topics' events
their transaction's id, keeps the ones written before it in order, and never
holds producers back behind a long transaction for more than half a second.
"""

from __future__ import annotations

import time

import psycopg
import pytest

from conveyor import NewEvent, Producer
from conveyor.db.named_queries import queries_for
from conveyor.patterns import sql_params
from conveyor.schema.migrator import Migrator, latest_version
from migration_support import migrate_to
from server_support import own_server
from wal_support import OwnWal

Q = queries_for("conveyor")
EVENTS = 2_000

# A server of its own: the ordered read passes only transactions older than
# every one still running on the server, and the shared server's other tests
# held it back (31 s of the module in the CI run of 7578691).
server_url, make_db, template_db, shared_db_url = own_server("conveyor-0019-")


def _wal_per_event(conn: psycopg.Connection, topic: str) -> float:
    """WAL per event of a bulk enqueue, 1,000 events a transaction: its own records only."""
    # The table as autovacuum leaves it: the first statement to set a hint bit
    # on a page copied from the template since the last checkpoint writes the
    # whole page (8 kB, 4 bytes an event here), a cost of when the checkpoint
    # came, not of the enqueue.
    conn.commit()
    conn.autocommit = True
    conn.execute("VACUUM conveyor.events")
    conn.autocommit = False
    wal = OwnWal(conn)
    for _ in range(EVENTS // 1000):
        Producer().enqueue_bulk(conn, [NewEvent(topic=topic, payload={"i": i})
                                       for i in range(1000)])
        wal.mark()
        conn.commit()
    return wal.bytes() / EVENTS


def test_without_an_ordered_route_events_carry_no_xid_and_cost_the_index_nothing(
        fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        Producer().enqueue_bulk(conn, [NewEvent(topic="warm.up", payload={}) for _ in range(10)])
        conn.commit()
        after = _wal_per_event(conn, "bench.noop")
        assert conn.execute("SELECT count(*) FROM conveyor.events WHERE xid IS NOT NULL"
                            ).fetchone() == (0,)
        assert conn.execute("SELECT pg_relation_size('conveyor.events_relay_order_idx')"
                            ).fetchone() == (8192,)            # its metapage alone
        # The same enqueue with 0016's shape back (every event's xid, every
        # pending event in the index): what every user paid before.
        conn.execute("ALTER TABLE conveyor.events ALTER COLUMN xid"
                     " SET DEFAULT pg_current_xact_id()")
        conn.execute("DROP INDEX conveyor.events_relay_order_idx")
        conn.execute("CREATE INDEX events_relay_order_idx ON conveyor.events"
                     " (topic, xid NULLS FIRST, id) WHERE state = 'pending'")
        conn.commit()
        before = _wal_per_event(conn, "bench.noop")
    print(f"\nWAL per bulk-enqueued event: {before:.1f} bytes with 0016's shape, {after:.1f} now")
    assert after < before - 80, (before, after)
    assert after <= 280, after


def test_a_routes_trigger_gives_its_topics_their_xid_and_keeps_older_events_first(
        empty_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    migrate_to(empty_db, 15, monkeypatch)
    insert = "INSERT INTO conveyor.events (topic, payload) VALUES (%s, '{}') RETURNING id"
    with psycopg.connect(empty_db, autocommit=True) as conn:
        def add(topic: str) -> int:
            return conn.execute(insert, (topic,)).fetchone()[0]

        before_0016 = [add("orders.a"), add("orders.b")]
        migrate_to(empty_db, 18, monkeypatch)
        in_0016 = add("orders.a")
        assert [m.version for m in Migrator().apply(conn)] == list(range(19, latest_version() + 1))
        since_0019 = [add("orders.a"), add("audit.x")]
        xid = conn.execute("SELECT xid FROM conveyor.events WHERE id = %s",
                           (since_0019[0],)).fetchone()
        assert xid == (None,)                                  # no route, no xid
        assert conn.execute(Q["relay_order_topics"], {"pattern": "orders.*"}).fetchone() == (3,)
        assert conn.execute(Q["relay_order_topics"], {"pattern": "orders.*"}).fetchone() == (None,)
        later = [add("orders.c"), add("audit.y")]
        rows = dict(conn.execute("SELECT id, xid::text FROM conveyor.events").fetchall())
        assert rows[later[1]] is None and rows[since_0019[1]] is None
        assert rows[later[0]] is not None
        # The read passes only transactions older than every one still running on
        # the server: another test's may be, for a moment.
        deadline = time.monotonic() + 60
        while len(read := [r[0] for r in conn.execute(Q["relay_ordered_next"], {
                **sql_params(["orders.*"]), "limit": 100}).fetchall()]) < 5 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    # Before 0016 first (xid 0), then 0016's own, then those written since 0019
    # (the trigger's transaction), then the ones the trigger stamped itself.
    assert read == [*before_0016, in_0016, since_0019[0], later[0]]


def test_the_trigger_waits_half_a_second_for_a_writer_then_gives_up(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as writer, \
            psycopg.connect(fresh_db, autocommit=True) as conn:
        writer.execute("INSERT INTO conveyor.events (topic, payload) VALUES ('orders.a', '{}')")
        started = time.monotonic()
        with pytest.raises(psycopg.errors.LockNotAvailable):
            conn.execute(Q["relay_order_topics"], {"pattern": "orders.*"})
        waited = time.monotonic() - started
        writer.commit()
        assert conn.execute(Q["relay_order_topics"], {"pattern": "orders.*"}).fetchone() == (1,)
    assert 0.4 < waited < 5, waited
