"""Helpers for in-process worker tests: a real database, bounded waits, no mocks.

Every wait here has a deadline, so a misbehaving worker fails a test instead of
hanging the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from conveyor import AsyncCommittingProducer, BackoffPolicy, NewEvent, Router, Worker, WorkerConfig

WORKER_BACKENDS = ("SELECT count(*) FROM pg_stat_activity "
                   "WHERE datname = current_database() AND application_name LIKE 'conveyor-%'")


@pytest.fixture(scope="module")
def module_db(make_db: Callable[..., contextlib.AbstractContextManager[str]],
              template_db: str) -> Iterator[str]:
    """A migrated database for one test module (creating one per test costs ~1 s)."""
    with make_db(prefix="conveyor_w_", template=template_db) as url:
        yield url


@pytest.fixture
def db(module_db: str) -> Iterator[str]:
    """The module's database, emptied for this test; tests commit freely in it.

    Afterwards every worker of the test must have let go of its connections.
    """
    with psycopg.connect(module_db, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '5s'")
        conn.execute("TRUNCATE conveyor.events, conveyor.workers RESTART IDENTITY")
    yield module_db
    with psycopg.connect(module_db, autocommit=True) as conn:
        deadline = time.monotonic() + 3
        while True:
            row = conn.execute(WORKER_BACKENDS).fetchone()
            if row is None or row[0] == 0:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"{row[0]} worker connections still open after the test")
            time.sleep(0.02)


FAST_BACKOFF = BackoffPolicy(base_delay=0.01, max_delay=0.05, jitter=0.0)


def fast_config(**overrides: Any) -> WorkerConfig:
    """Small timings so a whole life cycle fits in a second or two."""
    options: dict[str, Any] = {
        "concurrency": 10,
        "batch_size": 10,
        "poll_interval": 0.2,
        "lease_ttl": 1.0,
        "heartbeat_interval": 0.3,
        "rescue_interval": 0.3,
        "shutdown_timeout": 2.0,
        "reconnect_min": 0.05,
        "reconnect_max": 0.2,
        "listener_ping_interval": 1.0,
        "backoff": FAST_BACKOFF,
    }
    options.update(overrides)
    return WorkerConfig(**options)


async def enqueue(url: str, topic: str, payload: Any = None, **options: Any) -> int:
    async with AsyncCommittingProducer(url) as producer:
        return await producer.enqueue(topic, payload, **options)


async def enqueue_many(url: str, events: list[NewEvent]) -> list[int]:
    async with AsyncCommittingProducer(url) as producer:
        return await producer.enqueue_many(events)


async def query(url: str, statement: str, params: Any = None) -> list[dict[str, Any]]:
    """Run one statement in its own committed connection; rows as dicts."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True,
                                                     row_factory=dict_row) as conn:
        cur = await conn.execute(statement, params)
        return await cur.fetchall() if cur.description else []


async def event_row(url: str, event_id: int) -> dict[str, Any]:
    rows = await query(url, "SELECT *, lease_owner::text AS owner FROM conveyor.events "
                            "WHERE id = %s", (event_id,))
    assert rows, f"event {event_id} not found"
    return rows[0]


async def states(url: str) -> dict[int, str]:
    rows = await query(url, "SELECT id, state FROM conveyor.events")
    return {r["id"]: r["state"] for r in rows}


async def wait_until(check: Callable[[], Awaitable[bool]], *, timeout: float,
                     interval: float = 0.02, what: str = "condition") -> float:
    """Poll ``check`` until it holds; returns the seconds it took. Fails on timeout."""
    start = time.monotonic()
    while True:
        if await check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


async def wait_all_in(url: str, wanted: set[str], *, timeout: float) -> dict[int, str]:
    async def done() -> bool:
        return all(s in wanted for s in (await states(url)).values())
    await wait_until(done, timeout=timeout, what=f"every event in {sorted(wanted)}")
    return await states(url)


@contextlib.asynccontextmanager
async def running(worker: Worker, *, stop_timeout: float = 10.0) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``worker.run()`` as a task; stop it gracefully on exit, with a deadline."""
    task = asyncio.create_task(worker.run())
    try:
        waiter = asyncio.ensure_future(worker.started.wait())
        done, _ = await asyncio.wait({waiter, task}, timeout=10,
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises the startup error
        assert waiter in done, "worker did not start within 10s"
        if worker.listens:
            await asyncio.wait_for(worker.listener.connected.wait(), 10)
        yield task
    finally:
        worker.request_stop()
        try:
            await asyncio.wait_for(asyncio.shield(task), stop_timeout)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise AssertionError(f"worker did not stop within {stop_timeout}s") from None
        await worker.close()


def router_for(pattern: str, handler: Any, **options: Any) -> Router:
    router = Router()
    router.add(pattern, handler, **options)
    return router
