"""Failure log lines are limited per topic and outcome, and what was left out is counted.

Newcomer review M3: 14,000 failing events wrote 40,974 WARNING/ERROR lines
(7.4 MB) in about five minutes, one per failed attempt.
"""

from __future__ import annotations

import logging

import pytest

from conveyor import Event, NewEvent, Router, Worker
from conveyor.worker.failure_log import FAILURE_LOG_LIMIT_DEFAULT, FailureLogLimiter
from waiting import wait_until
from worker_support import enqueue_many, fast_config, running, states


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _summaries(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == "failures_suppressed"]


def test_a_storm_of_1000_failures_logs_a_bounded_number_of_lines_and_counts_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.worker")
    clock = FakeClock()
    limiter = FailureLogLimiter(limit=10, window=60.0, clock=clock)
    admitted = {"pay.charge": 0, "mail.send": 0}
    for i in range(1000):
        topic = "pay.charge" if i % 4 else "mail.send"
        admitted[topic] += limiter.admit(topic, "retry_scheduled")
        clock.now += 0.1                       # 1000 failures in 100 s: two windows
    limiter.flush(everything=True)
    assert admitted == {"pay.charge": 20, "mail.send": 20}
    by_topic: dict[str, int] = {}
    for record in _summaries(caplog):
        by_topic[record.topic] = by_topic.get(record.topic, 0) + record.suppressed  # type: ignore[attr-defined]
        assert record.levelno == logging.WARNING
    assert by_topic == {"pay.charge": 750 - 20, "mail.send": 250 - 20}
    assert len(_summaries(caplog)) == 4        # one per topic and window
    first = _summaries(caplog)[0]
    assert first.getMessage().startswith(f"{first.suppressed} more failed attempts of topic ")  # type: ignore[attr-defined]
    assert "suppressed in the last 60s" in first.getMessage()


def test_the_first_failure_of_each_topic_and_outcome_is_always_logged() -> None:
    clock = FakeClock()
    limiter = FailureLogLimiter(limit=1, window=60.0, clock=clock)
    assert limiter.admit("a", "retry_scheduled")
    assert not limiter.admit("a", "retry_scheduled")
    assert limiter.admit("a", "event_parked")
    assert limiter.admit("b", "retry_scheduled")


def test_a_window_that_ended_is_summed_up_at_the_next_flush_and_forgotten(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.worker")
    clock = FakeClock()
    limiter = FailureLogLimiter(limit=2, window=60.0, clock=clock)
    for _ in range(5):
        limiter.admit("pay.charge", "event_parked")
    limiter.flush()
    assert not _summaries(caplog)              # the window is still open
    clock.now += 61
    limiter.flush()
    [summary] = _summaries(caplog)
    assert summary.suppressed == 3 and summary.outcome == "event_parked"  # type: ignore[attr-defined]
    assert "3 more parked events of topic pay.charge suppressed in the last 60s" \
        in summary.getMessage()
    assert not limiter.windows                 # nothing kept for a quiet topic


def test_no_limit_logs_every_failure() -> None:
    limiter = FailureLogLimiter(limit=None, window=60.0, clock=FakeClock())
    assert all(limiter.admit("t", "retry_scheduled") for _ in range(1000))


async def test_a_worker_in_a_failure_storm_writes_the_limit_and_one_summary(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.worker")

    async def broken(event: Event) -> None:
        raise ConnectionError("smtp down")

    router = Router()
    router.add("mail.send", broken)
    await enqueue_many(db, [NewEvent(topic="mail.send", max_attempts=1) for _ in range(200)])
    async with running(Worker(db, router, fast_config(concurrency=50, batch_size=50))):
        async def all_parked() -> bool:
            return set((await states(db)).values()) == {"failed"}
        await wait_until(all_parked, timeout=30, what="200 parked events")
    parked = [r for r in caplog.records if getattr(r, "action", None) == "event_parked"]
    assert len(parked) == FAILURE_LOG_LIMIT_DEFAULT
    # The stop sums up the window still open.
    assert sum(r.suppressed for r in _summaries(caplog)) == 200 - len(parked)  # type: ignore[attr-defined]
