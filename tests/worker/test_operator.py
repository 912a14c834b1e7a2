"""What a running worker does when an operator acts on its events through Admin."""

from __future__ import annotations

import asyncio

import psycopg

from conveyor import AsyncAdmin, Event, Router, Worker
from waiting import wait_until
from worker_support import enqueue, event_row, fast_config, running


async def test_cancelling_a_running_event_stops_its_handler_and_it_stays_cancelled(
        db: str) -> None:
    started = asyncio.Event()
    handler_cancelled = asyncio.Event()

    async def handle(event: Event) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            handler_cancelled.set()
            raise

    router = Router()
    router.add("op.*", handle)
    worker = Worker(db, router, fast_config())
    async with running(worker):
        event_id = await enqueue(db, "op.long")
        await asyncio.wait_for(started.wait(), 20)
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            await AsyncAdmin().cancel(conn, event_id)
        # The cancel tells the worker; its heartbeat finds the lease gone.
        await asyncio.wait_for(handler_cancelled.wait(), 20)

        async def slot_freed() -> bool:
            return worker.in_flight == 0
        await wait_until(slot_freed, timeout=20, what="the cancelled handler's slot to be freed")
    row = await event_row(db, event_id)
    assert row["state"] == "cancelled" and row["attempts"] == 1
    assert row["errors"] == [] and row["lease_owner"] is None
    # An operator's cancel, not a lost lease (both counted as lost before 23).
    assert (worker.stats.cancelled, worker.stats.lost) == (1, 0)


async def test_retrying_a_failed_event_wakes_an_idle_worker(db: str) -> None:
    attempts: list[int] = []

    async def handle(event: Event) -> None:
        attempts.append(event.attempt)
        if event.attempt == 1:
            raise RuntimeError("first attempt fails for good")

    router = Router()
    router.add("op.*", handle)
    event_id = await enqueue(db, "op.flaky", max_attempts=1)
    worker = Worker(db, router, fast_config(poll_interval=30))
    async with running(worker):
        async def parked() -> bool:
            return (await event_row(db, event_id))["state"] == "failed"
        await wait_until(parked, timeout=20, what="the event to fail")
        await asyncio.sleep(0.2)
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            await AsyncAdmin().retry(conn, event_id)

        async def succeeded() -> bool:
            return (await event_row(db, event_id))["state"] == "succeeded"
        # Bounded well under the 30 s poll_interval: only a NOTIFY can wake the worker in
        # time, however loaded the machine (an idle poll would take the whole 30 s).
        took = await wait_until(succeeded, timeout=15, what="the retried event to succeed")
    assert took < 15, f"the retry waited {took:.1f}s: no NOTIFY woke the worker"
    assert attempts == [1, 2]
    row = await event_row(db, event_id)
    assert row["attempts"] == 2 and row["max_attempts"] == 2
    assert [e["attempt"] for e in row["errors"]] == [1]
