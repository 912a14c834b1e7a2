"""LISTEN/NOTIFY wake-ups: with a 30 s poll, only notifications and timers can explain speed."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from conveyor import BackoffPolicy, Event, NewEvent, RetryAfter, Router, Snooze, Worker
from waiting import wait_until
from worker_support import enqueue, enqueue_many, event_row, fast_config, running

SLOW_POLL = 30.0
# The bound on a wake-up: far under the poll, so only the NOTIFY or the worker's own
# due-time timer explains it, yet room for a loaded machine (where a fixed 0.5 s
# bound failed). The lower bounds (not before due) are exact: load only delays.
WAKE_BOUND = SLOW_POLL / 3


def _timed_router(pattern: str, starts: dict[str, list[float]], signal: Any = None) -> Router:
    async def handle(event: Event) -> None:
        starts.setdefault(event.topic, []).append(time.time())
        if signal is not None and event.attempt == 1 and len(starts[event.topic]) == 1:
            raise signal

    router = Router()
    router.add(pattern, handle)
    return router


async def _idle(worker: Worker) -> None:
    """Let the first claim come back empty so the fetch loop is parked in its poll wait.

    The listener must be connected too: a NOTIFY sent before its LISTEN is gone.
    The fetch loop holds the wake gate once a claim came back short, just
    before it waits (worker/wake_hold.py): from then on every enqueue wakes it.
    """
    await asyncio.wait_for(worker.listener.connected.wait(), 10)

    async def waiting() -> bool:
        return worker.claims.hold.gate.whole and worker.stats.last_empty_claim_at > 0
    await wait_until(waiting, timeout=10, what="the fetch loop waiting, the wake gate held")
    assert worker.stats.claimed == 0


async def _wait_calls(starts: dict[str, list[float]], topic: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(starts.get(topic, [])) < n:
        if time.monotonic() > deadline:
            pytest.fail(f"{topic}: {len(starts.get(topic, []))} of {n} handler calls "
                        f"within {timeout}s")
        await asyncio.sleep(0.01)


async def test_notify_wakes_an_idle_worker_at_once(db: str) -> None:
    starts: dict[str, list[float]] = {}
    worker = Worker(db, _timed_router("mail.*", starts), fast_config(poll_interval=SLOW_POLL))
    async with running(worker):
        await _idle(worker)
        for _ in range(3):
            # Counted before enqueueing: the handler may well start before the
            # producer's connection has even closed.
            wanted = len(starts.get("mail.send", [])) + 1
            sent = time.time()
            await enqueue(db, "mail.send")
            await _wait_calls(starts, "mail.send", wanted, WAKE_BOUND)
            assert starts["mail.send"][-1] - sent < WAKE_BOUND
    assert worker.listener.notifications >= 3


async def test_delayed_event_runs_when_due_not_before_and_not_at_next_poll(db: str) -> None:
    starts: dict[str, list[float]] = {}
    worker = Worker(db, _timed_router("mail.*", starts), fast_config(poll_interval=SLOW_POLL))
    async with running(worker):
        await _idle(worker)
        sent = time.time()
        event_id = await enqueue(db, "mail.later", delay=1.0)
        await _wait_calls(starts, "mail.later", 1, 1.0 + WAKE_BOUND)
    row = await event_row(db, event_id)
    started = starts["mail.later"][0]
    assert started >= row["run_at"].timestamp()           # not before it is due
    assert 0.95 <= started - sent < 1.0 + WAKE_BOUND       # and not at the 30 s poll
    assert row["state"] == "succeeded"


async def test_each_of_two_delayed_events_runs_at_its_own_due_time(db: str) -> None:
    starts: dict[str, list[float]] = {}
    worker = Worker(db, _timed_router("mail.*", starts), fast_config(poll_interval=SLOW_POLL))
    async with running(worker):
        await _idle(worker)
        sent = time.time()
        # 3.6 s apart: the first must run at its own time, before the second is due,
        # with room for a loaded machine to be late.
        await enqueue(db, "mail.second", delay=4.0)
        await enqueue(db, "mail.first", delay=0.4)
        await _wait_calls(starts, "mail.first", 1, 4.0)
        await _wait_calls(starts, "mail.second", 1, 4.0 + WAKE_BOUND)
    assert 0.35 <= starts["mail.first"][0] - sent < 3.9
    assert 3.95 <= starts["mail.second"][0] - sent < 4.0 + WAKE_BOUND


@pytest.mark.parametrize("signal", [None, RetryAfter(0.3), Snooze(0.3)],
                         ids=["backoff", "retry_after", "snooze"])
async def test_retry_runs_when_due_without_waiting_for_a_poll(db: str,
                                                             signal: Any) -> None:
    starts: dict[str, list[float]] = {}
    raised = signal if signal is not None else RuntimeError("first attempt fails")
    config = fast_config(poll_interval=SLOW_POLL,
                         backoff=BackoffPolicy(base_delay=0.3, max_delay=0.3, jitter=0))
    worker = Worker(db, _timed_router("job.*", starts, raised), config)
    async with running(worker):
        await _idle(worker)
        await enqueue(db, "job.flaky")
        await _wait_calls(starts, "job.flaky", 2, 0.3 + WAKE_BOUND)
    first, second = starts["job.flaky"]
    assert 0.25 <= second - first < 0.3 + WAKE_BOUND


@pytest.mark.parametrize("signal", [RetryAfter(0), Snooze(0)], ids=["retry_after", "snooze"])
async def test_zero_delay_retry_runs_again_at_once(db: str, signal: Any) -> None:
    starts: dict[str, list[float]] = {}
    worker = Worker(db, _timed_router("job.*", starts, signal),
                    fast_config(poll_interval=SLOW_POLL))
    async with running(worker):
        await _idle(worker)
        await enqueue(db, "job.flaky")
        await _wait_calls(starts, "job.flaky", 2, WAKE_BOUND)
    first, second = starts["job.flaky"]
    assert second - first < WAKE_BOUND


async def test_delayed_event_runs_on_time_when_the_worker_clock_is_slightly_ahead(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Worker and database on different hosts: NTP keeps clocks within tens of
    # milliseconds, not exactly together. A worker 50 ms ahead must not fire its
    # timer before the database considers the event due and then give up until
    # the next poll.
    import conveyor.worker.accounting as accounting_module

    skewed = SimpleNamespace(time=lambda: time.time() + 0.05, monotonic=time.monotonic)
    # Where the worker reads the wall clock to time a retry (the retry's timer).
    monkeypatch.setattr(accounting_module, "time", skewed)
    starts: dict[str, list[float]] = {}
    worker = Worker(db, _timed_router("mail.*", starts), fast_config(poll_interval=SLOW_POLL))
    async with running(worker):
        await _idle(worker)
        sent = time.time()
        await enqueue(db, "mail.later", delay=0.5)
        await _wait_calls(starts, "mail.later", 1, 0.5 + WAKE_BOUND)
    assert starts["mail.later"][0] - sent < 0.5 + WAKE_BOUND


async def test_many_far_future_events_do_not_delay_a_near_one(db: str) -> None:
    # A reminder system: ten thousand events scheduled for tomorrow, each
    # announced by its own NOTIFY. A new event due in half a second must still
    # run on time rather than at the next poll.
    starts: dict[str, list[float]] = {}
    worker = Worker(db, _timed_router("remind.*", starts), fast_config(poll_interval=SLOW_POLL))
    async with running(worker):
        await _idle(worker)
        # One statement, 10,000 distinct topics: it sends one NOTIFY per topic.
        await enqueue_many(db, [NewEvent(topic=f"remind.user-{g}", payload={}, delay=86_400)
                                for g in range(1, 10_001)])

        async def all_heard() -> bool:
            return worker.listener.notifications >= 10_000
        await wait_until(all_heard, timeout=60, what="the 10,000 notifications")
        sent = time.time()
        await enqueue(db, "remind.soon", delay=0.5)
        await _wait_calls(starts, "remind.soon", 1, 0.5 + WAKE_BOUND)
    assert 0.45 <= starts["remind.soon"][0] - sent < 0.5 + WAKE_BOUND
