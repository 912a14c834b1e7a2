"""Helpers for tests that run workers in-process: a real database, bounded waits, no mocks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from psycopg.rows import dict_row

from conveyor import AsyncCommittingProducer, BackoffPolicy, NewEvent, Router, Worker, WorkerConfig
from waiting import wait_until

WORKER_BACKENDS = ("SELECT count(*) FROM pg_stat_activity "
                   "WHERE datname = current_database() AND application_name LIKE 'conveyor-%'")

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
    row = rows[0]
    # No failed attempt: NULL since 0020 (the rows written before have '[]').
    row["errors"] = [] if row["errors"] is None else row["errors"]
    return row


async def states(url: str) -> dict[int, str]:
    rows = await query(url, "SELECT id, state FROM conveyor.events")
    return {r["id"]: r["state"] for r in rows}


async def wait_all_in(url: str, wanted: set[str], *, timeout: float) -> dict[int, str]:
    async def done() -> bool:
        return all(s in wanted for s in (await states(url)).values())
    await wait_until(done, timeout=timeout, what=f"every event in {sorted(wanted)}")
    return await states(url)


@contextlib.asynccontextmanager
async def running(worker: Worker, *, stop_timeout: float = 10.0,
                  start_timeout: float = 10.0) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``worker.run()`` as a task; stop it gracefully on exit, with a deadline."""
    task = asyncio.create_task(worker.run())
    try:
        waiter = asyncio.ensure_future(worker.started.wait())
        done, _ = await asyncio.wait({waiter, task}, timeout=start_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises the startup error
        assert waiter in done, f"worker did not start within {start_timeout}s"
        if worker.listens:
            await asyncio.wait_for(worker.listener.connected.wait(), start_timeout)
        yield task
    finally:
        worker.request_stop()
        try:
            await asyncio.wait_for(asyncio.shield(task), stop_timeout)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 5)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(worker.close(), 5)
            raise AssertionError(f"worker did not stop within {stop_timeout}s") from None
        await worker.close()


class CallCounter:
    """Counts the calls of an object's async method, wrapping it in place.

    ``CallCounter(worker.claims, "claim").count`` is how many claims the worker
    has made since: tests bound how often a wake-up or a flood makes it claim.
    """

    def __init__(self, owner: Any, name: str) -> None:
        self.count = 0
        original = getattr(owner, name)

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return await original(*args, **kwargs)

        setattr(owner, name, counted)


def router_for(pattern: str, handler: Any, **options: Any) -> Router:
    router = Router()
    router.add(pattern, handler, **options)
    return router
