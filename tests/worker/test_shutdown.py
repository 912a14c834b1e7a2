"""Graceful stop: finish what can finish, hand the rest back unspent; the registry row."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from conveyor import Event, Router, Worker
from waiting import wait_until
from worker_support import enqueue, event_row, fast_config, query, running


async def test_stop_acks_handlers_that_finish_and_hands_back_the_rest(db: str) -> None:
    release_thread = threading.Event()
    started: set[str] = set()
    all_started = asyncio.Event()
    stop_requested = asyncio.Event()

    def note(topic: str) -> None:
        started.add(topic)
        if len(started) == 4:
            all_started.set()

    async def quick(event: Event) -> None:
        note(event.topic)
        await asyncio.wait_for(stop_requested.wait(), 10)
        await asyncio.sleep(0.1)          # finishes well within shutdown_timeout, even loaded

    async def stuck(event: Event) -> None:
        note(event.topic)
        await asyncio.sleep(30)

    def stuck_in_thread(event: Event) -> None:
        loop.call_soon_threadsafe(note, event.topic)
        release_thread.wait(10)

    loop = asyncio.get_running_loop()
    router = Router()
    router.add("quick.*", quick)
    router.add("stuck.async", stuck)
    router.add("stuck.thread", stuck_in_thread)
    ids = {t: await enqueue(db, t, max_attempts=5)
           for t in ("quick.a", "quick.b", "stuck.async", "stuck.thread")}
    # One of them had spent two attempts before: the hand-back must restore exactly that.
    await query(db, "UPDATE conveyor.events SET attempts = 2 WHERE id = %s",
                (ids["stuck.async"],))
    # The grace leaves the quick handlers room on a loaded machine; the bound on `took`
    # below stays far under the 10 s the thread handler would hold run() if awaited.
    worker = Worker(db, router, fast_config(concurrency=4, shutdown_timeout=2.0))
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(all_started.wait(), 20)
        stopped_at = time.monotonic()
        worker.request_stop()
        stop_requested.set()
        await asyncio.wait_for(task, 20)
        took = time.monotonic() - stopped_at
    finally:
        release_thread.set()
        if not task.done():
            task.cancel()
        await worker.close()
    assert 1.9 <= took < 8.0, f"run() returned {took:.2f}s after request_stop"
    for topic in ("quick.a", "quick.b"):
        row = await event_row(db, ids[topic])
        assert row["state"] == "succeeded" and row["attempts"] == 1
    expected_attempts = {"stuck.async": 2, "stuck.thread": 0}
    for topic, attempts in expected_attempts.items():
        row = await event_row(db, ids[topic])
        assert row["state"] == "pending", topic
        assert row["attempts"] == attempts, topic
        assert row["lease_owner"] is None and row["lease_expires_at"] is None
        assert row["errors"] == [] and row["finished_at"] is None
        due = await query(db, "SELECT run_at <= now() AS due FROM conveyor.events "
                                    "WHERE id = %s", (row["id"],))
        assert due[0]["due"], f"{topic} was not handed back due now"
    assert worker.stats.succeeded == 2 and worker.stats.handed_back == 2


async def test_stop_while_idle_returns_promptly_and_claims_nothing_more(db: str) -> None:
    ran: list[int] = []

    async def handle(event: Event) -> None:
        ran.append(event.id)

    router = Router()
    router.add("idle.*", handle)
    worker = Worker(db, router, fast_config(poll_interval=30))
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.started.wait(), 20)
        await asyncio.sleep(0.2)
        stopped_at = time.monotonic()
        worker.request_stop()
        await asyncio.wait_for(task, 20)
        # Far under the 30 s poll_interval: the stop woke the idle wait, however loaded.
        assert time.monotonic() - stopped_at < 10.0
    finally:
        if not task.done():
            task.cancel()
        await worker.close()
    event_id = await enqueue(db, "idle.after")
    await asyncio.sleep(0.2)
    assert ran == []
    assert (await event_row(db, event_id))["state"] == "pending"


async def test_worker_is_registered_while_running_and_removed_after_stop(db: str) -> None:
    router = Router()
    router.add("reg.*", lambda event: None)
    router.add("other.topic", lambda event: None)
    worker = Worker(db, router, fast_config(name="reg-test", concurrency=7))

    async def registry() -> list[dict[str, object]]:
        return await query(db, "SELECT id::text AS id, name, topics, concurrency, "
                                     "heartbeat_at FROM conveyor.workers")

    async with running(worker):
        rows = await registry()
        assert len(rows) == 1
        first = rows[0]
        assert first["id"] == worker.id and first["name"] == "reg-test"
        assert first["topics"] == ["reg.*", "other.topic"] and first["concurrency"] == 7

        async def beat_advanced() -> bool:
            rows = await registry()
            return bool(rows) and rows[0]["heartbeat_at"] > first["heartbeat_at"]  # type: ignore[operator]
        await wait_until(beat_advanced, timeout=20, what="heartbeat_at to advance")
    assert await registry() == []


async def test_leases_stay_renewed_while_a_stopping_worker_drains(db: str) -> None:
    # A handler that needs longer than lease_ttl after the stop, but less than
    # shutdown_timeout, must finish and be acknowledged by its own worker; no
    # rescuer may take the event over in the meantime.
    started = asyncio.Event()
    calls: list[str] = []

    async def slow(event: Event) -> None:
        calls.append("draining")
        started.set()
        await asyncio.sleep(4.0)

    async def rescuer_handler(event: Event) -> None:
        calls.append("rescuer")

    router_a = Router()
    router_a.add("drain.job", slow)
    router_b = Router()
    router_b.add("drain.job", rescuer_handler)
    event_id = await enqueue(db, "drain.job", max_attempts=5)
    # The lease leaves heartbeats slack on a loaded machine; the handler still outlasts it.
    draining = Worker(db, router_a, fast_config(lease_ttl=3.0, heartbeat_interval=0.3,
                                                      shutdown_timeout=10.0))
    rescuer = Worker(db, router_b, fast_config(rescue_interval=0.2))
    task = asyncio.create_task(draining.run())
    try:
        await asyncio.wait_for(started.wait(), 20)
        async with running(rescuer):
            draining.request_stop()
            await asyncio.wait_for(task, 30)
    finally:
        if not task.done():
            task.cancel()
        await draining.close()
    row = await event_row(db, event_id)
    assert calls == ["draining"], f"the event ran again elsewhere: {calls}"
    assert row["state"] == "succeeded" and row["attempts"] == 1 and row["errors"] == []
    assert draining.stats.succeeded == 1 and draining.completer.stale == 0


async def test_stop_requested_before_run_returns_cleanly(db: str) -> None:
    router = Router()
    router.add("early.*", lambda event: None)
    worker = Worker(db, router, fast_config())
    event_id = await enqueue(db, "early.stop")
    worker.request_stop()
    try:
        await asyncio.wait_for(worker.run(), 20)
    finally:
        await worker.close()
    row = await event_row(db, event_id)
    assert row["state"] == "pending" and row["attempts"] == 0
    assert await query(db, "SELECT id FROM conveyor.workers") == []


async def test_a_handler_whose_cleanup_outlasts_the_grace_is_still_handed_back(db: str) -> None:
    # Adversary F6: a task neither done nor cancelled (its finally still awaiting)
    # was not handed back; the event stayed running with its attempt spent.
    started = asyncio.Event()
    cleanup_started = asyncio.Event()

    async def slow_cleanup(event: Event) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            cleanup_started.set()
            await asyncio.sleep(3)    # e.g. a session.close() on a slow network

    event_id = await enqueue(db, "slow.cleanup", max_attempts=5)
    worker = Worker(db, _router(slow_cleanup), fast_config(shutdown_timeout=0.3))
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(started.wait(), 20)
        worker.request_stop()
        await asyncio.wait_for(task, 20)
    finally:
        if not task.done():
            task.cancel()
        await worker.close()
    assert cleanup_started.is_set()
    row = await event_row(db, event_id)
    assert row["state"] == "pending", row
    assert row["attempts"] == 0, "the hand-back gives the attempt back"
    assert row["lease_owner"] is None
    assert worker.stats.handed_back == 1


def _router(handler: Any) -> Router:
    router = Router()
    router.add("slow.cleanup", handler)
    return router
