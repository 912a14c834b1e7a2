"""Workers firing cron schedules: each slot once across workers, catch-up, status, failures.

Time is warped here (``Worker(clock=...)``): a day of a five-minute schedule
passes in seconds, through a daylight saving change. Real processes killed
with SIGKILL are in tests/acceptance/test_cron_kill.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

import psycopg
import pytest

from cli_support import no_conveyor_env, restore_logging  # noqa: F401 - autouse fixtures
from conveyor import Admin, AsyncAdmin, Event, Router, Worker
from conveyor.cli.main import main
from conveyor.cron import fire_time
from conveyor.metrics.health import health
from waiting import wait_until
from worker_support import fast_config, query, running


class Warped:
    """A clock standing at ``start`` until :meth:`go`, then ``speed`` times faster than real time."""

    def __init__(self, start: datetime, speed: float) -> None:
        self.start, self.speed = start, speed
        self.t0: float | None = None

    def go(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> datetime:
        if self.t0 is None:
            return self.start
        return self.start + timedelta(seconds=(time.monotonic() - self.t0) * self.speed)


async def _fired(url: str) -> list[tuple[str, datetime]]:
    """(key, slot) of every event the schedules enqueued, by slot: read from the events
    themselves (the slots' rows of a warped past are pruned as more than a day old)."""
    rows = await query(url, "SELECT idempotency_key, topic, payload::text AS payload"
                            " FROM conveyor.events WHERE idempotency_key LIKE 'cron:%%'")
    fired = []
    for r in rows:
        slot = fire_time(Event(id=0, topic=r["topic"], payload_text=r["payload"],
                               idempotency_key=r["idempotency_key"]))
        assert slot is not None
        fired.append((r["idempotency_key"], slot))
    return sorted(fired, key=lambda f: f[1])


async def _a_pass_since(worker: Worker, since: float) -> None:
    """Wait until the worker's scheduler completed a pass (declare, then fire) after ``since``."""
    scheduler = worker.scheduler
    assert scheduler is not None

    async def passed() -> bool:
        return scheduler.last_pass > since
    await wait_until(passed, timeout=30, what="a cron scheduler pass")


async def test_four_workers_fire_each_slot_of_a_warped_dst_day_exactly_once(db: str) -> None:
    # 25 October 2026 in Madrid has 25 hours (clocks go back at 03:00 CEST):
    # 300 five-minute slots from local midnight to midnight, one day in ~15 s.
    start = datetime(2026, 10, 24, 22, 0, tzinfo=UTC) - timedelta(seconds=1)
    clock = Warped(start, speed=6000.0)
    router = Router()
    # A catch-up of twelve warped hours (7 real seconds): a scheduler that a loaded
    # machine holds up for a few seconds still fires its slots late, not skips them.
    router.cron("*/5 * * * *", "report.build", {"kind": "5min"}, tz="Europe/Madrid",
                catch_up=12 * 3600)
    workers = [Worker(db, router, fast_config(), clock=clock) for _ in range(4)]
    built = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        for worker in workers:
            await stack.enter_async_context(running(worker))
        for worker in workers:            # every worker has declared the schedule at `start`
            await _a_pass_since(worker, built)
        clock.go()
        end = datetime(2026, 10, 25, 23, 0, tzinfo=UTC)
        # A scheduler sleeps up to a real second between passes (100 warped
        # minutes): four hours past the end leave each worker more passes.
        while clock() < end + timedelta(hours=4):
            await asyncio.sleep(0.2)
    fired = await _fired(db)
    slots = [at for _key, at in fired if at < end]
    assert len(slots) == 25 * 12 and len(set(slots)) == len(slots)
    assert slots[0] == datetime(2026, 10, 24, 22, 0, tzinfo=UTC)
    assert {b - a for a, b in pairwise(slots)} == {timedelta(minutes=5)}
    assert all(key == f"cron:report.build */5 * * * * Europe/Madrid@{at:%Y-%m-%dT%H:%M:%SZ}"
               for key, at in fired)
    assert sum(w.scheduler.fired for w in workers if w.scheduler) == len(fired)
    assert sum(w.scheduler.skipped for w in workers if w.scheduler) == 0
    # Every worker did some of the firing: no leader.
    assert sum(1 for w in workers if w.scheduler and w.scheduler.fired) >= 2


async def test_a_worker_routes_the_fired_events_and_the_handler_reads_its_slot(db: str) -> None:
    seen: list[datetime | None] = []

    async def build(event: Event) -> None:
        seen.append(fire_time(event))

    router = Router()
    router.add("tick", build)
    router.cron("* * * * * *", "tick")
    async with running(Worker(db, router, fast_config())):
        deadline = time.monotonic() + 30
        while len(seen) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    assert len(seen) >= 3
    assert all(s is not None and s.microsecond == 0 for s in seen)
    # Slots come from the database's clock, and fire within a second of it. Judged by
    # the promptest firing: a loaded machine may hold up any one pass.
    rows = await query(db, "SELECT fire_at, e.created_at FROM conveyor.cron_slots s"
                           " JOIN conveyor.events e ON e.id = s.event_id")
    lags = sorted((r["created_at"] - r["fire_at"]).total_seconds() for r in rows)
    assert lags and lags[0] < 1.5, lags


async def test_after_downtime_slots_past_the_catch_up_window_are_skipped_and_reported(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    start = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
    router = Router()
    router.cron("* * * * *", "report.build", catch_up=150)
    worker = Worker(db, router, fast_config(), clock=lambda: start)
    since = time.monotonic()   # after the worker set last_pass
    async with running(worker):
        await _a_pass_since(worker, since)
    await query(db, "UPDATE conveyor.cron_schedules SET fired_through = %s", (start,))
    # The workers were away ten minutes and a half.
    later = start + timedelta(minutes=10, seconds=30)
    with caplog.at_level(logging.WARNING, logger="conveyor.worker.scheduler"):
        worker = Worker(db, router, fast_config(), clock=lambda: later)
        since = time.monotonic()   # after the worker set last_pass
        async with running(worker):
            await _a_pass_since(worker, since)
    fired = [at for _key, at in await _fired(db)]
    assert fired == [start + timedelta(minutes=m) for m in (8, 9, 10)]
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        [info] = await AsyncAdmin().schedules(conn)
    assert (info.missed, info.last_missed_at, info.fired_through) == (7, later, later)
    assert info.next_fire_at == start + timedelta(minutes=11)
    assert "skipped 7 slot(s) older than its catch-up window of 150s" in caplog.text


async def test_status_shows_the_schedule_and_reports_it_overdue_when_no_worker_fires_it(
        db: str) -> None:
    router = Router()
    router.cron("*/10 * * * * *", "report.build", name="every ten seconds")
    worker = Worker(db, router, fast_config())
    since = time.monotonic()   # after the worker set last_pass
    async with running(worker):
        await _a_pass_since(worker, since)
    with psycopg.connect(db, autocommit=True) as conn:
        [info] = Admin().schedules(conn)
        assert (info.name, info.expression, info.topic, info.overdue) == (
            "every ten seconds", "*/10 * * * * *", "report.build", False)
        assert info.next_fire_at is not None
        # Nobody has fired it for a minute: the scheduler loops are gone.
        conn.execute("UPDATE conveyor.cron_schedules SET next_fire_at = now() - interval '1 minute'")
        [late] = Admin().schedules(conn)
        assert late.overdue and 59 < late.overdue_s < 70
        assert late.to_json()["overdue"] is True
        assert Admin().remove_schedule(conn, "every ten seconds") is True
        assert Admin().schedules(conn) == []


async def test_a_failing_pass_is_logged_retried_and_makes_the_worker_unhealthy(
        db: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    router = Router()
    router.add("report.build", lambda event: None)
    schedule = router.cron("* * * * * *", "report.build")
    calls = 0

    def broken(self: Any, fired_through: datetime, now: datetime) -> Any:
        nonlocal calls
        calls += 1
        raise RuntimeError("slot arithmetic broke")

    worker = Worker(db, router, fast_config(query_timeout=1.0))
    with caplog.at_level(logging.ERROR, logger="conveyor.worker.scheduler"):
        async with running(worker):
            assert worker.scheduler is not None
            monkeypatch.setattr(type(schedule), "due", broken)

            async def retried() -> bool:
                return calls >= 2                  # it keeps trying, a second apart
            await wait_until(retried, timeout=30, what="a second failing pass")
            assert health(worker).ok               # within its limit (2 x 1 s + 5 s)
            worker.scheduler.last_pass = time.monotonic() - 60
            unhealthy = health(worker)
    assert worker.scheduler.failures >= 2
    assert "cron scheduler pass failed; starting again in 1s" in caplog.text
    assert "RuntimeError: slot arithmetic broke" in caplog.text
    assert not unhealthy.ok and unhealthy.reason.startswith(
        "cron scheduler has not completed a pass for 6")


async def test_conveyor_status_lists_the_schedules_in_text_and_json(
        db: str, capsys: pytest.CaptureFixture[str]) -> None:
    router = Router()
    router.cron("*/10 * * * * *", "report.build", name="ten seconds")
    router.cron("0 6 * * *", "mail.digest", tz="Europe/Madrid")
    worker = Worker(db, router, fast_config())
    since = time.monotonic()   # after the worker set last_pass
    async with running(worker):
        await _a_pass_since(worker, since)
    await query(db, "UPDATE conveyor.cron_schedules SET next_fire_at = now() - interval '2 minutes',"
                    " missed = 3 WHERE name = 'ten seconds'")
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["--database-url", db, "status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("cron schedules (2):")
    digest, ten = lines[start + 1], lines[start + 2]
    # Named by default, so named once (newcomer review L4).
    assert digest.startswith("  0 6 * * * Europe/Madrid -> mail.digest, next ") \
        and digest.endswith(" UTC")
    assert ten.startswith("  ten seconds: */10 * * * * * -> report.build, next ")
    assert ", OVERDUE by 12" in ten and ten.endswith(
        "s: no running worker fires it, 3 slot(s) skipped past the catch-up window")
    assert await asyncio.to_thread(main, ["--database-url", db, "status", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["schedules"]
    assert [(s["name"], s["overdue"], s["missed"]) for s in listed] == [
        ("mail.digest 0 6 * * * Europe/Madrid", False, 0), ("ten seconds", True, 3)]
