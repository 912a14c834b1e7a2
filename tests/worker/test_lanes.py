"""The aside lane (0018): events no live worker claims, or that a pause holds, leave the
plain claim's way, and come back when a worker for them starts or the pause is lifted."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg

from claim_support import claim_params
from conveyor import AsyncAdmin, Event, NewEvent, Router, Worker
from conveyor.db.named_queries import queries_for
from waiting import wait_until
from worker_support import enqueue, enqueue_many, fast_config, query, running, wait_all_in

Q = queries_for("conveyor")


def _route(router: Router, pattern: str, done: list[int]) -> None:
    """A no-op route that records the ids it ran."""
    def handle(event: Event) -> None:
        done.append(event.id)
    router.add(pattern, handle, blocking=False)


async def _lanes(url: str) -> dict[Any, int]:
    """Pending events per lane: False open, True limited, None aside."""
    rows = await query(url, "SELECT limited, count(*) AS n FROM conveyor.events"
                            " WHERE state = 'pending' GROUP BY 1")
    return {r["limited"]: r["n"] for r in rows}


async def _aside(url: str) -> int:
    return (await _lanes(url)).get(None, 0)


def _index_rows(node: dict[str, Any]) -> int:
    """Live rows a plan's walks of the claim index read: those returned and those filtered
    out (the claimed rows found again by id, through the primary key, are not a walk)."""
    own = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0) \
        if node["Node Type"] in ("Index Scan", "Index Only Scan") \
        and node.get("Index Name") == "events_claim_idx" else 0
    return own + sum(_index_rows(child) for child in node.get("Plans", []))


async def _claim_rows_read(url: str, topic: str) -> int:
    """Index entries the plain claim of ``topic`` reads, by EXPLAIN ANALYZE (rolled back)."""
    params = claim_params([topic], limit=10)
    async with await psycopg.AsyncConnection.connect(url) as conn:
        # The claim's plan on a busy table: an index scan in claim order (a
        # bitmap scan on this small one would return the moved rows' dead
        # entries until a vacuum).
        await conn.execute("SET LOCAL enable_bitmapscan = off")
        cur = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + Q["event_claim"], params)
        row = await cur.fetchone()
        await conn.rollback()
    assert row is not None
    return _index_rows(row[0][0]["Plan"])


async def test_the_plain_claim_no_longer_reads_the_events_no_worker_handles(db: str) -> None:
    # 3,000 due events of a topic no worker handles, ahead in claim order.
    await enqueue_many(db, [NewEvent(topic="orphan.job", payload=n) for n in range(3000)])
    await enqueue_many(db, [NewEvent(topic="handled.job", payload=n) for n in range(5)])
    router = Router()
    _route(router, "handled.job", [])
    worker = Worker(db, router, fast_config())
    try:
        await worker.maintenance.run_once()       # registers, then one lanes pass
    finally:
        await worker.close()
    # The claim of handled.job reads its five entries (and a sixth that ends
    # the range at most), not the 3,000 before them.
    assert await _claim_rows_read(db, "handled.job") <= 6
    assert await _lanes(db) == {None: 3000, False: 5}


async def test_an_unhandled_topics_event_is_claimed_promptly_once_its_worker_starts(
        db: str) -> None:
    done: dict[str, list[int]] = {"a.job": [], "b.job": []}
    routers = {}
    for topic in done:
        router = Router()
        _route(router, topic, done[topic])
        routers[topic] = router
    # retention=0: the brought-back event is deleted once done, as any other.
    a = Worker(db, routers["a.job"], fast_config(retention=0))
    async with running(a):
        b_id = await enqueue(db, "b.job", {"n": 1})
        await wait_until(lambda: _is_aside(db, b_id), timeout=10, what="b.job set aside")
        a_id = await enqueue(db, "a.job", {"n": 2})
        await wait_until(lambda: _gone(db, a_id), timeout=10, what="a.job done and deleted")
        b = Worker(db, routers["b.job"], fast_config(retention=0))
        started = time.monotonic()
        async with running(b):
            # Well within RETURN_EVERY (30 s): brought back by b's start.
            await wait_until(lambda: _gone(db, b_id), timeout=5, what="b.job claimed")
            took = time.monotonic() - started
    assert done == {"a.job": [a_id], "b.job": [b_id]}
    assert took < 5
    assert b.lanes.brought_back_total == 1


async def _is_aside(url: str, event_id: int) -> bool:
    rows = await query(url, "SELECT limited IS NULL AS aside FROM conveyor.events WHERE id = %s",
                       (event_id,))
    return bool(rows and rows[0]["aside"])


async def _gone(url: str, event_id: int) -> bool:
    return not await query(url, "SELECT 1 FROM conveyor.events WHERE id = %s", (event_id,))


async def test_a_paused_topics_events_are_set_aside_and_come_back_when_resumed(db: str) -> None:
    done: list[int] = []
    router = Router()
    _route(router, "p.*", done)
    async with await psycopg.AsyncConnection.connect(db) as conn:
        await AsyncAdmin().pause(conn, "p.held")
        await conn.commit()
    held = await enqueue_many(db, [NewEvent(topic="p.held", payload=n) for n in range(50)])
    free = await enqueue_many(db, [NewEvent(topic="p.free", payload=n) for n in range(5)])
    async with running(Worker(db, router, fast_config())):
        await wait_until(lambda: _n_aside(db, 50), timeout=10, what="50 held events aside")
        await wait_until(lambda: _all_done(done, free), timeout=10, what="p.free done")
        assert await _claim_rows_read(db, "p.held") <= 1
        async with await psycopg.AsyncConnection.connect(db) as conn:
            assert await AsyncAdmin().resume(conn, "p.held")
            await conn.commit()
        await wait_all_in(db, {"succeeded"}, timeout=10)
    assert sorted(done) == sorted(held + free)


async def test_a_pause_lifted_in_sql_brings_the_events_back_to_a_poll_only_worker(
        db: str) -> None:
    done: list[int] = []
    router = Router()
    _route(router, "q.*", done)
    await query(db, "INSERT INTO conveyor.pauses (pattern) VALUES ('q.held'), ('q.other')")
    held = await enqueue_many(db, [NewEvent(topic="q.held", payload=n) for n in range(20)])
    async with running(Worker(db, router, fast_config(listen=False))):
        await wait_until(lambda: _n_aside(db, 20), timeout=10, what="20 held events aside")
        # One pause of two lifted, without a notification: the pause set changed.
        await query(db, "DELETE FROM conveyor.pauses WHERE pattern = 'q.held'")
        await wait_until(lambda: _all_done(done, held), timeout=5, what="q.held done")


async def _n_aside(url: str, n: int) -> bool:
    return await _aside(url) == n


async def _all_done(done: list[int], ids: list[int]) -> bool:
    return set(ids) <= set(done)


async def test_no_event_is_stranded_when_a_topics_worker_stops_and_another_starts(
        db: str) -> None:
    done: list[int] = []

    def router(topic: str) -> Router:
        r = Router()
        _route(r, topic, done)
        return r

    async with running(Worker(db, router("other.job"), fast_config())):
        async with running(Worker(db, router("x.job"), fast_config())):
            first = await enqueue(db, "x.job")
            await wait_until(lambda: _all_done(done, [first]), timeout=10, what="first x.job")
        # x.job's worker stopped (unregistered): its events go aside.
        later = await enqueue_many(db, [NewEvent(topic="x.job", payload=n) for n in range(30)])
        await wait_until(lambda: _n_aside(db, 30), timeout=10, what="30 x.job events aside")
        async with running(Worker(db, router("x.*"), fast_config())):
            await wait_until(lambda: _all_done(done, later), timeout=5, what="x.job done")
    assert await _lanes(db) == {}


async def test_a_rescued_event_is_claimed_and_pruning_leaves_the_aside_lane_alone(
        db: str) -> None:
    done: list[int] = []
    router = Router()
    _route(router, "r.job", done)
    # An event whose worker died mid-run, and one of a topic no worker handles.
    lost = await enqueue(db, "r.job")
    await query(db, "UPDATE conveyor.events SET state = 'running', attempts = 1,"
                    " lease_owner = gen_random_uuid(), lease_expires_at = now() - interval '1 s'"
                    " WHERE id = %s", (lost,))
    orphan = await enqueue(db, "nobody.job")
    async with running(Worker(db, router, fast_config(retention=0))):
        await wait_until(lambda: _all_done(done, [lost]), timeout=10, what="rescued event")
        await wait_until(lambda: _is_aside(db, orphan), timeout=10, what="orphan aside")
    assert await _lanes(db) == {None: 1}
    rows = await query(db, "SELECT id, state FROM conveyor.events")
    assert rows == [{"id": orphan, "state": "pending"}]


async def test_a_worker_that_claims_once_brings_its_topics_back_first(db: str) -> None:
    done: list[int] = []
    router = Router()
    _route(router, "once.job", done)
    ids = await enqueue_many(db, [NewEvent(topic="once.job", payload=n) for n in range(3)])
    await query(db, "UPDATE conveyor.events SET limited = NULL")
    worker = Worker(db, router, fast_config())
    try:
        assert await worker.run_once() == 3
    finally:
        await worker.close()
    assert sorted(done) == ids


async def test_set_aside_keeps_events_a_live_worker_or_the_worker_itself_handles(
        db: str) -> None:
    await enqueue_many(db, [NewEvent(topic=t, payload=1, tenant=tenant)
                            for t, tenant in [("own.job", None), ("peer.job", "acme"),
                                              ("peer.job", "other"), ("gone.job", None)]])
    # A live peer that claims peer.job for tenant acme only, and a dead one for gone.job.
    await query(db, "INSERT INTO conveyor.workers (id, name, host, pid, topics, tenants,"
                    " concurrency, heartbeat_at) VALUES"
                    " (gen_random_uuid(), 'peer', 'h', 1, '{peer.*}', '{acme}', 1, now()),"
                    " (gen_random_uuid(), 'dead', 'h', 2, '{gone.job}', NULL, 1,"
                    "  now() - interval '1 hour')")
    router = Router()
    _route(router, "own.job", [])
    worker = Worker(db, router, fast_config())
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        moved = await worker.lanes.set_aside(conn)
    rows = await query(db, "SELECT topic, tenant, limited FROM conveyor.events ORDER BY id")
    assert moved == 2
    assert [(r["topic"], r["tenant"], r["limited"]) for r in rows] == [
        ("own.job", None, False), ("peer.job", "acme", False),
        ("peer.job", "other", None), ("gone.job", None, None)]
    await worker.close()


async def test_a_set_aside_waits_for_no_bring_back_and_skips_while_one_runs(db: str) -> None:
    router = Router()
    _route(router, "own.job", [])
    worker = Worker(db, router, fast_config())
    await enqueue(db, "nobody.job")
    async with await psycopg.AsyncConnection.connect(db) as holder, \
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        await holder.execute(Q["lane_lock"], {"key": "conveyor lanes conveyor"})
        started = time.monotonic()
        assert await asyncio.wait_for(worker.lanes.set_aside(conn), 5) == 0
        assert time.monotonic() - started < 2
        await holder.rollback()
        assert await worker.lanes.set_aside(conn) == 1
    await worker.close()
    assert await _lanes(db) == {None: 1}


async def test_a_pass_brings_back_a_bounded_share_and_the_next_goes_on(
        db: str, monkeypatch: Any) -> None:
    import conveyor.worker.lanes as lanes

    monkeypatch.setattr(lanes, "RETURN_BATCH", 2)
    monkeypatch.setattr(lanes, "RETURN_BATCHES", 3)
    await enqueue_many(db, [NewEvent(topic="own.job", payload=n) for n in range(7)])
    await query(db, "UPDATE conveyor.events SET limited = NULL")
    router = Router()
    _route(router, "own.job", [])
    worker = Worker(db, router, fast_config())
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        await worker.lanes.run(conn)
        assert await _lanes(db) == {None: 1, False: 6}
        assert worker.lanes.due_at() <= time.monotonic()      # the next pass goes on
        await worker.lanes.run(conn)
    await worker.close()
    assert await _lanes(db) == {False: 7}
    assert worker.lanes.brought_back_total == 7
