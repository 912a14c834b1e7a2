"""Who goes next under flow control: tenants in turn (fair_by), a key's head (fifo_by).

Real workers in this process, one slot at a time: ``max_running=1``, or a
rate limit whose tokens come one by one, so every claim takes one event and
fairness cannot rest on claims that happen to take several.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import psycopg
import pytest

from conveyor import Event, NewEvent, Router, Worker
from conveyor.db.named_queries import queries_for
from conveyor.worker import lanes as lanes_module
from conveyor.worker.flow import FlowControl
from conveyor.worker.lanes import Lanes
from waiting import wait_until
from worker_support import enqueue, enqueue_many, event_row, fast_config, query, running


async def _big_starts_before_small(db: str, backlog: int, handler_s: float, workers: int,
                                   **limits: Any) -> tuple[int, list[str | None]]:
    """Tenant `big` has ``backlog`` events; once they are being worked, tenant `small`
    enqueues one. Returns how many of big's events started between that enqueue and
    small's start, and the tenants in start order."""
    starts: list[str | None] = []

    async def export(event: Event) -> None:
        starts.append(event.tenant)
        await asyncio.sleep(handler_s)

    router = Router()
    router.add("export.run", export, fair_by="tenant", **limits)
    await enqueue_many(db, [NewEvent(topic="export.run", payload=n, tenant="big")
                            for n in range(backlog)])

    async def started(n: int) -> bool:
        return len(starts) >= n

    async def small_started() -> bool:
        return "small" in starts

    async with contextlib.AsyncExitStack() as stack:
        for _ in range(workers):
            await stack.enter_async_context(running(Worker(db, router, fast_config(concurrency=4))))
        await wait_until(lambda: started(limits.get("max_running", 1) + 3), timeout=20,
                         what="the big tenant's backlog being worked")
        before = len(starts)
        await enqueue(db, "export.run", "one", tenant="small")
        await wait_until(small_started, timeout=backlog * handler_s * 4 + 10,
                         what="the small tenant's event to start")
        after = starts.index("small")
    left = await query(db, "SELECT count(*) AS n FROM conveyor.events WHERE state = 'pending'")
    assert left[0]["n"] > backlog // 3, (left, starts)      # it did not wait for the backlog
    return after - before, starts


async def test_fair_by_at_max_running_1_starts_another_tenants_event_next(db: str) -> None:
    # One slot: before the round-robin cursor every claim took the oldest head,
    # big's, and small waited for the whole backlog (all 40 here).
    passed, starts = await _big_starts_before_small(db, backlog=40, handler_s=0.1, workers=2,
                                                    max_running=1)
    # The event running when small enqueued, and at most one claimed in the race
    # with small's move into the limited lane.
    assert passed <= 2, (passed, starts)


async def test_fair_by_under_a_rate_limit_starts_another_tenants_event_next(db: str) -> None:
    # Tokens come one by one (20 a second after the first second's burst), so
    # each claim takes one event.
    passed, starts = await _big_starts_before_small(db, backlog=120, handler_s=0.02, workers=2,
                                                    rate="20/s", max_running=2)
    # At most about one more of big's per slot.
    assert passed <= 4, (passed, starts)


async def test_fair_by_at_max_running_1_serves_three_tenants_round_robin(db: str) -> None:
    starts: list[str | None] = []

    async def export(event: Event) -> None:
        starts.append(event.tenant)
        await asyncio.sleep(0.01)

    router = Router()
    router.add("export.run", export, fair_by="tenant", max_running=1)
    # Each tenant's events written together, a's oldest: claim order alone
    # would run all of a's, then b's, then c's.
    await enqueue_many(db, [NewEvent(topic="export.run", payload=n, tenant=tenant)
                            for tenant in ("a", "b", "c") for n in range(6)])

    async def all_started() -> bool:
        return len(starts) == 18

    async with running(Worker(db, router, fast_config(concurrency=4))):
        await wait_until(all_started, timeout=30, what="every event started")
    for turn in range(0, 18, 3):
        assert sorted(map(str, starts[turn:turn + 3])) == ["a", "b", "c"], starts


