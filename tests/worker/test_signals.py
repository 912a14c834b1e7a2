"""Handler signals: RetryAfter, Snooze, PermanentFailure and Cancel."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor import BackoffPolicy, Cancel, Event, PermanentFailure, RetryAfter, Router, Snooze, Worker
from worker_support import enqueue, event_row, fast_config, query


async def _run_once_raising(url: str, signal: BaseException, **enqueue_options: Any
                            ) -> tuple[int, Worker, int]:
    calls = 0

    async def handle(event: Event) -> None:
        nonlocal calls
        calls += 1
        raise signal

    router = Router()
    router.add("sig.test", handle)
    event_id = await enqueue(url, "sig.test", **enqueue_options)
    worker = Worker(url, router, fast_config())
    try:
        assert await worker.run_once() == 1
        # Make whatever is left due and try again: finished events stay finished.
        await query(url, "UPDATE conveyor.events SET run_at = now() WHERE id = %s", (event_id,))
        if (await event_row(url, event_id))["state"] != "pending":
            assert await worker.run_once() == 0
    finally:
        await worker.close()
    return event_id, worker, calls


async def _due_in(url: str, event_id: int) -> float:
    rows = await query(url, "SELECT extract(epoch FROM run_at - now())::float8 AS due "
                            "FROM conveyor.events WHERE id = %s", (event_id,))
    return float(rows[0]["due"])


async def test_retry_after_spends_the_attempt_and_delays_by_its_seconds(db: str) -> None:
    calls = 0

    async def handle(event: Event) -> None:
        nonlocal calls
        calls += 1
        raise RetryAfter(20, "rate limited")

    router = Router()
    router.add("sig.test", handle)
    event_id = await enqueue(db, "sig.test", max_attempts=5)
    worker = Worker(db, router, fast_config())
    try:
        assert await worker.run_once() == 1
    finally:
        await worker.close()
    row = await event_row(db, event_id)
    assert row["state"] == "pending" and row["attempts"] == 1
    assert 19.0 < await _due_in(db, event_id) <= 20.0
    assert row["last_error"] == "rate limited"
    assert [e["error"] for e in row["errors"]] == ["rate limited"]
    assert row["lease_owner"] is None


async def test_retry_after_on_the_last_attempt_parks_the_event_failed(db: str) -> None:
    event_id, _worker, calls = await _run_once_raising(db, RetryAfter(1), max_attempts=1)
    row = await event_row(db, event_id)
    assert calls == 1
    assert row["state"] == "failed" and row["attempts"] == 1
    assert row["finished_at"] is not None


async def test_snooze_refunds_the_attempt_and_delays(db: str) -> None:
    calls = 0

    async def handle(event: Event) -> None:
        nonlocal calls
        calls += 1
        raise Snooze(20)

    router = Router()
    router.add("sig.test", handle)
    event_id = await enqueue(db, "sig.test", max_attempts=1)
    worker = Worker(db, router, fast_config())
    try:
        assert await worker.run_once() == 1
        row = await event_row(db, event_id)
        assert row["state"] == "pending" and row["attempts"] == 0
        assert 19.0 < await _due_in(db, event_id) <= 20.0
        assert row["errors"] == [] and row["last_error"] is None
        assert row["lease_owner"] is None and row["finished_at"] is None
        # Snoozing a one-attempt event again and again never parks it.
        for _ in range(3):
            await query(db, "UPDATE conveyor.events SET run_at = now() WHERE id = %s",
                        (event_id,))
            assert await worker.run_once() == 1
    finally:
        await worker.close()
    row = await event_row(db, event_id)
    assert calls == 4
    assert row["state"] == "pending" and row["attempts"] == 0


async def test_permanent_failure_parks_the_event_at_once(db: str) -> None:
    event_id, worker, calls = await _run_once_raising(
        db, PermanentFailure("amount must be positive"), max_attempts=5)
    row = await event_row(db, event_id)
    assert calls == 1
    assert row["state"] == "failed" and row["attempts"] == 1 and row["max_attempts"] == 5
    assert row["last_error"] == "amount must be positive"
    assert row["finished_at"] is not None and row["lease_owner"] is None
    assert worker.stats.failed == 1


async def test_cancel_marks_the_event_cancelled_and_it_never_runs_again(db: str) -> None:
    event_id, worker, calls = await _run_once_raising(db, Cancel("order withdrawn"),
                                                      max_attempts=5)
    row = await event_row(db, event_id)
    assert calls == 1
    assert row["state"] == "cancelled" and row["attempts"] == 1
    assert row["finished_at"] is not None and row["lease_owner"] is None
    assert "order withdrawn" in row["last_error"]
    assert worker.stats.cancelled == 1


@pytest.mark.parametrize("signal", [RetryAfter(0), Snooze(0)], ids=["retry_after", "snooze"])
async def test_zero_second_signals_make_the_event_due_at_once(db: str,
                                                             signal: BaseException) -> None:
    event_id, _worker, calls = await _run_once_raising(db, signal, max_attempts=5)
    assert calls == 1
    assert await _due_in(db, event_id) <= 0
    assert (await event_row(db, event_id))["state"] == "pending"


@pytest.mark.parametrize("make_signal", [lambda: RetryAfter(float("inf")), lambda: Snooze(1e13)],
                         ids=["retry_after_inf", "snooze_huge"])
async def test_an_out_of_range_delay_does_not_lose_the_other_results_of_its_batch(
        db: str, make_signal: Any) -> None:
    # One handler asks for a delay PostgreSQL cannot represent (refused when the
    # signal is built, so that attempt fails); the failure of an unrelated event
    # acknowledged in the same batch must still be recorded.
    async def handle(event: Event) -> None:
        if event.topic == "sig.odd":
            raise make_signal()
        raise RuntimeError("an ordinary failure")

    router = Router()
    router.add("sig.*", handle)
    odd = await enqueue(db, "sig.odd", max_attempts=5)
    plain = await enqueue(db, "sig.plain", max_attempts=5)
    worker = Worker(db, router, fast_config(lease_ttl=30, heartbeat_interval=10))
    try:
        assert await worker.run_once() == 2
    finally:
        await worker.close()
    row = await event_row(db, plain)
    assert row["state"] == "pending" and row["last_error"] == "RuntimeError: an ordinary failure"
    assert (await event_row(db, odd))["state"] != "running"


async def test_a_backoff_delay_out_of_range_does_not_lose_the_other_results_of_its_batch(
        db: str) -> None:
    async def handle(event: Event) -> None:
        raise RuntimeError(f"failure of {event.topic}")

    router = Router()
    router.add("sig.huge", handle, backoff=BackoffPolicy(base_delay=1e13, max_delay=1e13))
    router.add("sig.plain", handle)
    huge = await enqueue(db, "sig.huge", max_attempts=5)
    plain = await enqueue(db, "sig.plain", max_attempts=5)
    worker = Worker(db, router, fast_config(lease_ttl=30, heartbeat_interval=10))
    try:
        assert await worker.run_once() == 2
    finally:
        await worker.close()
    row = await event_row(db, plain)
    assert row["state"] == "pending" and row["last_error"] == "RuntimeError: failure of sig.plain"
    assert (await event_row(db, huge))["state"] != "running"
