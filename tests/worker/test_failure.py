"""Failed attempts: backoff, error history, poison events and handler timeouts."""

from __future__ import annotations

import asyncio
import threading

from conveyor import BackoffPolicy, Event, Router, Worker
from waiting import wait_until
from worker_support import enqueue, event_row, fast_config, query, running


async def _seconds_until_due(url: str, event_id: int) -> float:
    rows = await query(url, "SELECT extract(epoch FROM run_at - now())::float8 AS due "
                            "FROM conveyor.events WHERE id = %s", (event_id,))
    return float(rows[0]["due"])


async def _make_due(url: str, event_id: int) -> None:
    await query(url, "UPDATE conveyor.events SET run_at = now() WHERE id = %s", (event_id,))


async def test_failed_attempt_is_counted_backed_off_and_recorded(db: str) -> None:
    calls = 0

    async def handle(event: Event) -> None:
        nonlocal calls
        calls += 1
        raise ValueError(f"boom {event.attempt}")

    config = fast_config(backoff=BackoffPolicy(base_delay=10, factor=3, max_delay=100, jitter=0))
    event_id = await enqueue(db, "pay.charge", max_attempts=5)
    worker = Worker(db, _router("pay.charge", handle), config)
    try:
        assert await worker.run_once() == 1
        first = await event_row(db, event_id)
        due = await _seconds_until_due(db, event_id)
        assert 9.0 < due <= 10.0          # backoff for attempt 1: base_delay
        await _make_due(db, event_id)
        assert await worker.run_once() == 1
        due = await _seconds_until_due(db, event_id)
        assert 29.0 < due <= 30.0         # attempt 2: base_delay * factor
    finally:
        await worker.close()
    assert calls == 2
    assert first["state"] == "pending" and first["attempts"] == 1
    assert first["lease_owner"] is None and first["finished_at"] is None
    row = await event_row(db, event_id)
    assert row["state"] == "pending" and row["attempts"] == 2
    assert row["last_error"] == "ValueError: boom 2"
    assert [e["attempt"] for e in row["errors"]] == [1, 2]
    assert [e["error"] for e in row["errors"]] == ["ValueError: boom 1", "ValueError: boom 2"]
    for entry in row["errors"]:
        assert entry["traceback"].startswith("Traceback")
        assert "in handle" in entry["traceback"]
        assert entry["worker"] == worker.id
    assert worker.stats.retried == 2


def _router(pattern: str, handler: object, **options: object) -> Router:
    router = Router()
    router.add(pattern, handler, **options)  # type: ignore[arg-type]
    return router


async def test_poison_event_runs_max_attempts_times_then_fails_and_stays_failed(
        db: str) -> None:
    attempts_seen: list[int] = []

    async def handle(event: Event) -> None:
        attempts_seen.append(event.attempt)
        raise RuntimeError("poison")

    event_id = await enqueue(db, "poison.pill", max_attempts=3)
    worker = Worker(db, _router("poison.*", handle), fast_config())
    async with running(worker):
        async def parked() -> bool:
            return (await event_row(db, event_id))["state"] == "failed"
        await wait_until(parked, timeout=30, what="the poison event to be parked")
        # Several polls, rescues and backoff windows later: still no new attempt.
        await asyncio.sleep(1.0)
    assert attempts_seen == [1, 2, 3]
    row = await event_row(db, event_id)
    assert row["state"] == "failed" and row["attempts"] == 3
    assert row["finished_at"] is not None and row["lease_owner"] is None
    assert len(row["errors"]) == 3 and row["last_error"] == "RuntimeError: poison"
    assert worker.stats.failed == 1 and worker.stats.retried == 2


async def test_failed_event_is_not_claimed_even_when_due(db: str) -> None:
    calls = 0

    async def handle(event: Event) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("always")

    event_id = await enqueue(db, "poison.pill", max_attempts=1)
    worker = Worker(db, _router("poison.pill", handle), fast_config())
    try:
        assert await worker.run_once() == 1
        await _make_due(db, event_id)
        assert await worker.run_once() == 0
    finally:
        await worker.close()
    assert calls == 1
    assert (await event_row(db, event_id))["state"] == "failed"


async def test_route_timeout_fails_the_attempt_with_a_timed_out_error(db: str) -> None:
    cancelled = asyncio.Event()

    async def handle(event: Event) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    event_id = await enqueue(db, "slow.job", max_attempts=5)
    worker = Worker(db, _router("slow.job", handle, timeout=0.2),
                    fast_config(handler_timeout=100))
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        assert await asyncio.wait_for(worker.run_once(), 20) == 1
    finally:
        await worker.close()
    # Far under the handler's 30 s and the worker's 100 s: the route's 0.2 s ended it
    # (the bound was 2 s, which a loaded machine can use up).
    assert loop.time() - start < 15
    assert cancelled.is_set()
    row = await event_row(db, event_id)
    assert row["state"] == "pending" and row["attempts"] == 1
    assert row["last_error"] == "handler timed out after 0.2s"
    assert row["errors"][0]["error"] == "handler timed out after 0.2s"


