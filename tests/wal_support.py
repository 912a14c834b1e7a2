"""WAL written by a test's own transactions, whatever else the server is doing.

``pg_current_wal_insert_lsn()`` moves with every session's writes: on a
shared server, or beside other tests running in parallel, a difference of
two positions counts their WAL too. Each WAL record names the transaction
that wrote it; pg_walinspect (PostgreSQL 15's contrib) reads them back, so
summing the records of the test's transactions counts its own bytes alone
(record lengths, not the padding between records). Full-page images are left
out: the first change of a page after a checkpoint carries one, so their
number follows when the server last checkpointed (sooner on a server other
suites are writing to), not what the statements write. A count with them
varied by a fifth between runs of one test (a claim: 437 and 556 bytes).
"""

from __future__ import annotations

import uuid

import psycopg


class OwnWal:
    """Counts the WAL of the transactions :meth:`mark` is called in, from now on."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        # A temporary slot of this session keeps the server from removing the
        # WAL from here on, which bytes() reads back: on a busy server a
        # checkpoint recycled it first (tests/test_wal_support.py). One per
        # session (a server has few), dropped when the connection closes.
        conn.execute("SELECT pg_create_physical_replication_slot(%s, true, true)"
                     " WHERE NOT EXISTS (SELECT FROM pg_replication_slots"
                     "                   WHERE temporary AND active_pid = pg_backend_pid())",
                     (f"conveyor_test_wal_{uuid.uuid4().hex}",))
        self._start = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
        conn.commit()
        self._xids: list[int] = []

    def mark(self) -> None:
        """The transaction open on the connection is one of the counted (call before COMMIT)."""
        row = self._conn.execute("SELECT pg_current_xact_id()::text::bigint % 4294967296")
        self._xids.append(row.fetchone()[0])

    @property
    def transactions(self) -> int:
        return len(self._xids)

    def bytes(self) -> int:
        """WAL bytes the marked transactions wrote since this counter was made, full-page
        images left out."""
        conn = self._conn
        # Flushed: the marked transactions committed, so their records are in it.
        end = conn.execute("SELECT pg_current_wal_flush_lsn()").fetchone()[0]
        row = conn.execute(
            "SELECT sum(record_length - fpi_length) FROM pg_get_wal_records_info(%s, %s)"
            " WHERE xid::text::bigint = ANY(%s)", (self._start, end, self._xids)).fetchone()
        conn.commit()
        return int(row[0] or 0)
