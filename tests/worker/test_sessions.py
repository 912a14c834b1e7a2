"""No session a worker (or its metrics refresher) opens compiles a statement with JIT.

Past jit_above_cost a server built with JIT compiles a statement before it
runs it: a prune batch or a status count on a big table, and before
PostgreSQL 18 every plan with a sort the claim sessions price out (a fifo_by
claim: 250-460 ms each on the machine's PostgreSQL 15). No statement of a
worker runs long enough for that to pay. Each session is asked to plan as if
every statement were past the threshold.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from conveyor.metrics import DatabaseGauges
from conveyor.worker.sessions import WorkerConnections
from worker_support import fast_config

PROBE = "EXPLAIN (ANALYZE, FORMAT JSON) SELECT count(*) FROM generate_series(1, 1000)"


def _server_compiles(db: str) -> bool:
    """Whether a session at the server's own settings may compile (built with JIT)."""
    with psycopg.connect(db) as plain:
        row = plain.execute("SELECT pg_jit_available()").fetchone()
    return bool(row and row[0])


async def _compiles(conn: psycopg.AsyncConnection[Any], server_compiles: bool) -> object:
    """What makes the session compile: its ``jit`` setting if on, else the JIT a plan
    past the threshold got (checked where the server has JIT at all), else None."""
    row = await (await conn.execute("SELECT current_setting('jit')")).fetchone()
    assert row is not None
    if row[0] != "off":
        return f"jit = {row[0]}"
    if not server_compiles:
        return None
    async with conn.transaction(force_rollback=True):
        await conn.execute("SET LOCAL jit_above_cost = 0")
        row = await (await conn.execute(PROBE)).fetchone()
    assert row is not None
    compiled: object = row[0][0].get("JIT")
    return compiled


async def test_no_worker_session_compiles_a_statement(db: str) -> None:
    server_compiles = _server_compiles(db)
    connections = WorkerConnections(db, fast_config(), asyncio.Event(), cron=True)
    try:
        sessions = {"fetch": connections.fetch, "ack": connections.ack,
                    "maintenance": connections.maintenance, "listen": connections.listen,
                    "flow": connections.flow_connection()}
        assert connections.cron is not None
        sessions["cron"] = connections.cron
        compiled = {role: await _compiles(await managed.get(), server_compiles)
                    for role, managed in sessions.items()}
        assert {role: jit for role, jit in compiled.items() if jit} == {}
    finally:
        await connections.close()


async def test_the_metrics_refresher_compiles_no_statement(db: str) -> None:
    server_compiles = _server_compiles(db)
    gauges = DatabaseGauges(db)
    try:
        assert await gauges.refresh_once()
        assert gauges._conn is not None
        assert await _compiles(gauges._conn, server_compiles) is None
    finally:
        await gauges.close()
