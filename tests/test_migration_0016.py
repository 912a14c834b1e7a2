"""Migration 0016 on a populated version-15 table: no row rewritten, no index rebuilt,
existing rows without an xid (read first by the ordered relay), new rows with their
transaction's."""

from __future__ import annotations

import time

import psycopg
import pytest

from conveyor.db.named_queries import queries_for
from conveyor.patterns import sql_params
from conveyor.schema import migrator_core as migrator_module
from conveyor.schema.migrator import Migrator, load_migrations
from migration_support import migrate_to, storage
from server_support import own_server

ROWS = 20_000

# A server of its own: the ordered read returns only events older than every
# transaction open in the whole cluster (pg_snapshot_xmin), so another test's
# transaction in another database would hold the new event back. (Until
# 2026-12-03 the test ran alone in the serial tier.)
server_url, make_db, template_db, shared_db_url = own_server("conveyor-0016-")


@pytest.fixture
def version_15(empty_db: str, monkeypatch: pytest.MonkeyPatch) -> str:
    migrate_to(empty_db, 15, monkeypatch)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO conveyor.events (topic, payload, state, finished_at)"
            " SELECT 'order.t' || (g %% 7), jsonb_build_object('g', g),"
            "        (ARRAY['pending', 'succeeded', 'failed', 'cancelled'])[1 + g %% 4],"
            "        CASE WHEN g %% 4 <> 0 THEN now() END"
            " FROM generate_series(1, %s) AS g", (ROWS,))
        conn.execute("VACUUM ANALYZE conveyor.events")
    return empty_db


def test_0016_adds_the_xid_without_rewriting_and_old_events_come_first(
        version_15: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with psycopg.connect(version_15, autocommit=True) as conn:
        before = storage(conn)
        rows = conn.execute("SELECT id, state, payload FROM conveyor.events ORDER BY id").fetchall()
        # 0016 alone: the later migrations have their own tests, and their changes
        # are not what this one measures.
        with monkeypatch.context() as patch:
            patch.setattr(migrator_module, "load_migrations", lambda: load_migrations()[:16])
            assert [m.version for m in Migrator().apply(conn)] == [16]
        after = storage(conn)
        assert {k: v for k, v in after.items() if k != "events_relay_order_idx"} == before, \
            "the table or an index was rewritten"
        assert conn.execute("SELECT id, state, payload FROM conveyor.events"
                            " ORDER BY id").fetchall() == rows
        assert conn.execute("SELECT count(*) FROM conveyor.events"
                            " WHERE xid IS NOT NULL").fetchone() == (0,)
        with conn.transaction():
            new = conn.execute("INSERT INTO conveyor.events (topic, payload)"
                               " VALUES ('order.t1', '{}') RETURNING id").fetchone()[0]
            xid = conn.execute("SELECT pg_current_xact_id()::text").fetchone()[0]
        assert conn.execute("SELECT xid::text FROM conveyor.events WHERE id = %s",
                            (new,)).fetchone() == (xid,)
        # The ordered read, once the later migrations are in and the route has
        # its trigger (0019): the 5,000 pending rows from before 0016, by id,
        # then the new one.
        Migrator().apply(conn)
        q = queries_for("conveyor")
        assert conn.execute(q["relay_order_topics"], {"pattern": "order.*"}).fetchone() \
            == (ROWS // 4,)
        old_pending = [r[0] for r in rows if r[1] == "pending"]
        assert len(old_pending) == ROWS // 4
        # The read passes only transactions older than every one still running on
        # the server: another test's may be, for a moment.
        deadline = time.monotonic() + 60
        while len(read := [r[0] for r in conn.execute(q["relay_ordered_next"], {
                **sql_params(["order.*"]), "limit": 10_000}).fetchall()]) \
                < len(old_pending) + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read == [*sorted(old_pending), new]
