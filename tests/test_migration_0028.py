"""0028: the primary key and the claim index fill their pages to the brim by appends.

A bulk enqueue enters each event into those two indexes at their right edge;
a split of the rightmost page there logged the tenth of a page that the
default fillfactor (90) moves to the new page. Counted, not timed: the WAL
of the test's own transactions (tests/wal_support.py) and the indexes' pages.
"""

from __future__ import annotations

import psycopg

from conveyor import NewEvent, Producer
from wal_support import OwnWal

EVENTS = 10_000
INDEXES = ("events_pkey", "events_claim_idx")


def _enqueue(conn: psycopg.Connection) -> tuple[float, dict[str, int]]:
    """WAL per event of a bulk enqueue into an empty table, and each index's pages after it."""
    conn.commit()
    conn.autocommit = True
    conn.execute("TRUNCATE conveyor.events_live")
    conn.execute("VACUUM conveyor.events_live")
    conn.autocommit = False
    wal = OwnWal(conn)
    for _ in range(EVENTS // 1000):
        Producer().enqueue_bulk(conn, [NewEvent(topic="bench.noop", payload={"i": i})
                                       for i in range(1000)])
        wal.mark()
        conn.commit()
    pages = {name: conn.execute("SELECT pg_relation_size(%s) / 8192",
                                (f"conveyor.{name}",)).fetchone()[0] for name in INDEXES}
    return wal.bytes() / EVENTS, pages


def test_a_bulk_enqueue_splits_the_right_edge_without_moving_a_tenth_of_a_page(
        fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        options = conn.execute(
            "SELECT relname, reloptions FROM pg_class WHERE relnamespace = 'conveyor'::regnamespace"
            " AND relname = ANY(%s) ORDER BY relname", (list(INDEXES),)).fetchall()
        assert options == [("events_claim_idx", ["fillfactor=100"]),
                           ("events_pkey", ["fillfactor=100"])]
        now_wal, now_pages = _enqueue(conn)
        # The same enqueue with the indexes as they were before 0028.
        for name in INDEXES:
            conn.execute(f"ALTER INDEX conveyor.{name} RESET (fillfactor)")
        before_wal, before_pages = _enqueue(conn)
    # Measured 2026-12-05: 7 bytes an event less (5 of them the claim index's,
    # whose entries are the wider), and a tenth fewer pages in each.
    assert now_wal <= before_wal - 4, (now_wal, before_wal)
    for name in INDEXES:
        assert now_pages[name] <= 0.93 * before_pages[name], (name, now_pages, before_pages)
