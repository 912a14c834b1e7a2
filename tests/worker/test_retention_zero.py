"""Retention 0: a succeeded event is deleted as its success is acknowledged."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from conveyor import ConfigError, Event, NewEvent, Router, Worker, WorkerConfig
from waiting import wait_until
from worker_support import enqueue, enqueue_many, event_row, fast_config, query, running


async def _ids(url: str) -> dict[int, tuple[str, int]]:
    rows = await query(url, "SELECT id, state, attempts FROM conveyor.events")
    return {r["id"]: (r["state"], r["attempts"]) for r in rows}


async def test_successes_are_deleted_and_failures_and_retries_are_kept(db: str) -> None:
    tries: dict[str, int] = {}

    async def handle(event: Event) -> None:
        kind = event.payload["kind"]
        tries[kind] = tries.get(kind, 0) + 1
        if kind == "bad" or (kind == "flaky" and event.attempt == 1):
            raise RuntimeError(f"{kind} failed on attempt {event.attempt}")

    router = Router()
    router.add("keep.*", handle)
    ok = await enqueue(db, "keep.ok", {"kind": "ok"})
    bad = await enqueue(db, "keep.bad", {"kind": "bad"}, max_attempts=1)
    flaky = await enqueue(db, "keep.flaky", {"kind": "flaky"}, max_attempts=3)
    worker = Worker(db, router, fast_config(retention=0))
    try:
        assert await worker.run_once() == 3
        # The success left no row; the failure is parked, the retry waits.
        assert await _ids(db) == {bad: ("failed", 1), flaky: ("pending", 1)}
        assert (await event_row(db, bad))["last_error"].startswith("RuntimeError: bad failed")
        await wait_until(lambda: _due(db, flaky), timeout=5, what="the retry to fall due")
        assert await worker.run_once() == 1
    finally:
        await worker.close()
    assert await _ids(db) == {bad: ("failed", 1)}
    assert ok not in await _ids(db)
    assert tries == {"ok": 1, "bad": 1, "flaky": 2}


async def _due(url: str, event_id: int) -> bool:
    rows = await query(url, "SELECT run_at <= now() AS due FROM conveyor.events WHERE id = %s",
                       (event_id,))
    return bool(rows and rows[0]["due"])


async def test_a_running_worker_with_retention_zero_drains_to_an_empty_table(db: str) -> None:
    seen: list[int] = []

    async def handle(event: Event) -> None:
        seen.append(event.id)

    ids = await enqueue_many(db, [NewEvent(topic="empty.me", payload=i) for i in range(300)])
    worker = Worker(db, _router_for("empty.*", handle),
                    fast_config(retention=0, concurrency=50, batch_size=50))
    async with running(worker):
        async def drained() -> bool:
            return not await _ids(db)
        await wait_until(drained, timeout=20, what="every event deleted")
    assert sorted(seen) == sorted(ids)
    assert worker.completer.acked == 300


async def test_a_late_success_does_not_delete_the_row_of_the_attempt_after_it(db: str) -> None:
    """Fenced like the UPDATE: a rescued attempt's late success deletes nothing."""
    event_id = await enqueue(db, "late.job", max_attempts=5)
    gate = asyncio.Event()
    calls: list[tuple[str, int]] = []

    async def slow_ok(event: Event) -> None:
        calls.append(("a", event.attempt))
        await asyncio.wait_for(gate.wait(), 10)

    async def fails(event: Event) -> None:
        calls.append(("b", event.attempt))
        raise RuntimeError("b failed")

    worker_a = Worker(db, _router_for("late.*", slow_ok), fast_config(retention=0))
    worker_b = Worker(db, _router_for("late.*", fails), fast_config(retention=0))
    run_a = asyncio.create_task(worker_a.run_once())
    try:
        async def claimed_by_a() -> bool:
            row = await event_row(db, event_id)
            return row["state"] == "running" and row["owner"] == worker_a.id
        await wait_until(claimed_by_a, timeout=5, what="worker A to claim")
        await query(db, "UPDATE conveyor.events SET lease_expires_at = now() - interval '1 second' "
                        "WHERE id = %s", (event_id,))
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            assert await worker_b.maintenance.rescue(conn) == (1, 0)
        assert await worker_b.run_once() == 1         # attempt 2 fails: pending again
        gate.set()
        assert await asyncio.wait_for(run_a, 5) == 1   # attempt 1's late success
    finally:
        gate.set()
        await worker_a.close()
        await worker_b.close()
    assert calls == [("a", 1), ("b", 2)]
    row = await event_row(db, event_id)
    assert (row["state"], row["attempts"]) == ("pending", 2)
    assert worker_a.completer.stale == 1


def _router_for(pattern: str, handle: object) -> Router:
    router = Router()
    router.add(pattern, handle)  # type: ignore[arg-type]
    return router


def test_retention_zero_is_accepted_and_a_negative_one_is_refused() -> None:
    assert WorkerConfig(retention=0).retention == 0
    for bad in (-1, float("nan"), True, "0"):
        with pytest.raises(ConfigError, match=r"^expected retention to be .*between 0s and 3650d, got "):
            WorkerConfig(retention=bad)  # type: ignore[arg-type]
