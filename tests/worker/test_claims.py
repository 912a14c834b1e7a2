"""The claim side of a worker (worker/claims.py), one claim at a time against the database."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg

from claim_support import claim_params
from conveyor import Event, Router, Worker
from conveyor.db.named_queries import queries_for
from conveyor.patterns import sql_params
from conveyor.types import CLAIM_COLUMNS
from waiting import wait_until
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
    params = claim_params(limit=5, **sql_params(["limited.*"], prefix="except_"),
                          **sql_params([], prefix="fifo_"))
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


async def test_a_claim_answered_after_its_lease_hands_its_events_back_unrun(db: str) -> None:
    # A claim whose answer comes back only after the lease it granted could have
    # run out (a network path that stalled: in the fleet simulation, another
    # worker had rescued and run the events meanwhile) must not start them.
    # Here the claim waits on a table lock for longer than the lease.
    ids = [await enqueue(db, "open.job") for _ in range(3)]
    done: list[int] = []
    config = fast_config(lease_ttl=1.0, query_timeout=30.0)
    worker = Worker(db, _router(done), config)
    try:
        await _learn_flow(worker)       # so the claim itself is what waits on the lock
        async with await psycopg.AsyncConnection.connect(db) as blocker:
            await blocker.execute("LOCK TABLE conveyor.events IN ACCESS EXCLUSIVE MODE")
            claim = asyncio.create_task(worker.claims.claim(5))
            # This database's sessions only: other tests run beside this one.
            waiting = ("SELECT count(*) AS n FROM pg_stat_activity "
                       "WHERE datname = current_database() AND wait_event_type = 'Lock'")
            await wait_until(lambda: _count_is_one(db, waiting), timeout=10,
                             what="the claim to wait on the lock")
            held_since = time.monotonic()
            await wait_until(lambda: _past(held_since, config.lease_ttl + 0.2), timeout=10,
                             what="the lease to have run out")
            await blocker.rollback()
            claimed = await claim
        assert claimed == [] and done == [] and worker.stats.handed_back == 3
        await worker.completer.flush()
        rows = await query(db, "SELECT state, attempts FROM conveyor.events ORDER BY id")
        assert [(r["state"], r["attempts"]) for r in rows] == [("pending", 0)] * 3
        again = await worker.claims.claim(5)       # on time: started as usual
        assert sorted(e.id for e in again or []) == ids
        await asyncio.gather(*worker.running.tasks())
        assert sorted(done) == ids
        await worker.completer.flush()
    finally:
        await worker.close()


async def _count_is_one(db: str, statement: str) -> bool:
    return (await query(db, statement))[0]["n"] == 1


async def _past(since: float, seconds: float) -> bool:
    return time.monotonic() - since >= seconds
