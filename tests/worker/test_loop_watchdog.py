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

from conveyor import BackoffPolicy, Event, Router, Worker
from conveyor.worker.executor import Executor
from conveyor.worker.running import RunningSet
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


async def test_while_the_loop_is_stuck_each_lease_is_held_only_until_its_handlers_timeout() -> None:
    slots = RunningSet(10)
    events = {i: Event(id=i, topic="t", payload_text="{}") for i in range(1, 6)}
    slots.take(events.values())
    executor = Executor(Router(), slots, lambda outcome: None, handler_timeout=30.0,
                        backoff=BackoffPolicy(), threads=1)
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    done.set_result(None)
    running_call = loop.create_future()
    entries = slots.entries
    entries[(1, 1)].task, entries[(1, 1)].deadline = running_call, 100.0   # blocking the loop
    entries[(2, 1)].task, entries[(2, 1)].deadline = running_call, 50.0    # past its timeout
    entries[(3, 1)].task, entries[(3, 1)].deadline = done, 50.0           # decided, unwritten
    # 4: claimed, not started yet (no task); 5: acknowledged, gone.
    del entries[(5, 1)]
    # The loop's clock reads 60, stuck for 10 s: 2 is past its deadline.
    assert executor.held_during_stall(60.0, 10.0) == [1, 3, 4]
    # Stuck 35 s: what waits on the loop is held for handler_timeout (30 s) only.
    assert executor.held_during_stall(85.0, 35.0) == [1]
    assert executor.held_during_stall(101.0, 51.0) == []
    running_call.cancel()


def test_a_stall_renewal_without_room_in_the_budget_is_skipped_and_room_is_given_back(
        db: str) -> None:
    from conveyor.db.named_queries import queries_for
    from conveyor.tenancy.budget import ConnectionLedger
    from conveyor.worker.watchdog import StallLeases

    ledger = ConnectionLedger(limit=1)
    leases = StallLeases(db, queries_for("conveyor"), "00000000-0000-0000-0000-000000000001",
                         lease_ttl=5.0, query_timeout=5.0, held=lambda now, stalled: [1, 2],
                         gate=ledger)
    assert ledger.take(1)
    assert leases.renew(0.0, 2.0) == (2, 0)         # no room: no connection, no renewal
    ledger.give(1)
    assert leases.renew(0.0, 2.0) == (2, 0)         # room: renewed (none of them is held)
    assert ledger.in_use == 1
    leases.close()
    assert ledger.in_use == 0
