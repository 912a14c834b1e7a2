"""``conveyor.complete``: a handler's own writes and its event's success commit together.

Each handler here writes a row of ``public.business`` and completes its event
on the same connection, in one transaction: the row exists exactly when the
event succeeded. A lease taken meanwhile makes ``complete`` raise
LeaseLostError inside that transaction, which rolls back the row too.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest

import conveyor
from conveyor import Event, InvalidStateError, LeaseLostError, Producer, Router, Worker
from conveyor.testing import work_event
from waiting import wait_until
from worker_support import enqueue, event_row, fast_config, query, running

BUSINESS_DDL = "CREATE TABLE IF NOT EXISTS public.business (event_id bigint NOT NULL, note text)"
PROMPT = 10.0


@pytest.fixture
def business(db: str) -> Iterator[str]:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(BUSINESS_DDL)
        conn.execute("TRUNCATE public.business")
    yield db


async def test_an_async_handler_completes_its_event_with_its_own_write(business: str) -> None:
    db = business

    async def ship(event: Event) -> None:
        async with await psycopg.AsyncConnection.connect(db) as conn, conn.transaction():
            await conn.execute("INSERT INTO public.business VALUES (%s, 'shipped')", (event.id,))
            await conveyor.complete_async(conn, event, result={"shipped": True})

    router = Router()
    router.add("order.ship", ship)
    worker = Worker(db, router, fast_config())
    async with running(worker):
        event_id = await enqueue(db, "order.ship")

        async def succeeded() -> bool:
            return worker.stats.succeeded == 1
        await wait_until(succeeded, timeout=PROMPT, what="the event to be acknowledged")
    row = await event_row(db, event_id)
    assert (row["state"], row["attempts"], row["owner"], row["result"]) == (
        "succeeded", 1, None, {"shipped": True})
    assert await query(db, "SELECT event_id, note FROM public.business") == [
        {"event_id": event_id, "note": "shipped"}]
    # Its own acknowledgement found the row finished: no loss, nothing to warn of.
    assert (worker.completer.stale, worker.stats.lost, worker.holder.completed) == (0, 0, set())


async def test_a_handler_that_works_on_after_completing_keeps_running(business: str) -> None:
    # Its heartbeats (every 0.3 s) find the lease gone: the handler ended it
    # itself, and that is neither a loss nor a reason to cancel the handler.
    db = business
    finished = asyncio.Event()

    async def ship(event: Event) -> None:
        async with await psycopg.AsyncConnection.connect(db) as conn, conn.transaction():
            await conn.execute("INSERT INTO public.business VALUES (%s, 'shipped')", (event.id,))
            await conveyor.complete_async(conn, event)
        await asyncio.sleep(1.5)          # more work after the commit, past five heartbeats
        finished.set()

    router = Router()
    router.add("order.ship", ship)
    worker = Worker(db, router, fast_config())
    async with running(worker):
        event_id = await enqueue(db, "order.ship")
        await asyncio.wait_for(finished.wait(), PROMPT)

        async def settled() -> bool:
            return worker.stats.succeeded == 1
        await wait_until(settled, timeout=PROMPT, what="the event to be settled")
    assert (worker.stats.lost, worker.stats.cancelled, worker.completer.stale) == (0, 0, 0)
    assert (await event_row(db, event_id))["state"] == "succeeded"


async def test_a_lease_lost_before_complete_rolls_the_handlers_write_back(business: str) -> None:
    db = business
    started, go = threading.Event(), threading.Event()
    raised: list[BaseException] = []

    def ship(event: Event) -> None:
        started.set()
        go.wait(PROMPT)
        with psycopg.connect(db) as conn:
            try:
                with conn.transaction():
                    conn.execute("INSERT INTO public.business VALUES (%s, 'shipped')",
                                 (event.id,))
                    conveyor.complete(conn, event)
            except LeaseLostError as exc:
                raised.append(exc)
                raise

    router = Router()
    router.add("order.ship", ship, blocking=True)
    # Heartbeats far apart: the worker does not notice the stolen lease itself.
    worker = Worker(db, router, fast_config(heartbeat_interval=30.0, lease_ttl=90.0))
    async with running(worker):
        event_id = await enqueue(db, "order.ship", max_attempts=1)
        assert await asyncio.to_thread(started.wait, PROMPT)
        # Another worker's rescue and claim, as the table sees them.
        await query(db, "UPDATE conveyor.events SET lease_owner = %s WHERE id = %s",
                    (str(uuid.uuid4()), event_id))
        go.set()

        async def refused() -> bool:
            return bool(raised)
        await wait_until(refused, timeout=PROMPT, what="complete() to refuse")
    assert f"event {event_id} (attempt 1) is no longer this worker's" in str(raised[0])
    assert await query(db, "SELECT * FROM public.business") == []
    assert (await event_row(db, event_id))["state"] == "running"   # the other owner's now


def test_work_event_runs_a_handler_that_completes_its_own_event(business: str) -> None:
    router = Router()

    def ship(event: Event) -> None:
        conn.execute("INSERT INTO public.business VALUES (%s, 'shipped')", (event.id,))
        conveyor.complete(conn, event)

    router.add("order.ship", ship, blocking=True)
    with psycopg.connect(business) as conn:
        event_id = Producer().enqueue(conn, "order.ship")
        worked = work_event(conn, router)
        assert worked is not None and worked.record.state.value == "succeeded"
        assert conn.execute("SELECT event_id FROM public.business").fetchall() == [(event_id,)]
        conn.rollback()


def test_complete_refuses_an_event_no_worker_handed_over(business: str) -> None:
    with psycopg.connect(business) as conn:
        event = Event(id=7, topic="order.ship", payload_text="{}")
        with pytest.raises(InvalidStateError, match="event 7 was not handed to this handler"):
            conveyor.complete(conn, event)


@pytest.mark.parametrize(("limit", "refused"), [(200 * 1024, False), (1024, True)])
def test_complete_keeps_a_result_within_the_routes_own_limit(
        business: str, limit: int, refused: bool) -> None:
    # 100 KiB: over the 64 KiB default, within a route's 200 KiB, over a route's 1 KiB.
    router = Router()
    big = {"text": "x" * (100 * 1024)}
    outcomes: list[str] = []

    def ship(event: Event) -> None:
        try:
            conveyor.complete(conn, event, big)
            outcomes.append("kept")
        except conveyor.PayloadTooLargeError as exc:
            outcomes.append(str(exc))
            raise

    router.add("order.ship", ship, blocking=True, result_limit=limit)
    with psycopg.connect(business, autocommit=True) as conn:
        Producer().enqueue(conn, "order.ship")
        worked = work_event(conn, router)
    assert worked is not None
    if refused:
        assert worked.record.state.value != "succeeded" and "1024" in outcomes[0]
    else:
        assert outcomes == ["kept"] and worked.record.state.value == "succeeded"
        assert len(worked.record.result["text"]) == 100 * 1024
