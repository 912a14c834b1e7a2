"""The claim side of a worker (worker/claims.py), one claim at a time against the database."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg

from conveyor import Event, Router, Worker
from conveyor.db.named_queries import queries_for
from conveyor.patterns import sql_params
from conveyor.types import CLAIM_COLUMNS
from worker_support import enqueue, fast_config, query

Q = queries_for("conveyor")


def _router(done: list[int]) -> Router:
    async def handler(event: Event) -> None:
        done.append(event.id)

    router = Router()
    router.add("limited.*", handler, max_running=1)
    router.add("open.*", handler)
    return router


async def _learn_flow(worker: Worker) -> None:
    conn = await worker.connections.fetch.get()
    await worker.flow.declare(conn)
    await worker.flow.refresh(conn)


async def test_the_flow_claim_names_its_moved_count_after_the_event_columns(db: str) -> None:
    params = {"all_topics": True, "topics": [], "prefixes": [], "all_tenants": True,
              "tenants": [], "owner": str(uuid.uuid4()), "lease_ttl": 30, "limit": 5,
              **sql_params(["limited.*"], prefix="except_"), **sql_params([], prefix="fifo_")}
    async with await psycopg.AsyncConnection.connect(db) as conn:
        cur = await conn.execute(Q["event_claim_flow"], params)
        assert cur.description is not None
        assert tuple(c.name for c in cur.description) == (*CLAIM_COLUMNS, "moved")
        await conn.rollback()


async def test_a_plain_claim_moves_limited_events_and_claims_the_rest(db: str) -> None:
    await query(db, "TRUNCATE conveyor.flow_limits")
    limited = [await enqueue(db, "limited.job") for _ in range(2)]
    plain = await enqueue(db, "open.job")
    done: list[int] = []
    worker = Worker(db, _router(done), fast_config())
    try:
        await _learn_flow(worker)
        claimed = await worker.claims.claim(5)
        assert [e.id for e in claimed or []] == [plain]
        assert worker.claims.moved == 2
        assert worker.flow.sorted == 2
        await asyncio.gather(*worker.running.tasks())
        assert done == [plain]
        rows = await query(db, "SELECT id, limited, state FROM conveyor.events ORDER BY id")
        assert [(r["id"], r["limited"], r["state"]) for r in rows] == [
            (limited[0], True, "pending"), (limited[1], True, "pending"),
            (plain, False, "running")]
        await worker.completer.flush()
    finally:
        await worker.close()


async def test_a_claim_that_only_moved_events_claims_none_and_says_how_many(db: str) -> None:
    await query(db, "TRUNCATE conveyor.flow_limits")
    for _ in range(3):
        await enqueue(db, "limited.job")
    worker = Worker(db, _router([]), fast_config())
    try:
        await _learn_flow(worker)
        assert await worker.claims.claim(5) == []
        assert worker.claims.moved == 3
        # Nothing left in the open lane: the next claim moves none.
        assert await worker.claims.claim(5) == []
        assert worker.claims.moved == 0
        assert len(worker.running) == 0
    finally:
        await worker.close()


async def test_the_pause_aware_claim_is_chosen_only_while_a_pause_may_hold(db: str) -> None:
    await query(db, "TRUNCATE conveyor.flow_limits")
    worker = Worker(db, _router([]), fast_config())
    try:
        chosen: dict[str, Any] = {}
        worker.pauses.any = False
        assert worker.claims._statement(chosen) == (Q["event_claim"], False)
        worker.pauses.any = True
        assert worker.claims._statement(chosen) == (Q["event_claim_unpaused"], False)
        await _learn_flow(worker)
        assert worker.claims._statement(chosen) == (Q["event_claim_flow_unpaused"], True)
        assert chosen["except_prefixes"] == ["limited.%"]
        worker.pauses.any = False
        assert worker.claims._statement(chosen) == (Q["event_claim_flow"], True)
    finally:
        await worker.close()
