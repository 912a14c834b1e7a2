"""A worker's claim walks the claim index in order, whatever the statistics say."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

from conveyor.db.named_queries import queries_for
from conveyor.worker.connection import WorkerConnections
from worker_support import fast_config

Q = queries_for("conveyor")
BACKLOG = 20_000


@pytest.mark.parametrize("history", [0, BACKLOG], ids=["empty", "all_finished"])
async def test_a_claim_after_a_burst_on_stale_statistics_reads_one_batch(
        db: str, history: int) -> None:
    # Statistics taken while no event was pending (an empty table, or one of
    # finished events), then a burst arrives before autovacuum analyzes again:
    # planned for those figures, a claim of 100 read and sorted the whole backlog.
    with psycopg.connect(db, autocommit=True) as admin:
        admin.execute("INSERT INTO conveyor.events (topic, payload, state, finished_at) "
                      "SELECT 'plan.done', '{}', 'succeeded', now() "
                      "FROM generate_series(1, %s)", (history,))
        admin.execute("ANALYZE conveyor.events")
        admin.execute("INSERT INTO conveyor.events (topic, payload) "
                      "SELECT 'plan.job', '{}' FROM generate_series(1, %s)", (BACKLOG,))
    connections = WorkerConnections(db, fast_config(), asyncio.Event())
    try:
        conn = await connections.fetch.get()
        async with conn.transaction(force_rollback=True):
            cur = await conn.execute(Q["event_claim"], {
                "all_topics": True, "topics": [], "prefixes": [], "all_tenants": True,
                "tenants": [], "limit": 100, "owner": str(uuid.uuid4()), "lease_ttl": 30})
            assert len(await cur.fetchall()) == 100
            # This transaction's own counts: rows the claim fetched through an index.
            cur = await conn.execute(
                "SELECT idx_tup_fetch FROM pg_stat_xact_user_tables "
                "WHERE relid = 'conveyor.events'::regclass")
            row = await cur.fetchone()
        assert row is not None
        # 100 claimed rows, each fetched again by its id for the UPDATE; a
        # plan that sorts the backlog fetches all 20,000 first.
        assert row[0] <= 400, f"the claim fetched {row[0]} rows for 100 events"
    finally:
        await connections.close()
