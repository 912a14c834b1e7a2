"""Every connection of a running worker is cut; the worker reconnects and loses nothing."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from psycopg.conninfo import conninfo_to_dict

from conveyor import Event, NewEvent, Router, Worker
from waiting import wait_until
from worker_support import enqueue, enqueue_many, event_row, fast_config, query, running, states

# The worker's four connections. Not its watchdog's, which a loaded machine's
# stalled loop opens too (CI: 5 sessions found where 4 were cut).
TERMINATE = ("SELECT pg_terminate_backend(pid) AS killed FROM pg_stat_activity "
             "WHERE datname = current_database() AND application_name IN "
             "('conveyor-fetch', 'conveyor-ack', 'conveyor-maintenance', 'conveyor-listen') "
             "AND pid <> pg_backend_pid()")

TERMINATE_IN = ("SELECT pg_terminate_backend(pid) AS killed FROM pg_stat_activity "
                "WHERE datname = %s AND application_name LIKE 'conveyor-%%'")


async def test_worker_survives_all_its_connections_being_terminated(db: str) -> None:
    handled: list[int] = []
    woken: list[float] = []

    async def handle(event: Event) -> None:
        if event.topic == "cut.wake":
            woken.append(time.time())
            return
        await asyncio.sleep(0.05)   # 200 of them, 5 at a time: the cut lands mid-drain
        handled.append(event.id)

    router = Router()
    router.add("cut.*", handle)
    total = 200
    ids = await enqueue_many(db, [NewEvent(topic="cut.drain") for _ in range(total)])
    worker = Worker(db, router,
                    fast_config(concurrency=5, batch_size=5, poll_interval=30))
    managed = {"fetch": worker.connections.fetch, "ack": worker.connections.ack,
               "maintenance": worker.connections.maintenance, "listen": worker.connections.listen}
    async with running(worker) as task:
        async def some_done() -> bool:
            return len(handled) >= 30
        await wait_until(some_done, timeout=30, what="the drain to get going")
        killed = await query(db, TERMINATE)
        assert len(killed) == 4 and all(r["killed"] for r in killed)
        assert len(handled) < total, "the drain finished before the cut"

        async def all_done() -> bool:
            current = await states(db)
            return all(current[i] == "succeeded" for i in ids)
        await wait_until(all_done, timeout=60, what="every event to succeed after the cut")
        assert not task.done()

        async def all_reconnected() -> bool:
            return all(m.reconnects > 0 for m in managed.values())
        await wait_until(all_reconnected, timeout=20, what="every connection to reconnect")
        await asyncio.wait_for(worker.listener.connected.wait(), 20)
        await asyncio.sleep(0.1)  # let the LISTEN statement finish on the new connection
        sent = time.time()
        wake_id = await enqueue(db, "cut.wake")

        async def woke() -> bool:
            return bool(woken)
        # Far under the 30 s poll_interval: only the NOTIFY can wake it this soon.
        await wait_until(woke, timeout=15, what="a NOTIFY to wake the reconnected worker")
        assert woken[0] - sent < 15
    assert (await event_row(db, wake_id))["state"] == "succeeded"
    assert set(handled) == set(ids) and len(handled) == total


async def test_stopping_while_the_database_refuses_connections_backs_off(
        fresh_db: str, server_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # The database goes away just as the worker is asked to stop: results cannot
    # be acknowledged. The worker must still return in bounded time, and keep
    # backing off between connection attempts instead of hammering the server.
    gate = asyncio.Event()
    started = asyncio.Event()

    async def handle(event: Event) -> None:
        started.set()
        await asyncio.wait_for(gate.wait(), 10)

    router = Router()
    router.add("down.*", handle)
    worker = Worker(fresh_db, router,
                    fast_config(shutdown_timeout=1.0, reconnect_min=0.1, reconnect_max=0.4))
    event_id = await enqueue(fresh_db, "down.job")
    dbname = conninfo_to_dict(fresh_db)["dbname"]
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(started.wait(), 20)
        await query(server_url, f'ALTER DATABASE "{dbname}" WITH ALLOW_CONNECTIONS false')
        await query(server_url, TERMINATE_IN, (dbname,))
        caplog.clear()
        caplog.set_level(logging.WARNING, logger="conveyor.worker.connection")
        stopped_at = time.monotonic()
        worker.request_stop()
        gate.set()
        await asyncio.wait_for(task, 30)
        took = time.monotonic() - stopped_at
    finally:
        gate.set()
        if not task.done():
            task.cancel()
        await worker.close()
        await query(server_url, f'ALTER DATABASE "{dbname}" WITH ALLOW_CONNECTIONS true')
    attempts = [r for r in caplog.records if getattr(r, "action", "") == "reconnect_wait"]
    # Bounded: a loaded machine may need more than the 1 s grace; a worker that kept
    # trying to acknowledge would not return at all.
    assert took < 10.0
    # Backing off from 0.1 s to 0.4 s allows about a dozen attempts in 4 s; the
    # allowance grows with the time a loaded machine took, never to hammering.
    assert len(attempts) < 40 * max(1.0, took / 4.0), \
        f"{len(attempts)} connection attempts in {took:.1f}s"
    row = await event_row(fresh_db, event_id)
    assert row["state"] == "running"          # left to lease expiry, as documented
