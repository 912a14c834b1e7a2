"""Plain handlers routed with ``blocking=False``: called inline, without a task.

The worker calls them where it starts a batch instead of wrapping each call in
an asyncio task. Every outcome must still be exactly what a handler run in a
task produces: success, a failed attempt with its traceback, each signal, and
a running worker that drains them and shuts down cleanly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conveyor import (
    BackoffPolicy,
    Cancel,
    Event,
    NewEvent,
    PermanentFailure,
    RetryAfter,
    Snooze,
    Worker,
)
from worker_support import (
    enqueue,
    enqueue_many,
    event_row,
    fast_config,
    router_for,
    running,
    states,
    wait_all_in,
)

NO_JITTER = BackoffPolicy(base_delay=10, factor=2, max_delay=100, jitter=0)


async def _once(url: str, handler: Any, **enqueue_options: Any) -> tuple[dict[str, Any], Worker]:
    event_id = await enqueue(url, "inline.x", **enqueue_options)
    worker = Worker(url, router_for("inline.x", handler, blocking=False),
                    fast_config(backoff=NO_JITTER))
    try:
        assert await worker.run_once() == 1
    finally:
        await worker.close()
    return await event_row(url, event_id), worker


async def test_an_inline_failure_is_a_failed_attempt_with_its_traceback(db: str) -> None:
    def handle_inline(event: Event) -> None:
        raise ValueError(f"bad row {event.attempt}")

    row, worker = await _once(db, handle_inline, max_attempts=3)
    assert row["state"] == "pending" and row["attempts"] == 1
    assert row["last_error"] == "ValueError: bad row 1"
    [entry] = row["errors"]
    assert entry["traceback"].startswith("Traceback") and "in handle_inline" in entry["traceback"]
    assert worker.stats.retried == 1 and worker.stats.succeeded == 0


async def test_an_inline_failure_on_the_last_attempt_parks_the_event(db: str) -> None:
    def handle_inline(event: Event) -> None:
        raise RuntimeError("still broken")

    row, worker = await _once(db, handle_inline, max_attempts=1)
    assert row["state"] == "failed" and row["last_error"] == "RuntimeError: still broken"
    assert worker.stats.failed == 1


@pytest.mark.parametrize(("signal", "state", "attempts"), [
    (RetryAfter(20, "later"), "pending", 1),
    (Snooze(20), "pending", 0),
    (PermanentFailure("no such customer"), "failed", 1),
    (Cancel("withdrawn"), "cancelled", 1),
], ids=["retry_after", "snooze", "permanent", "cancel"])
async def test_inline_signals_mean_what_they_mean_in_a_task(db: str, signal: BaseException,
                                                            state: str, attempts: int) -> None:
    def handle_inline(event: Event) -> None:
        raise signal

    row, _ = await _once(db, handle_inline, max_attempts=5)
    assert (row["state"], row["attempts"]) == (state, attempts)
    if state == "pending":
        due = (row["run_at"] - row["updated_at"]).total_seconds()
        assert 19.0 < due <= 20.5, due


async def test_a_running_worker_drains_inline_and_async_handlers_together(db: str) -> None:
    seen: list[tuple[str, int]] = []

    hosts: set[str] = set()

    def handle_inline(event: Event) -> None:
        # Called on the loop's thread, outside any task of its own: from a loop
        # callback (no current task) or from the fetch loop's task.
        asyncio.get_running_loop()
        task = asyncio.current_task()
        hosts.add(task.get_coro().__qualname__ if task is not None else "-")  # type: ignore[union-attr]
        seen.append(("inline", event.id))

    async def handle_async(event: Event) -> None:
        await asyncio.sleep(0)
        seen.append(("async", event.id))

    router = router_for("in.*", handle_inline, blocking=False)
    router.add("as.*", handle_async)
    worker = Worker(db, router, fast_config(batch_size=50, concurrency=100))
    ids = await enqueue_many(db, [NewEvent(topic="in.x" if i % 2 else "as.x") for i in range(400)])
    async with running(worker):
        final = await wait_all_in(db, {"succeeded"}, timeout=20)
    assert set(final) == set(ids)
    assert sorted(i for _, i in seen) == sorted(ids)     # each ran once
    assert sum(1 for kind, _ in seen if kind == "inline") == 200
    assert "Worker._execute" not in hosts, hosts
    assert worker.stats.succeeded == 400
    # Nothing was handed back or left running at the stop.
    assert worker.stats.handed_back == 0
    assert set((await states(db)).values()) == {"succeeded"}