async def test_fifo_by_a_delayed_event_does_not_hold_its_key_before_it_is_due(db: str) -> None:
    ran: list[str] = []

    async def remind(event: Event) -> None:
        ran.append(event.payload)

    router = Router()
    router.add("crm.remind", remind, fifo_by="tenant")
    reminder = await enqueue(db, "crm.remind", "in an hour", tenant="acme", delay=3600)
    await enqueue(db, "crm.remind", "now", tenant="acme")
    await enqueue(db, "crm.remind", "globex now", tenant="globex")

    async def both_ran() -> bool:
        return sorted(ran) == ["globex now", "now"]

    async with running(Worker(db, router, fast_config(concurrency=4))):
        # Before: the reminder, moved into the limited lane at once, was acme's
        # head, and "now" waited for it (an hour).
        await wait_until(both_ran, timeout=10, what="acme's and globex's due events to run")
    row = await event_row(db, reminder)
    assert (row["state"], row["attempts"]) == ("pending", 0)


async def test_fifo_by_a_higher_priority_event_waits_for_its_keys_running_one(db: str) -> None:
    release = asyncio.Event()
    spans: dict[str, list[float]] = {}
    loop = asyncio.get_running_loop()

    async def post(event: Event) -> None:
        spans[event.payload] = [loop.time()]
        if event.payload == "long":
            await release.wait()
        spans[event.payload].append(loop.time())

    router = Router()
    router.add("ledger.post", post, fifo_by="tenant")
    await enqueue(db, "ledger.post", "long", tenant="acme")

    async def started(name: str) -> bool:
        return name in spans

    async def ended(name: str) -> bool:
        return len(spans.get(name, ())) == 2

    async with running(Worker(db, router, fast_config(concurrency=4))):
        await wait_until(lambda: started("long"), timeout=10, what="acme's long event to start")
        # In one transaction: any sort or claim that moves globex's event moves
        # the urgent one too (it is ahead of it in claim order).
        await enqueue_many(db, [
            NewEvent(topic="ledger.post", payload="urgent", tenant="acme", priority=10),
            NewEvent(topic="ledger.post", payload="globex", tenant="globex")])
        await wait_until(lambda: ended("globex"), timeout=10, what="globex's event to run")
        # Claims have run with the urgent event in the limited lane: it waits.
        assert "urgent" not in spans, spans
        release.set()
        await wait_until(lambda: ended("urgent"), timeout=10, what="the urgent event to run")
    assert spans["urgent"][0] >= spans["long"][1], spans


# ---------------------------------------------------------------- a key's events in order,
# while another worker's statement holds one of them

def _fifo_router() -> Router:
    router = Router()
    router.add("ledger.post", _no_op, fifo_by="tenant")
    return router


async def _no_op(event: Event) -> None:
    return None


async def _two_flows(db: str, router: Router) -> tuple[FlowControl, FlowControl, dict[str, Any]]:
    """Worker A's and worker B's view of the limits, B's claim parameters."""
    q = queries_for("conveyor")
    a, b = FlowControl(q, router), FlowControl(q, router)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        await a.declare(conn)
        await a.refresh(conn)
        await b.refresh(conn)
    params = {**router.claim_filter(), "all_tenants": True, "tenants": [],
              "owner": str(uuid.uuid4()), "lease_ttl": 30}
    return a, b, params


async def _claimed_ids(flow: FlowControl, conn: psycopg.AsyncConnection[Any],
                       params: dict[str, Any]) -> list[int]:
    flow.poke()
    return [row[0] for row in await flow.claim(conn, 10, params)]


