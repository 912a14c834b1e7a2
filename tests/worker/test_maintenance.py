"""Retention pruning: old succeeded and cancelled events go, failed ones always stay."""

from __future__ import annotations

import uuid

import psycopg

from conveyor import Router, Worker
from worker_support import enqueue, fast_config, query


async def _fabricate(url: str, state: str, finished_ago: str | None) -> int:
    event_id = await enqueue(url, f"prune.{state}")
    await query(url, "UPDATE conveyor.events SET state = %s, attempts = 1, "
                     "finished_at = now() - %s::interval WHERE id = %s",
                (state, finished_ago, event_id))
    return event_id


def _worker(url: str, retention: float | None) -> Worker:
    router = Router()
    router.add("prune.*", lambda event: None)
    return Worker(url, router, fast_config(retention=retention))


async def _ids(url: str) -> set[int]:
    return {r["id"] for r in await query(url, "SELECT id FROM conveyor.events")}


async def test_prune_deletes_old_succeeded_and_cancelled_but_never_failed(db: str) -> None:
    old_ok = await _fabricate(db, "succeeded", "2 hours")
    old_cancelled = await _fabricate(db, "cancelled", "2 hours")
    old_failed = await _fabricate(db, "failed", "30 days")
    new_ok = await _fabricate(db, "succeeded", "10 minutes")
    pending = await enqueue(db, "prune.pending")
    await query(db, "UPDATE conveyor.events SET created_at = now() - interval '30 days' "
                          "WHERE id = %s", (pending,))
    worker = _worker(db, retention=3600)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        assert await worker.maintenance.prune(conn) == 2
        assert await worker.maintenance.prune(conn) == 0
    assert await _ids(db) == {old_failed, new_ok, pending}
    assert old_ok not in await _ids(db) and old_cancelled not in await _ids(db)


async def test_prune_without_retention_keeps_everything(db: str) -> None:
    ids = {await _fabricate(db, state, "400 days")
           for state in ("succeeded", "cancelled", "failed")}
    worker = _worker(db, retention=None)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        assert await worker.maintenance.prune(conn) == 0
    assert await _ids(db) == ids


async def test_prune_removes_registry_rows_of_long_silent_workers(db: str) -> None:
    silent, recent = str(uuid.uuid4()), str(uuid.uuid4())
    await query(db, "INSERT INTO conveyor.workers (id, name, host, pid, topics, "
                          "concurrency, heartbeat_at) VALUES "
                          "(%s, 'gone', 'h', 1, '{a}', 1, now() - interval '2 hours'), "
                          "(%s, 'alive', 'h', 2, '{a}', 1, now() - interval '1 minute')",
                (silent, recent))
    worker = _worker(db, retention=3600)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        await worker.maintenance.prune(conn)
    rows = await query(db, "SELECT id::text AS id FROM conveyor.workers")
    assert [r["id"] for r in rows] == [recent]
