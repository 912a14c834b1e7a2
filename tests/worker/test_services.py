"""The maintenance services, each driven one pass at a time through ``run_once``.

No worker is booted and no interval waited out: each test builds the one
service, runs a pass against the real database and looks at the rows.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from conveyor.db.named_queries import queries_for
from conveyor.types import Event
from conveyor.worker import pruner as pruner_module
from conveyor.worker.backoff import Backoff
from conveyor.worker.connection import ManagedConnection
from conveyor.worker.counts import CountsFlush
from conveyor.worker.lease import DatabaseClock, Lease
from conveyor.worker.maintenance import PAUSE_CHECK_INTERVAL, PauseCheck
from conveyor.worker.pruner import PRUNE_INTERVAL, Pruner
from conveyor.worker.rescuer import Rescuer
from conveyor.worker.running import RunningSet
from conveyor.worker.service import ServiceLoop
from conveyor.worker.stats import SUCCEEDED, OutcomeTally, WorkerStats
from conveyor.worker.wakeups import PauseState
from worker_support import enqueue, event_row, fast_config, query

Q = queries_for("conveyor")


@pytest.fixture
async def conn(db: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as c:
        yield c


async def _running(url: str, owner: str, *, expired: bool = False) -> int:
    event_id = await enqueue(url, "svc.job")
    await query(url, "UPDATE conveyor.events SET state = 'running', attempts = 1, lease_owner = %s,"
                     " lease_expires_at = now() + %s::interval WHERE id = %s",
                (owner, "-1 second" if expired else "30 seconds", event_id))
    return event_id


def _event(event_id: int) -> Event:
    return Event(id=event_id, topic="svc.job", payload_text="null", attempt=1, max_attempts=3)


def test_the_backoff_doubles_within_its_bounds_and_starts_over_after_a_reset() -> None:
    backoff = Backoff.doubling(1.0, 8.0, random.Random(7))
    delays = [backoff.next_delay() for _ in range(6)]
    for delay, full in zip(delays, [1, 2, 4, 8, 8, 8], strict=True):
        assert 0.75 * full <= delay <= full       # shortened by up to 25 %, never lengthened
    backoff.reset()
    assert backoff.next_delay() <= 1.0


async def test_the_lease_renews_owned_leases_and_drops_the_lost_ones(
        db: str, conn: psycopg.AsyncConnection[Any]) -> None:
    owner, thief = str(uuid.uuid4()), str(uuid.uuid4())
    kept, stolen = await _running(db, owner), await _running(db, thief)
    running, stats = RunningSet(5), WorkerStats()
    running.take([_event(kept), _event(stolen)])
    config = fast_config(lease_ttl=60.0)
    lease = Lease(Q, config, owner, "svc", ["svc.*"], running, set, stats)
    assert lease.due_at() <= time.monotonic()
    await lease.run_once(conn)
    assert running.keys() == [(kept, 1)] and stats.lost == 1
    rows = await query(db, "SELECT lease_expires_at > now() + interval '50 seconds' AS renewed, "
                           "(SELECT count(*) FROM conveyor.workers WHERE id = %s) AS registered "
                           "FROM conveyor.events WHERE id = %s", (owner, kept))
    assert rows == [{"renewed": True, "registered": 1}]
    assert lease.due_at() > time.monotonic() + config.heartbeat_interval / 2


async def test_the_clock_measures_the_database_clock_against_this_machine(
        conn: psycopg.AsyncConnection[Any]) -> None:
    clock = DatabaseClock(Q, interval=0.3)
    await clock.run_once(conn)
    assert abs(clock.offset) < 5.0                 # same machine: a few ms at most
    assert clock.due_at() > time.monotonic()


def test_a_due_time_timer_set_by_the_clock_never_fires_early() -> None:
    # The database's clock is 2.0 s ahead of this machine's. Its reading comes
    # at the end of a round trip slowed to 0.8 s by a loaded machine: the
    # middle says 2.4, and a timer set with it would fire 0.4 s early.
    clock = DatabaseClock(Q, interval=0.3)
    clock.measured(database=1000.8 + 2.0, before=1000.0, after=1000.8)
    assert clock.offset == pytest.approx(2.4)
    assert clock.wake_offset <= 2.0
    # A quick round trip later bounds it tightly: the middle is within 5 ms.
    clock.measured(database=1010.01 + 2.0, before=1010.0, after=1010.01)
    assert clock.offset == pytest.approx(2.0, abs=0.005)
    assert 1.99 <= clock.wake_offset <= 2.0
    # A slow one after it does not undo that.
    clock.measured(database=1020.9 + 2.0, before=1020.0, after=1020.9)
    assert clock.offset == pytest.approx(2.0, abs=0.005)


def test_a_clock_set_meanwhile_is_believed_at_its_next_reading() -> None:
    clock = DatabaseClock(Q, interval=0.3)
    clock.measured(database=1002.005, before=1000.0, after=1000.01)
    # The database's clock was set 30 s back: no offset fits both readings.
    clock.measured(database=1010.8 - 28.0, before=1010.0, after=1010.8)
    assert clock.offset == pytest.approx(-27.6)
    assert clock.wake_offset == pytest.approx(-28.0)


async def test_the_counts_flush_adds_the_tally_once(
        db: str, conn: psycopg.AsyncConnection[Any]) -> None:
    await query(db, "TRUNCATE conveyor.event_counts")
    tally = OutcomeTally()
    tally.add(int(time.time() // 60 * 60), "svc.job", SUCCEEDED, 3)
    counts = CountsFlush(Q, tally, interval=0.3)
    await counts.run_once(conn)
    await counts.run_once(conn)                    # nothing left: adds nothing
    rows = await query(db, "SELECT topic, succeeded FROM conveyor.event_counts")
    assert rows == [{"topic": "svc.job", "succeeded": 3}]


async def test_the_pause_check_tells_the_pause_state_what_the_table_holds(
        db: str, conn: psycopg.AsyncConnection[Any]) -> None:
    await query(db, "DELETE FROM conveyor.pauses")
    pauses = PauseState(lambda: None)
    check = PauseCheck(Q, pauses, lanes=None)
    await check.run_once(conn)
    assert not pauses.any
    await query(db, "INSERT INTO conveyor.pauses (pattern) VALUES ('svc.*')")
    try:
        await check.run_once(conn)
        assert pauses.any and pauses.in_force is not None and ("svc.*", None) in pauses.in_force
        assert check.due_at() <= time.monotonic() + PAUSE_CHECK_INTERVAL
    finally:
        await query(db, "DELETE FROM conveyor.pauses")


async def test_the_rescuer_returns_an_expired_lease_to_pending(
        db: str, conn: psycopg.AsyncConnection[Any]) -> None:
    lost = await _running(db, str(uuid.uuid4()), expired=True)
    alive = await _running(db, str(uuid.uuid4()))
    stats = WorkerStats()
    rescuer = Rescuer(Q, interval=10.0, stats=stats)
    await rescuer.run_once(conn)
    assert (await event_row(db, lost))["state"] == "pending"
    assert (await event_row(db, alive))["state"] == "running"
    assert stats.rescued == 1
    assert time.monotonic() + 7.9 <= rescuer.due_at() <= time.monotonic() + 10.0


async def test_the_pruner_deletes_old_finished_events_and_waits_its_interval(
        db: str, conn: psycopg.AsyncConnection[Any]) -> None:
    old = await enqueue(db, "svc.done")
    await query(db, "UPDATE conveyor.events SET state = 'succeeded', attempts = 1, "
                    "finished_at = now() - interval '2 hours' WHERE id = %s", (old,))
    pruner = Pruner(Q, fast_config(retention=3600))
    assert pruner.due_at() <= time.monotonic() + 60      # the first pass within a minute
    await pruner.run_once(conn)
    assert await query(db, "SELECT id FROM conveyor.events WHERE id = %s", (old,)) == []
    assert pruner.due_at() > time.monotonic() + PRUNE_INTERVAL - 5


async def _old_succeeded(db: str, n: int) -> list[int]:
    ids = [await enqueue(db, "svc.done") for _ in range(n)]
    await query(db, "UPDATE conveyor.events SET state = 'succeeded', attempts = 1, "
                    "finished_at = now() - interval '2 hours' WHERE id = ANY(%s)", (ids,))
    return ids


async def test_a_prune_pass_deletes_for_a_slice_then_lets_the_loop_go_on(
        db: str, conn: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # The pruner shares the maintenance loop with the heartbeat: a pass of millions
    # of rows once held the leases' renewal for minutes.
    caplog.set_level(logging.INFO, logger="conveyor.worker.pruner")
    monkeypatch.setattr(pruner_module, "PRUNE_BATCH", 2)
    monkeypatch.setattr(pruner_module, "PRUNE_SLICE", 0.0)     # one batch a slice
    ids = await _old_succeeded(db, 5)
    pruner = Pruner(Q, fast_config(retention=3600))
    left = []
    for _ in range(3):
        started = time.monotonic()
        await pruner.run_once(conn)
        rows = await query(db, "SELECT id FROM conveyor.events WHERE id = ANY(%s)", (ids,))
        left.append(len(rows))
        if len(rows):
            # the rest comes after a pause no longer than the slice took
            assert pruner.due_at() <= time.monotonic() + (time.monotonic() - started)
    assert left == [3, 1, 0]
    assert pruner.due_at() > time.monotonic() + PRUNE_INTERVAL - 5
    passes = [r for r in caplog.records if getattr(r, "action", None) == "pruned"]
    assert [getattr(r, "count", None) for r in passes] == [5]      # one line for the pass


async def test_a_prune_batch_steps_past_a_row_another_transaction_holds(
        db: str, conn: psycopg.AsyncConnection[Any]) -> None:
    ids = await _old_succeeded(db, 3)
    holder = await psycopg.AsyncConnection.connect(db)
    try:
        await holder.execute("SELECT 1 FROM conveyor.events WHERE id = %s FOR UPDATE", (ids[1],))
        # The maintenance connection's own lock_timeout plays no part: this one has none.
        await asyncio.wait_for(Pruner(Q, fast_config(retention=3600)).run_once(conn), 10)
        rows = await query(db, "SELECT id FROM conveyor.events WHERE id = ANY(%s)", (ids,))
        assert [r["id"] for r in rows] == [ids[1]]
    finally:
        await holder.close()


class _Failing:
    """A pass whose statement the database refuses, until it is fixed."""

    name = "failing"
    timeout: float | None = None

    def __init__(self) -> None:
        self.broken = True
        self.passes = 0

    def due_at(self) -> float:
        return 0.0 if self.broken else float("inf")

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.passes += 1
        if self.broken:
            await conn.execute("SELECT 1 / 0")


async def test_a_service_loop_logs_a_failed_pass_and_runs_on(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="conveyor.worker.service")
    stopping = asyncio.Event()
    managed = ManagedConnection(db, "maintenance", reconnect_min=0.01, reconnect_max=0.02,
                                stopping=stopping)
    failing, clock = _Failing(), DatabaseClock(Q, interval=0.01)
    loop = ServiceLoop("maintenance", managed, [failing, clock], query_timeout=5.0)
    task = asyncio.create_task(loop.run(stopping))
    try:
        deadline = time.monotonic() + 5
        while failing.passes < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        failing.broken = False
        measured = clock.due_at()
        while clock.due_at() == measured and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert clock.due_at() > measured, "the later service never ran once the first was fixed"
    finally:
        stopping.set()
        await asyncio.wait_for(task, 5)
        await managed.close()
    assert failing.passes >= 2
    assert any(getattr(r, "action", None) == "maintenance_failed" for r in caplog.records)


async def test_the_dependency_pass_releases_then_backs_off_while_nothing_finishes(
        db: str, conn: psycopg.AsyncConnection[Any]) -> None:
    from conveyor import AsyncProducer, chain, step
    from conveyor.worker.dependencies import IDLE_INTERVAL, POLL_MAX, POLL_MIN, Dependencies
    deps = Dependencies(Q)
    await deps.run_once(conn)                    # nothing waits: the slow fallback
    assert deps.due_at() - time.monotonic() > IDLE_INTERVAL - 1
    a, b, c = step("svc.a"), step("svc.b"), step("svc.c")
    async with await psycopg.AsyncConnection.connect(db) as writer:
        ids = await AsyncProducer().enqueue_workflow(writer, chain(a, b, c))
        await writer.commit()
    deps.check_soon()                            # the !deps notification
    assert deps.due_at() == 0.0
    await query(db, "UPDATE conveyor.events SET state = 'succeeded', finished_at = now()"
                    " WHERE id = %s", (ids[a],))
    await deps.run_once(conn)
    assert (await event_row(db, ids[b]))["state"] == "pending"
    assert (await event_row(db, ids[c]))["state"] == "waiting"
    assert deps.released_total == 1
    assert deps.due_at() - time.monotonic() <= POLL_MIN
    waits = []
    for _ in range(6):                           # b runs for a long time: fewer passes
        await deps.run_once(conn)
        waits.append(round(deps.due_at() - time.monotonic(), 1))
    assert waits == sorted(waits) and waits[-1] == POLL_MAX and waits[0] >= 2 * POLL_MIN - 0.1