async def _first_claim(flow: FlowControl, conn: psycopg.AsyncConnection[Any],
                       params: dict[str, Any]) -> list[int]:
    """What ``flow`` claims once it claims anything (its sort may wait a moment)."""
    claimed: list[int] = []

    async def some() -> bool:
        claimed.extend(await _claimed_ids(flow, conn, params))
        return bool(claimed)

    await wait_until(some, timeout=10, what="a claim of the key's first event")
    return claimed


async def test_fifo_by_a_plain_claim_holding_a_keys_first_event_does_not_let_its_second_start(
        db: str) -> None:
    router = _fifo_router()
    first = await enqueue(db, "ledger.post", "first", tenant="acme")
    second = await enqueue(db, "ledger.post", "second", tenant="acme")
    a, b, params = await _two_flows(db, router)
    q = queries_for("conveyor")
    # Worker A's plain claim of one event, not committed yet; meanwhile worker B
    # sorts and claims. Before: A's claim locked the first event to move it, B's
    # sort skipped it and moved the second, which B then claimed as the key's
    # head (seen as the per-key relay publishing out of order under load).
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn_a, \
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn_b, \
            conn_a.transaction():
        await conn_a.execute(q["event_claim_flow"], {**params, "limit": 1, **a.plain_params()})
        assert await _claimed_ids(b, conn_b, params) == [first]
    row = await event_row(db, second)
    assert (row["state"], row["attempts"]) == ("pending", 0)


async def test_fifo_by_two_sorts_at_once_do_not_split_a_keys_events(db: str) -> None:
    router = _fifo_router()
    first = await enqueue(db, "ledger.post", "first", tenant="acme")
    await enqueue(db, "ledger.post", "second", tenant="acme")
    a, b, params = await _two_flows(db, router)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn_a, \
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn_b:
        # Worker A sorts a window of one event and has not committed; worker B
        # sorts and claims meanwhile. Before: B's sort skipped the first event
        # (A held it) and moved the second, and B claimed it.
        async with conn_a.transaction():
            a._sort_params["window"] = 1
            assert await a.sort(conn_a) == 1
            assert await _claimed_ids(b, conn_b, params) == []
        claimed = await _first_claim(b, conn_b, params)
    assert claimed == [first]


async def test_fifo_by_two_bring_backs_at_once_do_not_split_a_keys_events(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    router = _fifo_router()
    first = await enqueue(db, "ledger.post", "first", tenant="acme")
    await enqueue(db, "ledger.post", "second", tenant="acme")
    await query(db, "UPDATE conveyor.events SET limited = NULL")     # both set aside
    _a, b, params = await _two_flows(db, router)
    monkeypatch.setattr(lanes_module, "RETURN_BATCH", 1)
    claim_filter = {k: v for k, v in params.items() if k not in ("owner", "lease_ttl")}
    q = queries_for("conveyor")
    lanes_a, lanes_b = (Lanes(q, claim_filter, heartbeat_interval=1.0, on_back=lambda: None)
                        for _ in range(2))
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn_a, \
            await psycopg.AsyncConnection.connect(db, autocommit=True) as conn_b:
        b_pid = conn_b.info.backend_pid
        # Worker A brings back one event (the first) and has not committed; worker
        # B brings back meanwhile. Before: B skipped the first (A held it), brought
        # back the second, sorted it and claimed it as the key's head.
        async with conn_a.transaction():
            assert await lanes_a.bring_back(conn_a, batches=1) == 1
            b_back = asyncio.create_task(lanes_b.bring_back(conn_b, batches=1))

            async def b_done_or_waiting() -> bool:
                rows = await query(db, "SELECT wait_event_type FROM pg_stat_activity"
                                       " WHERE pid = %s", (b_pid,))
                return b_back.done() or rows[0]["wait_event_type"] == "Lock"

            await wait_until(b_done_or_waiting, timeout=10, what="B's bring-back to end or wait")
            if b_back.done():
                assert await _claimed_ids(b, conn_b, params) == [], "B claimed the second event"
        assert await b_back == 1
        claimed = await _first_claim(b, conn_b, params)
    assert claimed == [first]
