"""The success path: every kind of handler runs and its event ends ``succeeded``."""

from __future__ import annotations

import asyncio
import datetime
import threading

import pytest

from conveyor import ConfigError, Event, MigrationError, Router, Worker
from waiting import wait_until
from worker_support import enqueue, event_row, fast_config, query, running, wait_all_in


async def _assert_succeeded(url: str, event_id: int) -> None:
    row = await event_row(url, event_id)
    assert row["state"] == "succeeded"
    assert row["attempts"] == 1
    assert row["finished_at"] is not None
    assert row["finished_at"] >= row["attempted_at"]
    assert row["lease_owner"] is None and row["lease_expires_at"] is None
    assert row["last_error"] is None and row["errors"] == []


async def test_async_handler_runs_once_and_event_succeeds(db: str) -> None:
    seen: list[tuple[int, str, object]] = []

    async def handle(event: Event) -> None:
        seen.append((event.id, event.topic, event.payload))

    router = Router()
    router.add("email.send", handle)
    event_id = await enqueue(db, "email.send", {"to": "a@example.com"})
    worker = Worker(db, router, fast_config())
    try:
        assert await worker.run_once() == 1
        assert await worker.run_once() == 0
    finally:
        await worker.close()
    assert seen == [(event_id, "email.send", {"to": "a@example.com"})]
    await _assert_succeeded(db, event_id)
    assert worker.stats.succeeded == 1 and worker.stats.claimed == 1


async def test_plain_handler_runs_in_a_worker_thread(db: str) -> None:
    threads: list[str] = []

    def handle(event: Event) -> None:
        threads.append(threading.current_thread().name)

    router = Router()
    router.add("report.build", handle)
    event_id = await enqueue(db, "report.build")
    worker = Worker(db, router, fast_config())
    try:
        assert await worker.run_once() == 1
    finally:
        await worker.close()
    assert len(threads) == 1
    assert threads[0] != threading.main_thread().name
    await _assert_succeeded(db, event_id)


async def test_plain_handler_with_blocking_false_runs_inline_on_the_loop(db: str) -> None:
    calls: list[tuple[str, bool]] = []

    def handle(event: Event) -> None:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        calls.append((threading.current_thread().name, on_loop))

    router = Router()
    router.add("cache.touch", handle, blocking=False)
    event_id = await enqueue(db, "cache.touch")
    worker = Worker(db, router, fast_config())
    try:
        assert await worker.run_once() == 1
    finally:
        await worker.close()
    assert calls == [(threading.main_thread().name, True)]
    await _assert_succeeded(db, event_id)


async def test_running_worker_drains_all_three_handler_kinds(db: str) -> None:
    ran: list[str] = []

    async def handle_async(event: Event) -> None:
        ran.append(event.topic)

    def handle_thread(event: Event) -> None:
        ran.append(event.topic)

    def handle_inline(event: Event) -> None:
        ran.append(event.topic)

    router = Router()
    router.add("a.x", handle_async)
    router.add("b.x", handle_thread)
    router.add("c.x", handle_inline, blocking=False)
    worker = Worker(db, router, fast_config())
    async with running(worker):
        ids = [await enqueue(db, t) for t in ("a.x", "b.x", "c.x")]
        final = await wait_all_in(db, {"succeeded"}, timeout=5)
    assert sorted(ran) == ["a.x", "b.x", "c.x"]
    assert set(final) == set(ids)
    for event_id in ids:
        await _assert_succeeded(db, event_id)
    assert worker.stats.succeeded == 3


async def _handed_to_a_handler(db: str, event_id: int) -> Event:
    """The event ``event_id`` (of topic ``order.created``) as one worker pass hands it
    to a handler."""
    seen: list[Event] = []

    async def handle(event: Event) -> None:
        seen.append(event)

    router = Router()
    router.add("order.created", handle)
    worker = Worker(db, router, fast_config())
    try:
        assert await worker.run_once() == 1
    finally:
        await worker.close()
    [event] = seen
    assert event.id == event_id
    return event


