"""Running workers follow an operator's run-time changes: flow limits and cron schedules.

The Admin side (validation, the audit log) is tests/test_admin_controls.py.
Here real workers run in this process against a committed database; every
wait is on a condition, with a deadline.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
from psycopg import sql

from conveyor import AsyncAdmin, Event, NewEvent, Router, Worker
from conveyor.notify import CONTROL_NOTIFICATION
from conveyor.worker.flow import CONTROL_REREAD_MIN, FLOW_REFRESH
from waiting import wait_until
from worker_support import CallCounter, enqueue_many, fast_config, query, running


class Gate:
    """Handlers that hold their event until released, counting how many run at once."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self.release = asyncio.Event()

    async def handle(self, event: Event) -> None:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await self.release.wait()
        finally:
            self.now -= 1


async def _admin(url: str, action: str, *args: Any, **kwargs: Any) -> Any:
    """One Admin call, committed."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return await getattr(AsyncAdmin(), action)(conn, *args, **kwargs)


async def test_a_running_worker_takes_a_raised_max_running_at_once(db: str) -> None:
    gate = Gate()
    router = Router()
    router.add("slow.job", gate.handle, max_running=1)
    await enqueue_many(db, [NewEvent(topic="slow.job", payload={"n": n}) for n in range(6)])
    worker = Worker(db, router, config=fast_config(concurrency=10))
    async with running(worker):
        async def one_running_and_found_full() -> bool:
            return gate.now == 1 and "slow.job" in worker.flow._full
        await wait_until(one_running_and_found_full, timeout=10, what="the limit of 1 reached")
        assert gate.most == 1
        await _admin(db, "set_limit", "slow.job", max_running=3, reason="catch up")

        async def three_running() -> bool:
            return gate.now == 3
        # Well within FLOW_REFRESH: each flow claim reads the limit under its lock.
        took = await wait_until(three_running, timeout=FLOW_REFRESH - 1,
                                what="three events of slow.job running")
        assert took < FLOW_REFRESH - 1
        gate.release.set()

        async def drained() -> bool:
            rows = await query(db, "SELECT count(*) AS n FROM conveyor.events "
                                   "WHERE state <> 'succeeded'")
            return rows[0]["n"] == 0
        await wait_until(drained, timeout=10, what="every event succeeded")
    assert gate.most == 3


async def test_an_override_survives_a_restart_and_a_clear_reaches_the_running_worker(
        db: str) -> None:
    router = Router()
    router.add("mail.*", lambda event: None, max_running=2)
    async with running(Worker(db, router, config=fast_config())):
        await _admin(db, "set_limit", "mail.*", max_running=7, actor="ops")
    worker = Worker(db, router, config=fast_config())     # declares max_running=2 again
    async with running(worker):
        assert [(x.pattern, x.max_running) for x in worker.flow.limits] == [("mail.*", 7)]
        [limit] = await _admin(db, "limits")
        assert (limit.max_running, limit.effective_max_running) == (2, 7)
        cleared_at = time.monotonic()
        assert await _admin(db, "clear_limit", "mail.*", actor="ops") is True

        async def declared_again() -> bool:
            return [(x.pattern, x.max_running) for x in worker.flow.limits] == [("mail.*", 2)]
        # The !control NOTIFY: the worker reads the limits at once, not at its next
        # scheduled read FLOW_REFRESH (5 s) after the last one.
        await wait_until(declared_again, timeout=FLOW_REFRESH - 1,
                         what="the worker reading the cleared limit")
        assert time.monotonic() - cleared_at < FLOW_REFRESH - 1


async def test_a_limit_on_a_pattern_no_route_declares_holds_on_a_running_worker(
        db: str) -> None:
    gate = Gate()
    router = Router()
    router.add("bulk.*", gate.handle)
    worker = Worker(db, router, config=fast_config(concurrency=10))
    async with running(worker):
        assert worker.flow.limits == []
        await _admin(db, "set_limit", "bulk.export", max_running=2)

        async def limited() -> bool:
            return [x.pattern for x in worker.flow.limits] == ["bulk.export"]
        await wait_until(limited, timeout=FLOW_REFRESH - 1, what="the worker reading the limit")
        await enqueue_many(db, [NewEvent(topic="bulk.export", payload={"n": n}) for n in range(5)]
                           + [NewEvent(topic="bulk.other", payload={})])

        async def two_and_the_other_running() -> bool:
            rows = await query(db, "SELECT topic, count(*) AS n FROM conveyor.events "
                                   "WHERE state = 'running' GROUP BY topic ORDER BY topic")
            return [(r["topic"], r["n"]) for r in rows] == [("bulk.export", 2), ("bulk.other", 1)] \
                and "bulk.export" in worker.flow._full and gate.now == 3
        await wait_until(two_and_the_other_running, timeout=10,
                         what="two bulk.export events running beside bulk.other")
        assert gate.most == 3
        await _admin(db, "clear_limit", "bulk.export")

        async def all_running() -> bool:
            return gate.now == 6
        await wait_until(all_running, timeout=10, what="every event running once unlimited")
        gate.release.set()


async def _tick_events(url: str) -> int:
    rows = await query(url, "SELECT count(*) AS n FROM conveyor.events WHERE topic = 'tick.cron'")
    return int(rows[0]["n"])


async def test_a_scheduler_follows_a_changed_disabled_and_enabled_schedule(db: str) -> None:
    router = Router()
    router.cron("0 0 1 1 *", "tick.cron", name="tick")            # once a year
    worker = Worker(db, router, config=fast_config())
    async with running(worker):
        async def declared() -> bool:
            return [s.name for s in await _admin(db, "schedules")] == ["tick"]
        await wait_until(declared, timeout=10, what="the schedule declared")
        assert await _tick_events(db) == 0
        await _admin(db, "set_schedule", "tick", "* * * * * *", reason="test")   # every second

        async def ticking() -> bool:
            return await _tick_events(db) >= 2
        await wait_until(ticking, timeout=10, what="two slots of the changed schedule fired")

        await _admin(db, "disable_schedule", "tick")
        stopped_at = await _tick_events(db)
        scheduler = worker.scheduler
        assert scheduler is not None
        since = time.monotonic()

        async def passes_later() -> bool:
            # Two seconds of a one-second schedule, and the scheduler still turning.
            return time.monotonic() - since > 2 and scheduler.last_pass > since + 2
        await wait_until(passes_later, timeout=10, what="scheduler passes after the disable")
        assert await _tick_events(db) == stopped_at
        [info] = await _admin(db, "schedules")
        assert (info.enabled, info.next_fire_at, info.overdue) == (False, None, False)

        await _admin(db, "enable_schedule", "tick")

        async def ticking_again() -> bool:
            return await _tick_events(db) >= stopped_at + 2
        await wait_until(ticking_again, timeout=10, what="the enabled schedule firing again")

    restarted = Worker(db, router, config=fast_config())          # declares "0 0 1 1 *" again
    async with running(restarted):
        before = await _tick_events(db)

        async def still_every_second() -> bool:
            return await _tick_events(db) >= before + 2
        await wait_until(still_every_second, timeout=10,
                         what="the override firing after a restart")
    [info] = await _admin(db, "schedules")
    assert (info.expression, info.expression_override) == ("0 0 1 1 *", "* * * * * *")


async def test_a_flood_of_control_notifications_is_coalesced(db: str) -> None:
    # Any role may NOTIFY: a "!control" must not cost a claim and a read of the
    # limits each (the adversary of docs/reliability.md's N11, with another word).
    router = Router()
    router.add("a.*", lambda event: None)
    worker = Worker(db, router, fast_config(poll_interval=30.0))
    claims = CallCounter(worker.claims, "claim")
    flood = 5_000
    async with running(worker):
        async def settled() -> bool:
            return worker.pauses.in_force is not None and not worker.claims.woken.is_set()
        await wait_until(settled, timeout=30, what="the worker settled")
        heard_before, claims_before = worker.listener.notifications, claims.count
        started = time.monotonic()

        def send() -> None:
            with psycopg.connect(db, autocommit=True) as conn:
                conn.execute("SET synchronous_commit = off")
                conn.execute(sql.SQL(
                    "DO $$ BEGIN FOR i IN 1..{} LOOP PERFORM pg_notify({}, {}); "
                    "COMMIT; END LOOP; END $$").format(flood, worker._q.channel,
                                                      CONTROL_NOTIFICATION))
        await asyncio.to_thread(send)

        async def all_heard() -> bool:
            return worker.listener.notifications - heard_before >= flood
        await wait_until(all_heard, timeout=30, what="the flood heard")
        elapsed = time.monotonic() - started
        made = claims.count - claims_before
    # At most one wake per CONTROL_REREAD_MIN after a read, and a few more around
    # the pause checks' own wakes.
    assert made <= elapsed / CONTROL_REREAD_MIN + elapsed / 0.5 + 3, (made, elapsed)
    assert made < flood / 10, (made, elapsed)
