"""Stale owners are fenced out; lost leases are noticed; expired leases are rescued."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import psycopg
import pytest

from conveyor import Event, Router, Worker
from waiting import wait_until
from worker_support import enqueue, event_row, fast_config, query, running

FENCED_COLUMNS = ("state", "attempts", "errors", "last_error", "run_at", "finished_at",
                  "lease_owner", "lease_expires_at", "updated_at")


def _gated_router(gate: asyncio.Event, outcome: str, calls: list[int]) -> Router:
    async def handle(event: Event) -> None:
        calls.append(event.attempt)
        await asyncio.wait_for(gate.wait(), 10)
        if outcome == "fail":
            raise RuntimeError(f"failed on attempt {event.attempt}")

    router = Router()
    router.add("fence.*", handle)
    return router


async def _claimed_by(url: str, event_id: int, worker: Worker, timeout: float = 20) -> None:
    async def owned() -> bool:
        row = await event_row(url, event_id)
        return row["state"] == "running" and row["owner"] == worker.id
    await wait_until(owned, timeout=timeout, what=f"event {event_id} claimed by {worker.id}")


async def _expire_and_rescue(url: str, event_id: int, rescuer: Worker) -> None:
    await query(url, "UPDATE conveyor.events SET lease_expires_at = now() - interval '1 second' "
                     "WHERE id = %s", (event_id,))
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        assert await rescuer.maintenance.rescue(conn) == (1, 0)


def _snapshot(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in FENCED_COLUMNS}


@pytest.mark.parametrize(("late", "winner"), [("ok", "fail"), ("fail", "ok")],
                         ids=["late_success_after_new_failure", "late_failure_after_new_success"])
async def test_late_outcome_of_a_rescued_attempt_does_not_overwrite_the_new_owner(
        db: str, late: str, winner: str) -> None:
    event_id = await enqueue(db, "fence.job", max_attempts=5)
    gate_a, gate_b = asyncio.Event(), asyncio.Event()
    gate_b.set()
    calls_a: list[int] = []
    calls_b: list[int] = []
    worker_a = Worker(db, _gated_router(gate_a, late, calls_a), fast_config())
    worker_b = Worker(db, _gated_router(gate_b, winner, calls_b), fast_config())
    run_a = asyncio.create_task(worker_a.run_once())
    try:
        await _claimed_by(db, event_id, worker_a)
        await _expire_and_rescue(db, event_id, worker_b)
        assert await worker_b.run_once() == 1
        settled_by_b = _snapshot(await event_row(db, event_id))
        gate_a.set()
        assert await asyncio.wait_for(run_a, 20) == 1
    finally:
        gate_a.set()
        await worker_a.close()
        await worker_b.close()
    assert calls_a == [1] and calls_b == [2]
    after = _snapshot(await event_row(db, event_id))
    assert after == settled_by_b
    assert after["attempts"] == 2
    assert after["state"] == ("succeeded" if winner == "ok" else "pending")
    expected_errors = 1 if winner == "ok" else 2           # the rescue's, plus B's failure
    assert len(after["errors"]) == expected_errors
    assert "lease expired" in after["errors"][0]["error"]
    assert all(e["worker"] != worker_a.id or "lease expired" in e["error"]
               for e in after["errors"])
    assert worker_a.completer.stale == 1 and worker_a.completer.acked == 0
    assert worker_a.stats.succeeded == worker_a.stats.retried == 0


async def test_late_outcome_while_the_new_owner_still_runs_leaves_it_running(
        db: str) -> None:
    event_id = await enqueue(db, "fence.job", max_attempts=5)
    gate_a, gate_b = asyncio.Event(), asyncio.Event()
    worker_a = Worker(db, _gated_router(gate_a, "ok", []), fast_config())
    worker_b = Worker(db, _gated_router(gate_b, "fail", []), fast_config())
    run_a = asyncio.create_task(worker_a.run_once())
    run_b: asyncio.Task[int] | None = None
    try:
        await _claimed_by(db, event_id, worker_a)
        await _expire_and_rescue(db, event_id, worker_b)
        run_b = asyncio.create_task(worker_b.run_once())
        await _claimed_by(db, event_id, worker_b)
        gate_a.set()
        assert await asyncio.wait_for(run_a, 20) == 1
        row = await event_row(db, event_id)
        assert row["state"] == "running" and row["owner"] == worker_b.id
        assert row["attempts"] == 2
        gate_b.set()
        assert await asyncio.wait_for(run_b, 20) == 1
    finally:
        gate_a.set()
        gate_b.set()
        await worker_a.close()
        await worker_b.close()
    row = await event_row(db, event_id)
    assert row["state"] == "pending" and row["attempts"] == 2
    assert row["last_error"] == "RuntimeError: failed on attempt 2"
    assert worker_a.completer.stale == 1


async def test_heartbeat_notices_a_lost_lease_and_cancels_the_stale_handler(
        db: str) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()
    ran: list[str] = []

    async def handle(event: Event) -> None:
        ran.append(event.topic)
        if event.topic == "lease.long":
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    router = Router()
    router.add("lease.*", handle)
    worker = Worker(db, router, fast_config(concurrency=1))
    thief = str(uuid.uuid4())
    async with running(worker):
        event_id = await enqueue(db, "lease.long")
        await asyncio.wait_for(started.wait(), 20)
        # Another worker took it over (after a rescue); its lease is long, so this
        # worker's own rescuer leaves it alone.
        await query(db, "UPDATE conveyor.events SET lease_owner = %s, "
                              "lease_expires_at = now() + interval '1 minute' WHERE id = %s",
                    (thief, event_id))
        await asyncio.wait_for(cancelled.wait(), 20)
        assert worker.stats.lost == 1
        assert worker.in_flight == 0
        # The slot came back: with concurrency 1, another event can run.
        other = await enqueue(db, "lease.short")

        async def other_done() -> bool:
            return (await event_row(db, other))["state"] == "succeeded"
        await wait_until(other_done, timeout=20, what="the next event to run in the freed slot")
    row = await event_row(db, event_id)
    # The stale worker wrote nothing: the new owner's claim stands untouched.
    assert row["state"] == "running" and row["owner"] == thief
    assert row["errors"] == [] and row["attempts"] == 1
    assert ran == ["lease.long", "lease.short"]


async def test_rescue_requeues_expired_leases_and_parks_spent_ones(db: str) -> None:
    ran: list[int] = []

    async def handle(event: Event) -> None:
        ran.append(event.id)

    router = Router()
    router.add("crash.*", handle)
    dead = str(uuid.uuid4())
    spent = await enqueue(db, "crash.spent", max_attempts=2)
    retry = await enqueue(db, "crash.retry", max_attempts=2)
    # What a worker killed mid-attempt leaves behind.
    await query(db, "UPDATE conveyor.events SET state = 'running', attempts = "
                          "CASE WHEN id = %s THEN 2 ELSE 1 END, lease_owner = %s, "
                          "lease_expires_at = now() - interval '1 second', attempted_at = now() "
                          "WHERE id IN (%s, %s)", (spent, dead, spent, retry))
    worker = Worker(db, router, fast_config(poll_interval=30))
    start = time.monotonic()
    async with running(worker):
        async def settled() -> bool:
            return ((await event_row(db, spent))["state"] == "failed"
                    and (await event_row(db, retry))["state"] == "succeeded")
        await wait_until(settled, timeout=20, what="rescue of both events")
    # The requeued event ran well before the 30 s poll: the rescue's NOTIFY woke us
    # (bounded at 20 s, not 3, for a loaded machine: still under the poll).
    assert time.monotonic() - start < 20
    assert ran == [retry]
    parked = await event_row(db, spent)
    assert parked["attempts"] == 2 and parked["finished_at"] is not None
    assert parked["lease_owner"] is None
    assert parked["last_error"].startswith("lease expired")
    assert [e["attempt"] for e in parked["errors"]] == [2]
    assert "lease expired" in parked["errors"][0]["error"]
    assert parked["errors"][0]["worker"] == dead
    rerun = await event_row(db, retry)
    assert rerun["attempts"] == 2
    assert [e["worker"] for e in rerun["errors"]] == [dead]
    assert worker.stats.rescued == 2


async def test_rescue_leaves_live_leases_alone(db: str) -> None:
    event_id = await enqueue(db, "crash.alive")
    owner = str(uuid.uuid4())
    await query(db, "UPDATE conveyor.events SET state = 'running', attempts = 1, "
                          "lease_owner = %s, lease_expires_at = now() + interval '1 minute' "
                          "WHERE id = %s", (owner, event_id))
    router = Router()
    router.add("crash.*", lambda event: None)
    worker = Worker(db, router, fast_config())
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        assert await worker.maintenance.rescue(conn) == (0, 0)
    row = await event_row(db, event_id)
    assert row["state"] == "running" and row["owner"] == owner and row["errors"] == []


async def test_reclaiming_an_event_still_running_here_keeps_the_new_attempt(
        db: str) -> None:
    # This worker's lease lapsed unnoticed (e.g. its maintenance connection was down
    # for longer than lease_ttl); the event was rescued, and this same worker
    # claims it again while attempt 1 is still running.
    gates = {1: asyncio.Event(), 2: asyncio.Event()}
    calls: list[int] = []

    async def handle(event: Event) -> None:
        calls.append(event.attempt)
        await asyncio.wait_for(gates[event.attempt].wait(), 10)

    router = Router()
    router.add("fence.*", handle)
    event_id = await enqueue(db, "fence.job", max_attempts=5)
    # Long lease, rare heartbeats: nothing but this test moves the row.
    worker = Worker(db, router, fast_config(lease_ttl=30, heartbeat_interval=20,
                                                  rescue_interval=20))
    try:
        async with running(worker):
            await _claimed_by(db, event_id, worker)
            # What a rescuer does, plus the NOTIFY that wakes this worker at once.
            await query(db, "UPDATE conveyor.events SET state = 'pending', "
                                  "lease_owner = NULL, lease_expires_at = NULL, run_at = now() "
                                  "WHERE id = %s", (event_id,))
            await query(db, "SELECT pg_notify('conveyor.events', '*')")

            async def reclaimed() -> bool:
                return calls == [1, 2]
            await wait_until(reclaimed, timeout=20, what="this worker to claim attempt 2")
            gates[1].set()                       # the stale attempt ends first ...
            await asyncio.sleep(0.2)
            gates[2].set()                       # ... then the live one succeeds

            async def succeeded() -> bool:
                return (await event_row(db, event_id))["state"] == "succeeded"
            await wait_until(succeeded, timeout=20, what="attempt 2's success to be written")
    finally:
        for gate in gates.values():
            gate.set()
    row = await event_row(db, event_id)
    assert row["attempts"] == 2 and calls == [1, 2]


async def test_heartbeats_keep_a_long_handler_leased_past_lease_ttl(db: str) -> None:
    calls: list[str] = []

    async def slow(event: Event) -> None:
        calls.append("owner")
        await asyncio.sleep(2.5)              # 2.5 x lease_ttl

    async def other(event: Event) -> None:
        calls.append("rescuer")

    router_a = Router()
    router_a.add("long.job", slow)
    router_b = Router()
    router_b.add("long.job", other)
    owner = Worker(db, router_a, fast_config(lease_ttl=1.0, heartbeat_interval=0.3))
    rescuer = Worker(db, router_b, fast_config(rescue_interval=0.2))
    async with running(owner):
        event_id = await enqueue(db, "long.job", max_attempts=5)
        await _claimed_by(db, event_id, owner)
        async with running(rescuer):
            async def done() -> bool:
                return (await event_row(db, event_id))["state"] == "succeeded"
            await wait_until(done, timeout=20, what="the long handler to succeed")
    row = await event_row(db, event_id)
    assert calls == ["owner"]
    assert row["attempts"] == 1 and row["errors"] == []
    assert rescuer.stats.rescued == 0 and owner.stats.lost == 0
