"""tests/wal_support.py's OwnWal keeps counting while the server recycles its WAL.

Its count reads the WAL back from where it started. On a server the parallel
tier keeps busy, a checkpoint may remove that segment before the count
(seen 2026-12-06: "could not open file" from pg_get_wal_records_info in
tests/test_migration_0028.py); the counter holds the WAL it needs.
"""

from __future__ import annotations

import psycopg

from wal_support import OwnWal


def _recycle_wal(url: str) -> None:
    """Two checkpoints past a segment switch: the segments before the second's
    redo point are removed or recycled, unless something holds them."""
    with psycopg.connect(url, autocommit=True) as admin:
        for _ in range(2):
            admin.execute("SELECT pg_switch_wal()")
            admin.execute("CREATE TABLE IF NOT EXISTS wal_filler (n int)")
            admin.execute("INSERT INTO wal_filler SELECT generate_series(1, 1000)")
            admin.execute("CHECKPOINT")


def test_own_wal_counts_its_transactions_after_a_checkpoint_recycled_the_segments(
        fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        conn.execute("CREATE TABLE counted (n int)")
        conn.commit()
        wal = OwnWal(conn)
        conn.execute("INSERT INTO counted SELECT generate_series(1, 100)")
        wal.mark()
        conn.commit()
        _recycle_wal(fresh_db)
        # 100 heap inserts: each record is at least its tuple (a header and an int).
        assert wal.bytes() >= 100 * 28


def test_counters_on_one_connection_share_its_slot(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        first, second = OwnWal(conn), OwnWal(conn)
        conn.execute("CREATE TABLE counted (n int)")
        second.mark()
        conn.commit()
        slots = conn.execute("SELECT count(*) FROM pg_replication_slots"
                             " WHERE temporary AND active_pid = pg_backend_pid()").fetchone()
        assert slots == (1,)
        assert first.transactions == 0 and second.bytes() > 0
