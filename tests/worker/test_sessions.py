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
import pytest

from conveyor.metrics import DatabaseGauges
from conveyor.worker.connection import WorkerConnections
from worker_support import fast_config

PROBE = "EXPLAIN (ANALYZE, FORMAT JSON) SELECT count(*) FROM generate_series(1, 1000)"


def _skip_without_jit(db: str) -> None:
    with psycopg.connect(db) as plain:
        row = plain.execute("SELECT pg_jit_available()").fetchone()
    if not (row and row[0]):
        pytest.skip("this server compiles nothing (built without JIT, or jit = off)")


async def _compiles(conn: psycopg.AsyncConnection[Any]) -> dict[str, Any] | None:
    async with conn.transaction(force_rollback=True):
        await conn.execute("SET LOCAL jit_above_cost = 0")
        row = await (await conn.execute(PROBE)).fetchone()
    assert row is not None
    compiled: dict[str, Any] | None = row[0][0].get("JIT")
    return compiled


async def test_no_worker_session_compiles_a_statement(db: str) -> None:
    _skip_without_jit(db)
    connections = WorkerConnections(db, fast_config(), asyncio.Event(), cron=True)
    try:
        sessions = {"fetch": connections.fetch, "ack": connections.ack,
                    "maintenance": connections.maintenance, "listen": connections.listen,
                    "flow": connections.flow_connection()}
        assert connections.cron is not None
        sessions["cron"] = connections.cron
        compiled = {role: await _compiles(await managed.get())
                    for role, managed in sessions.items()}
        assert {role: jit for role, jit in compiled.items() if jit} == {}
    finally:
        await connections.close()


async def test_the_metrics_refresher_compiles_no_statement(db: str) -> None:
    _skip_without_jit(db)
    gauges = DatabaseGauges(db)
    try:
        assert await gauges.refresh_once()
        assert gauges._conn is not None
        assert await _compiles(gauges._conn) is None
    finally:
        await gauges.close()