async def test_worker_handler_timeout_applies_when_the_route_sets_none(db: str) -> None:
    async def handle(event: Event) -> None:
        await asyncio.sleep(30)

    event_id = await enqueue(db, "slow.job", max_attempts=1)
    worker = Worker(db, _router("slow.job", handle), fast_config(handler_timeout=0.2))
    try:
        assert await asyncio.wait_for(worker.run_once(), 20) == 1
    finally:
        await worker.close()
    row = await event_row(db, event_id)
    assert row["state"] == "failed" and row["attempts"] == 1      # it was the last attempt
    assert "timed out" in row["last_error"]
    assert row["last_error"] == "handler timed out after 0.2s"


async def test_timeout_error_raised_by_the_handler_is_an_ordinary_failure(db: str) -> None:
    async def handle(event: Event) -> None:
        raise TimeoutError("upstream took too long")

    event_id = await enqueue(db, "slow.job")
    worker = Worker(db, _router("slow.job", handle, timeout=5), fast_config())
    try:
        assert await worker.run_once() == 1
    finally:
        await worker.close()
    row = await event_row(db, event_id)
    assert row["last_error"] == "TimeoutError: upstream took too long"
    assert row["errors"][0]["traceback"].startswith("Traceback")


async def test_cancelled_error_raised_inside_the_handler_is_a_failed_attempt(
        db: str) -> None:
    # The handler awaits something that someone else cancelled: the worker did
    # not cancel the handler, so this is the handler failing, not a shutdown.
    async def handle(event: Event) -> None:
        future = asyncio.get_running_loop().create_future()
        future.cancel()
        await future

    event_id = await enqueue(db, "inner.cancel", max_attempts=5)
    worker = Worker(db, _router("inner.cancel", handle), fast_config())
    try:
        assert await asyncio.wait_for(worker.run_once(), 20) == 1
        in_flight = worker.in_flight
    finally:
        await worker.close()
    row = await event_row(db, event_id)
    assert row["state"] == "pending", "the event was left running with no outcome"
    assert row["attempts"] == 1 and row["lease_owner"] is None
    assert "CancelledError" in row["last_error"]
    assert in_flight == 0


async def test_a_timed_out_thread_does_not_steal_the_next_events_time(db: str) -> None:
    # A plain handler that timed out keeps its thread until it returns; the next
    # event must not spend its attempt (and its timeout) queued behind it.
    release = threading.Event()
    ran: list[str] = []

    def handle(event: Event) -> None:
        ran.append(event.topic)
        if event.topic == "thread.stuck":
            release.wait(3)

    router = Router()
    router.add("thread.*", handle, timeout=0.3)
    stuck = await enqueue(db, "thread.stuck", max_attempts=5, priority=1)
    quick = await enqueue(db, "thread.quick", max_attempts=5)
    worker = Worker(db, router, fast_config(concurrency=1, batch_size=1))
    try:
        assert await asyncio.wait_for(worker.run_once(), 20) == 1     # the stuck one times out
        assert "timed out" in (await event_row(db, stuck))["last_error"]
        await query(db, "UPDATE conveyor.events SET run_at = now() + interval '1 hour' "
                              "WHERE id = %s", (stuck,))
        assert await asyncio.wait_for(worker.run_once(), 20) == 1
    finally:
        release.set()
        await worker.close()
    row = await event_row(db, quick)
    assert row["state"] == "succeeded", f"quick event: {row['state']}, {row['last_error']!r}"
    assert ran[:2] == ["thread.stuck", "thread.quick"]


class _NotAnException(BaseException):
    """Some libraries raise BaseException subclasses (test-framework outcomes, timeouts)."""


async def test_a_base_exception_from_the_handler_is_a_failed_attempt(db: str) -> None:
    async def handle(event: Event) -> None:
        raise _NotAnException("escaped the Exception hierarchy")

    event_id = await enqueue(db, "odd.raise", max_attempts=5)
    worker = Worker(db, _router("odd.raise", handle), fast_config())
    try:
        assert await asyncio.wait_for(worker.run_once(), 20) == 1
        in_flight = worker.in_flight
    finally:
        await worker.close()
    row = await event_row(db, event_id)
    assert row["state"] == "pending", "the event was left running with no outcome"
    assert row["attempts"] == 1 and row["lease_owner"] is None
    assert "_NotAnException" in row["last_error"]
    assert in_flight == 0
