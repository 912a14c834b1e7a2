"""The worker tells of every failed attempt while it runs, and handlers' lines carry their event.

Newcomer review H2: nothing was logged when a handler failed, was retried or
parked; the exit summary was the only trace.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from conveyor import BackoffPolicy, Event, PermanentFailure, Router, Worker
from conveyor.log_context import EventContextFilter, current_event
from waiting import wait_until
from worker_support import enqueue, fast_config, running

SLOW_RETRY = BackoffPolicy(base_delay=60, max_delay=60, jitter=0)


def _records(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == action]


async def test_a_failed_attempt_a_retry_and_a_parked_event_each_log_one_line(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="conveyor.worker")

    async def flaky(event: Event) -> None:
        raise ValueError(f"upstream said no to {event.id}")

    async def hopeless(event: Event) -> None:
        raise PermanentFailure("card declined")

    router = Router()
    router.add("pay.flaky", flaky)
    router.add("pay.hopeless", hopeless)
    flaky_id = await enqueue(db, "pay.flaky", max_attempts=3, tenant="acme")
    hopeless_id = await enqueue(db, "pay.hopeless")
    worker = Worker(db, router, fast_config(backoff=SLOW_RETRY))
    async with running(worker):
        async def both_logged() -> bool:
            return bool(_records(caplog, "retry_scheduled")) and bool(_records(caplog, "event_parked"))
        await wait_until(both_logged, timeout=5, what="the failure log lines")
    [retry] = _records(caplog, "retry_scheduled")
    assert retry.levelno == logging.WARNING
    assert (retry.event_id, retry.topic, retry.tenant, retry.attempt) == (  # type: ignore[attr-defined]
        flaky_id, "pay.flaky", "acme", 1)
    assert retry.error == f"ValueError: upstream said no to {flaky_id}"  # type: ignore[attr-defined]
    assert "retrying in 60.0s" in retry.getMessage() and "attempt 1/3" in retry.getMessage()
    [parked] = _records(caplog, "event_parked")
    assert parked.levelno == logging.ERROR and parked.event_id == hopeless_id  # type: ignore[attr-defined]
    assert "card declined" in parked.getMessage()
    # The traceback follows at debug, for the ordinary exception only.
    [trace] = _records(caplog, "attempt_traceback")
    assert trace.levelno == logging.DEBUG and "in flaky" in trace.getMessage()


async def test_successes_log_nothing_per_event(db: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="conveyor.worker")
    done: list[int] = []

    async def fine(event: Event) -> None:
        done.append(event.id)

    router = Router()
    router.add("ok", fine)
    for _ in range(5):
        await enqueue(db, "ok")
    # A long lease: a loaded machine that stalls the loop past fast_config's
    # one second had an event rescued, and the rescue logs per event.
    async with running(Worker(db, router, fast_config(lease_ttl=30.0,
                                                      heartbeat_interval=10.0))):
        async def all_done() -> bool:
            return len(done) == 5
        await wait_until(all_done, timeout=5, what="five successes")
    assert not [r for r in caplog.records if getattr(r, "event_id", None) in done]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.addFilter(EventContextFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("kind", ["async", "thread", "inline"])
async def test_a_handlers_own_log_lines_carry_its_event(db: str, kind: str) -> None:
    app_log = logging.getLogger("shop.app")
    collect = _Collect()
    app_log.addHandler(collect)
    app_log.setLevel(logging.INFO)
    seen: list[Any] = []
    try:
        if kind == "async":
            async def handler(event: Event) -> None:
                await asyncio.sleep(0)
                seen.append(current_event())
                app_log.info("charging")
        else:
            def handler(event: Event) -> None:  # type: ignore[misc]
                seen.append(current_event())
                app_log.info("charging")
        router = Router()
        router.add("shop.charge", handler, blocking=kind != "inline")
        event_id = await enqueue(db, "shop.charge", tenant="globex")
        async with running(Worker(db, router, fast_config())):
            async def logged() -> bool:
                return bool(collect.records)
            await wait_until(logged, timeout=5, what="the handler's log line")
    finally:
        app_log.removeHandler(collect)
    [record] = collect.records
    assert (record.event_id, record.topic, record.tenant, record.attempt) == (  # type: ignore[attr-defined]
        event_id, "shop.charge", "globex", 1)
    assert seen[0] is not None and seen[0].id == event_id
    # Outside a handler there is no event.
    assert current_event() is None
