"""An async handler that blocks the event loop is detected, named and reported.

Adversary finding F12: a handler calling ``time.sleep`` past the lease ran on
two workers at once and ended ``failed`` though it always succeeded, and
nothing said why. Now the worker warns, naming the event, and warns again as
an error once the block outlasts the lease.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from conveyor import Event, Worker
from waiting import wait_until
from worker_support import enqueue, fast_config, router_for, running


def _actions(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == action]


async def test_a_blocking_async_handler_is_named_and_reported_past_the_lease(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.worker")
    done: list[int] = []

    async def report_build(event: Event) -> None:
        time.sleep(1.6)  # the mistake: blocking the loop past the 1 s lease
        done.append(event.id)

    event_id = await enqueue(db, "report.build", tenant="acme")
    # No rescue during the test: the expired lease would run the event again
    # (which is the harm the watchdog reports) and block the loop a second time.
    worker = Worker(db, router_for("report.build", report_build),
                    fast_config(lease_ttl=1.0, rescue_interval=60.0))
    async with running(worker):
        async def resumed() -> bool:
            return bool(done) and bool(_actions(caplog, "loop_resumed"))
        await wait_until(resumed, timeout=10, what="the handler to finish and the loop to resume")
    warning = _actions(caplog, "loop_blocked")[0]
    assert warning.levelno == logging.WARNING
    assert warning.event_id == event_id and warning.topic == "report.build"  # type: ignore[attr-defined]
    assert warning.tenant == "acme"  # type: ignore[attr-defined]
    assert "test_loop_watchdog.py" in warning.where  # type: ignore[attr-defined]
    assert "must not block" in warning.getMessage()
    error = _actions(caplog, "loop_blocked_past_lease")[0]
    assert error.levelno == logging.ERROR and error.event_id == event_id  # type: ignore[attr-defined]
    assert error.attempt == 1  # type: ignore[attr-defined]
    assert worker.stats.loop_stalls >= 1
    assert 1.4 <= worker.stats.loop_stall_max_s <= 5


async def test_a_blocking_inline_handler_is_named_too(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.worker")
    done: list[int] = []

    def inline_sleeper(event: Event) -> None:
        time.sleep(0.8)
        done.append(event.id)

    event_id = await enqueue(db, "inline.sleep")
    worker = Worker(db, router_for("inline.sleep", inline_sleeper, blocking=False),
                    fast_config(lease_ttl=2.0))
    async with running(worker):
        async def finished() -> bool:
            return bool(done) and bool(_actions(caplog, "loop_resumed"))
        await wait_until(finished, timeout=10, what="the inline handler to finish")
    [warning] = _actions(caplog, "loop_blocked")
    assert warning.event_id == event_id  # type: ignore[attr-defined]
    assert not _actions(caplog, "loop_blocked_past_lease")


async def test_a_busy_worker_that_never_blocks_reports_nothing(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.worker")
    done: list[int] = []

    async def quick(event: Event) -> None:
        await asyncio.sleep(0.01)
        done.append(event.id)

    for _ in range(100):
        await enqueue(db, "quick")
    worker = Worker(db, router_for("quick", quick), fast_config(lease_ttl=4.0))
    async with running(worker):
        async def all_done() -> bool:
            return len(done) == 100
        await wait_until(all_done, timeout=20, what="100 quick events")
    assert not _actions(caplog, "loop_blocked")
    assert worker.stats.loop_stalls == 0
