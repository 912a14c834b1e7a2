"""Cancelling a running event: its worker hears of it at once and stops the handler.

The cancel commits a ``!leases`` notification; the worker's heartbeat runs
then, not at its interval (30 s here: a test that passed by the heartbeat
would take that long), finds the event cancelled and stops its handler: an
async one's task is cancelled, a plain one in a thread sees
``event.cancelled``. The event stays ``cancelled``: no retry, no late result.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg

from conveyor import Admin, Event, EventFilter, Router, Worker
from conveyor.notify import LEASES_NOTIFICATION
from waiting import wait_until
from worker_support import enqueue, event_row, fast_config, running

# Far longer than any wait below: only the notification can explain a prompt stop.
SLOW_HEARTBEAT = fast_config(heartbeat_interval=30.0, lease_ttl=90.0, poll_interval=0.2)
PROMPT = 10.0


def _worker(db: str, topic: str, handler: Any, **options: Any) -> Worker:
    router = Router()
    router.add(topic, handler, **options)
    return Worker(db, router, SLOW_HEARTBEAT)


def _cancel(db: str, event_id: int) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        Admin().cancel(conn, event_id)


async def test_cancelling_a_running_async_handler_cancels_its_task(db: str) -> None:
    started, stopped = asyncio.Event(), asyncio.Event()
    calls = []

    async def slow(event: Event) -> None:
        calls.append(event.id)
        started.set()
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            stopped.set()
            raise

    worker = _worker(db, "job.slow", slow)
    async with running(worker):
        event_id = await enqueue(db, "job.slow")
        await asyncio.wait_for(started.wait(), PROMPT)
        cancelled_at = time.monotonic()
        await asyncio.to_thread(_cancel, db, event_id)
        await asyncio.wait_for(stopped.wait(), PROMPT)
        assert time.monotonic() - cancelled_at < PROMPT
        assert worker.in_flight == 0
        assert worker.stats.cancelled == 1 and worker.stats.lost == 0
    row = await event_row(db, event_id)
    assert (row["state"], row["attempts"], row["owner"]) == ("cancelled", 1, None)
    assert calls == [event_id]


async def test_a_bulk_cancel_of_running_events_stops_every_handler(db: str) -> None:
    stopped: list[int] = []

    async def slow(event: Event) -> None:
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            stopped.append(event.id)
            raise

    worker = _worker(db, "job.bulk", slow)
    async with running(worker):
        ids = [await enqueue(db, "job.bulk") for _ in range(2)]

        async def in_flight() -> bool:
            return worker.in_flight == 2
        await wait_until(in_flight, timeout=PROMPT, what="both events to run")

        def cancel_running() -> list[int]:
            with psycopg.connect(db, autocommit=True) as conn:
                return Admin().cancel_matching(conn, EventFilter(states=("running",),
                                                                 topic="job.bulk"))
        assert sorted(await asyncio.to_thread(cancel_running)) == sorted(ids)

        async def all_stopped() -> bool:
            return sorted(stopped) == sorted(ids)
        await wait_until(all_stopped, timeout=PROMPT, what="both handlers to be cancelled")
    assert worker.stats.cancelled == 2 and worker.stats.lost == 0


async def test_cancelling_a_running_plain_handler_lets_it_see_cancelled(db: str) -> None:
    started, saw = threading.Event(), threading.Event()

    def cooperative(event: Event) -> None:
        started.set()
        deadline = time.monotonic() + 60
        while not event.cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
        if event.cancelled:
            saw.set()

    worker = _worker(db, "job.plain", cooperative, blocking=True)
    async with running(worker):
        event_id = await enqueue(db, "job.plain")
        assert await asyncio.to_thread(started.wait, PROMPT)
        await asyncio.to_thread(_cancel, db, event_id)
        assert await asyncio.to_thread(saw.wait, PROMPT), "the handler never saw event.cancelled"

        async def returned() -> bool:
            return worker.in_flight == 0
        await wait_until(returned, timeout=PROMPT, what="the slot to be free")
    row = await event_row(db, event_id)
    assert (row["state"], row["attempts"]) == ("cancelled", 1)


async def test_a_leases_notification_from_anyone_stops_nothing_still_held(db: str) -> None:
    # Any role may NOTIFY the channel: the hint only makes the worker look, and
    # what it finds (the lease still its own) keeps the handler running.
    started, release = asyncio.Event(), asyncio.Event()

    async def waits(event: Event) -> None:
        started.set()
        await release.wait()

    worker = _worker(db, "job.held", waits)
    async with running(worker):
        event_id = await enqueue(db, "job.held")
        await asyncio.wait_for(started.wait(), PROMPT)
        lease = worker.maintenance.lease
        before = lease.due_at()               # the start's heartbeat, plus 30 s
        with psycopg.connect(db, autocommit=True) as conn:
            for _ in range(50):
                conn.execute("SELECT pg_notify('conveyor.events', %s)", (LEASES_NOTIFICATION,))

        async def looked() -> bool:
            return lease.due_at() > before
        await wait_until(looked, timeout=PROMPT, what="the worker to check its leases")
        assert worker.in_flight == 1
        release.set()

        async def done() -> bool:
            return (await event_row(db, event_id))["state"] == "succeeded"
        await wait_until(done, timeout=PROMPT, what="the held event to succeed")
    assert worker.stats.lost == 0 and worker.stats.cancelled == 0
