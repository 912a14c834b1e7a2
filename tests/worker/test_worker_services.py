"""The services a worker runs (cron, the flow claims, the metrics refresher, services it
is given), one pass at a time through ``run_once``, and how a worker runs them.

No worker loop is booted for the passes and no interval or lease is waited
out: each test builds the service, runs a pass on a real connection and looks
at the rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from conveyor import Event, Router, Worker
from conveyor.db.named_queries import queries_for
from conveyor.metrics import DatabaseGauges
from conveyor.worker.connection import ManagedConnection
from conveyor.worker.scheduler import Scheduler
from conveyor.worker.service import Service, ServiceTasks
from waiting import wait_until
from worker_support import enqueue, fast_config, query, running

Q = queries_for("conveyor")


@pytest.fixture
async def conn(db: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as c:
        yield c


def _unused_connection(db: str) -> ManagedConnection:
    # A service's own connection, never opened: run_once is handed the test's.
    return ManagedConnection(db, "cron", reconnect_min=0.01, reconnect_max=0.02,
                             stopping=asyncio.Event())


async def test_cron_fires_a_slot_once_across_schedulers(
        db: str, conn: psycopg.AsyncConnection[Any]) -> None:
    router = Router()
    router.add("report.build", lambda event: None)
    router.cron("0 * * * *", "report.build")
    now = [datetime(2031, 3, 30, 8, 30, tzinfo=UTC)]
    first, second = (Scheduler(_unused_connection(db), Q, router.schedules, query_timeout=5.0,
                               clock_offset=lambda: 0.0, clock=lambda: now[0])
                     for _ in range(2))
    await first.run_once(conn)                  # declared at 08:30: nothing due yet
    assert first.fired == 0
    now[0] += timedelta(minutes=31)             # 09:01, the 09:00 slot is due
    await first.run_once(conn)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as other:
        await second.run_once(other)            # another worker, same slot
    rows = await query(db, "SELECT topic, idempotency_key FROM conveyor.events")
    assert [r["topic"] for r in rows] == ["report.build"]
    assert (first.fired, second.fired) == (1, 0)


async def test_the_flow_claims_keep_a_limit_and_give_back_their_reserved_slots(db: str) -> None:
    await query(db, "TRUNCATE conveyor.flow_limits")
    release = asyncio.Event()
    started: list[int] = []

    async def handler(event: Event) -> None:
        started.append(event.id)
        await release.wait()

    router = Router()
    router.add("limited.*", handler, max_running=1)
    ids = [await enqueue(db, "limited.job") for _ in range(3)]
    worker = Worker(db, router, fast_config())
    try:
        await worker.startup.learn_flow()
        conn = await worker.connections.fetch.get()
        await worker.flow_claims.run_once(conn)
        async def handler_started() -> bool:
            return bool(started)
        await wait_until(handler_started, timeout=5, what="the claimed handler to start")
        assert started == [ids[0]]
        assert worker.running.reserved == 0          # the claim's reservation is given back
        worker.flow.poke()
        await worker.flow_claims.run_once(conn)       # the limit is full: nothing more
        assert len(worker.running) == 1 and worker.stats.claimed == 1
    finally:
        release.set()
        await asyncio.gather(*worker.running.tasks())
        await worker.close()


async def test_the_metrics_refresher_reads_only_on_the_session_holding_its_lock(
        db: str, conn: psycopg.AsyncConnection[Any]) -> None:
    await enqueue(db, "gauge.job")
    first, second = DatabaseGauges(db), DatabaseGauges(db)
    assert await first.run_once(conn)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as other:
        assert not await second.run_once(other)       # the lock is the first one's
        families = {f.name: f for f in first.collect()}
        assert any(s.labels == {"topic": "gauge.job", "state": "pending"} and s.value == 1
                   for s in families["conveyor_events"].samples)
        assert list(second.collect()) == []
        await conn.close()                            # the holder's session ends

        async def taken_over() -> bool:               # once the server has ended it too
            return await second.run_once(other)
        await wait_until(taken_over, timeout=10, what="the second refresher to take the lock")
        assert second.holds_lock and list(second.collect())


class _Ticking:
    """A service given to a worker: counts its passes on its own connection."""

    name = "ticking"

    def __init__(self, db: str) -> None:
        self.db = db
        self.passes = 0
        self.stopped = False

    async def run(self, stopping: asyncio.Event) -> None:
        async with await psycopg.AsyncConnection.connect(self.db, autocommit=True) as conn:
            while not stopping.is_set():
                await self.run_once(conn)
                try:
                    await asyncio.wait_for(stopping.wait(), 0.02)
                except TimeoutError:
                    pass
        self.stopped = True

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("SELECT 1")
        self.passes += 1


async def test_a_worker_runs_the_services_it_is_given_and_stops_them_with_itself(
        db: str) -> None:
    ticking = _Ticking(db)
    router = Router()
    router.add("svc.job", lambda event: None)
    worker = Worker(db, router, fast_config(), services=[ticking])
    async with running(worker):
        async def ticked() -> bool:
            return ticking.passes >= 2
        await wait_until(ticked, timeout=5, what="the given service's passes")
        assert not ticking.stopped
    assert ticking.stopped


class _Broken:
    name = "broken"

    async def run(self, stopping: asyncio.Event) -> None:
        raise RuntimeError("service bug")

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        raise RuntimeError("service bug")


async def test_a_worker_whose_service_fails_stops_and_raises_its_error(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    router = Router()
    router.add("svc.job", lambda event: None)
    worker = Worker(db, router, fast_config(), services=[_Broken()])
    with pytest.raises(RuntimeError, match="service bug"):
        await asyncio.wait_for(worker.run(), 30)
    assert worker.stopping
    assert [r.getMessage() for r in caplog.records
            if getattr(r, "action", None) == "service_failed"] == [
        "the broken service failed: RuntimeError: service bug"]


class _Stubborn:
    """Ignores its stop: the worker must not wait for it for ever."""

    name = "stubborn"

    def __init__(self) -> None:
        self.cancelled = False

    async def run(self, stopping: asyncio.Event) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        pass


async def test_service_tasks_cancel_a_service_that_ignores_its_stop_after_the_grace() -> None:
    stubborn = _Stubborn()
    services = ServiceTasks()
    service: Service = stubborn
    services.start(service, asyncio.Event())
    await asyncio.sleep(0)
    await asyncio.wait_for(services.stop(grace=0.05), 5)
    assert stubborn.cancelled
    assert services.failed is None


def test_a_worker_without_services_given_runs_cron_only_when_the_router_has_schedules(
        db: str) -> None:
    router = Router()
    router.add("svc.job", lambda event: None)
    assert [s.name for s in Worker(db, router, fast_config()).services] == ["flow"]
    router.cron("0 * * * *", "svc.job")
    assert [s.name for s in Worker(db, router, fast_config()).services] == ["flow", "cron"]

