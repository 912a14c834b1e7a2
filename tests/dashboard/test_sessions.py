"""What the dashboard's own connections are set up with."""

from __future__ import annotations

import psycopg

from conveyor.dashboard import DashboardConfig
from conveyor.dashboard.data import Database


async def test_no_page_waits_for_a_query_to_be_compiled(shared_db_url: str) -> None:
    # Past jit_above_cost (100,000) a server built with JIT compiles a
    # statement before it runs it; the listings' statements at a few million
    # events pass it (34 ms of JIT in one page statement at 5 million, on the
    # machine's PostgreSQL 15: benchmarks/results/20261201-dashboard-scale.json).
    with psycopg.connect(shared_db_url) as plain:
        # Whether a session at the server's settings may compile at all.
        row = plain.execute("SELECT pg_jit_available()").fetchone()
    server_compiles = bool(row and row[0])
    database = Database(shared_db_url, DashboardConfig())
    try:
        async with database.connection() as conn, conn.transaction():
            setting = await (await conn.execute("SELECT current_setting('jit')")).fetchone()
            # As if every statement were past the threshold.
            await conn.execute("SET LOCAL jit_above_cost = 0")
            cur = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) "
                                     "SELECT count(*) FROM generate_series(1, 1000)")
            plan = await cur.fetchone()
        assert setting == ("off",)
        assert plan is not None
        if server_compiles:
            assert "JIT" not in plan[0][0], f"compiled: {plan[0][0]['JIT']}"
    finally:
        await database.close()