async def test_handler_receives_the_event_as_enqueued(db: str) -> None:
    event_id = await enqueue(db, "order.created", {"id": 7, "lines": [1, 2]}, tenant="acme",
                             idempotency_key="order-7", priority=3, max_attempts=4)
    event = await _handed_to_a_handler(db, event_id)
    row = await event_row(db, event_id)
    assert (event.id, event.topic, event.tenant, event.idempotency_key) == \
        (event_id, "order.created", "acme", "order-7")
    assert event.payload == {"id": 7, "lines": [1, 2]}
    assert (event.attempt, event.max_attempts, event.priority) == (1, 4, 3)
    assert event.created_at == row["created_at"]
    assert not event.is_last_attempt


async def test_a_claimed_event_makes_its_created_at_only_when_read(db: str) -> None:
    event_id = await enqueue(db, "order.created", {})
    event = await _handed_to_a_handler(db, event_id)
    # The claim's microseconds, not yet a datetime: a handler that never looks
    # pays nothing for it (types.Event.created_at).
    assert isinstance(event._created, int)
    created = event.created_at
    assert created == (await event_row(db, event_id))["created_at"]
    assert created is not None and created.utcoffset() == datetime.timedelta(0)
    assert event.created_at is created


async def test_higher_priority_runs_first_then_oldest_first(db: str) -> None:
    order: list[str] = []

    async def handle(event: Event) -> None:
        order.append(event.payload["name"])

    router = Router()
    router.add("prio.job", handle)
    for name, priority in (("low-1", 0), ("high-1", 5), ("low-2", 0), ("mid", 2), ("high-2", 5)):
        await enqueue(db, "prio.job", {"name": name}, priority=priority)
    worker = Worker(db, router, fast_config(concurrency=1, batch_size=1))
    try:
        while await worker.run_once():
            pass
    finally:
        await worker.close()
    assert order == ["high-1", "high-2", "mid", "low-1", "low-2"]


async def test_a_batch_starts_highest_priority_first_whatever_order_the_claim_returns(
        db: str) -> None:
    # Statistics of a near-empty table make the claim's UPDATE walk the table in
    # physical order (lowest priority inserted first here); the worker sorts.
    await query(db, "ANALYZE conveyor.events")
    started: list[int] = []

    async def handle(event: Event) -> None:
        started.append(event.priority)

    router = Router()
    router.add("batch.prio", handle)
    for i in range(30):
        await enqueue(db, "batch.prio", {"i": i}, priority=i % 3)
    worker = Worker(db, router, fast_config(concurrency=50, batch_size=50))
    try:
        assert await worker.run_once() == 30
    finally:
        await worker.close()
    assert started == sorted(started, reverse=True) and len(set(started)) == 3


def test_a_worker_with_no_routes_is_refused(db: str) -> None:
    with pytest.raises(ConfigError, match="no routes"):
        Worker(db, Router(), fast_config())


async def test_run_refuses_an_unmigrated_database(empty_db: str) -> None:
    router = Router()
    router.add("x", lambda event: None)
    worker = Worker(empty_db, router, fast_config())
    try:
        with pytest.raises(MigrationError, match="not migrated"):
            await asyncio.wait_for(worker.run(), 10)
    finally:
        await worker.close()


async def test_run_that_fails_at_start_leaves_no_connection_open(empty_db: str) -> None:
    router = Router()
    router.add("x", lambda event: None)
    worker = Worker(empty_db, router, fast_config())
    with pytest.raises(MigrationError):
        await asyncio.wait_for(worker.run(), 10)

    async def none_open() -> bool:
        # A closed connection's server process leaves pg_stat_activity a moment
        # after the client closed it: on a loaded machine, not at once.
        rows = await query(empty_db, "SELECT count(*) AS n FROM pg_stat_activity WHERE datname"
                                     " = current_database() AND application_name LIKE 'conveyor-%%'")
        return bool(rows[0]["n"] == 0)
    try:
        await wait_until(none_open, timeout=5, what="the worker's connections closed")
    finally:
        await worker.close()
