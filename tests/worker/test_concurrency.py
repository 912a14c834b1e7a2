"""Slots and races: a worker claims only what it can run; events run exactly once."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

import psycopg

from conveyor import Event, NewEvent, Router, Worker
from waiting import wait_until
from worker_support import enqueue, enqueue_many, event_row, fast_config, query, running, states, wait_all_in


async def _drain_sampling(url: str, **config: Any) -> tuple[int, list[int]]:
    """Drain 10 slow events; returns the handler peak and samples of running rows."""
    active = 0
    peak = 0

    async def handle(event: Event) -> None:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        try:
            await asyncio.sleep(0.25)
        finally:
            active -= 1

    router = Router()
    router.add("slow.job", handle)
    worker = Worker(url, router, fast_config(concurrency=3, batch_size=10, **config))
    await enqueue_many(url, [NewEvent(topic="slow.job") for _ in range(10)])
    samples: list[int] = []

    async def sample() -> None:
        while True:
            rows = await query(url, "SELECT count(*) AS n FROM conveyor.events "
                                    "WHERE state = 'running'")
            samples.append(rows[0]["n"])
            await asyncio.sleep(0.005)

    sampler = asyncio.create_task(sample())
    try:
        async with running(worker):
            await wait_all_in(url, {"succeeded"}, timeout=10)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    assert len(samples) > 20
    return peak, samples


async def test_never_more_handlers_at_once_than_concurrency(db: str) -> None:
    peak, samples = await _drain_sampling(db)
    assert peak == 3, f"handlers at once peaked at {peak}"
    assert 3 in samples


async def test_never_more_running_rows_than_concurrency(db: str) -> None:
    # A slot is held until the result is acknowledged, not merely until the handler
    # returns; a wide ack_interval makes any early release show up in the samples.
    _peak, samples = await _drain_sampling(db, ack_interval=0.1)
    assert max(samples) <= 3, f"running rows peaked at {max(samples)}"


async def test_run_once_claims_no_more_than_free_slots(db: str) -> None:
    async def handle(event: Event) -> None:
        pass

    router = Router()
    router.add("job", handle)
    await enqueue_many(db, [NewEvent(topic="job") for _ in range(10)])
    worker = Worker(db, router, fast_config(concurrency=3, batch_size=10))
    try:
        assert await worker.run_once() == 3
        assert Counter((await states(db)).values()) == {"succeeded": 3, "pending": 7}
    finally:
        await worker.close()


async def test_many_workers_drain_every_event_exactly_once(db: str) -> None:
    total = 2000
    calls: list[tuple[str, int]] = []

    def make_handler(name: str):  # type: ignore[no-untyped-def]
        async def handle(event: Event) -> None:
            calls.append((name, event.id))
            await asyncio.sleep(0)
        return handle

    workers = []
    for n in range(4):
        router = Router()
        router.add("race.*", make_handler(f"w{n}"))
        workers.append(Worker(db, router,
                              fast_config(concurrency=25, batch_size=25, poll_interval=0.1)))
    async with contextlib.AsyncExitStack() as stack:
        for worker in workers:
            await stack.enter_async_context(running(worker))
        # Every worker is up and listening before the events exist: one started
        # early could otherwise drain them all while the others connect.
        ids = await enqueue_many(db, [NewEvent(topic="race.run", payload={"n": n})
                                            for n in range(total)])
        final = await wait_all_in(db, {"succeeded"}, timeout=40)
    per_event = Counter(event_id for _, event_id in calls)
    assert set(per_event) == set(ids)
    duplicates = {event_id: n for event_id, n in per_event.items() if n != 1}
    assert duplicates == {}
    assert len(calls) == total
    assert set(final) == set(ids) and set(final.values()) == {"succeeded"}
    rows = await query(db, "SELECT count(*) AS n FROM conveyor.events WHERE attempts <> 1")
    assert rows[0]["n"] == 0
    assert sum(w.stats.succeeded for w in workers) == total
    assert sum(1 for w in workers if w.stats.claimed) >= 2, "only one worker ever claimed"


async def test_a_row_locked_by_an_operator_does_not_stall_the_other_acknowledgements(
        db: str) -> None:
    # An operator left a transaction open holding a lock on one running event
    # (psql: BEGIN; SELECT ... FOR UPDATE). That event cannot be acknowledged
    # until the lock goes, but every other event must keep flowing.
    gate = asyncio.Event()

    async def handle(event: Event) -> None:
        if event.topic == "lock.held":
            await asyncio.wait_for(gate.wait(), 10)

    router = Router()
    router.add("lock.*", handle)
    worker = Worker(db, router, fast_config(concurrency=5, lease_ttl=5, heartbeat_interval=1))
    locker = await psycopg.AsyncConnection.connect(db)
    try:
        async with running(worker):
            held = await enqueue(db, "lock.held")

            async def claimed() -> bool:
                return (await event_row(db, held))["state"] == "running"
            await wait_until(claimed, timeout=20, what="the locked event to be claimed")
            await locker.execute("SELECT id FROM conveyor.events WHERE id = %s FOR UPDATE",
                                 (held,))
            gate.set()                       # its result now waits on the lock
            await asyncio.sleep(0.1)
            others = await enqueue_many(db, [NewEvent(topic="lock.free") for _ in range(5)])

            async def others_done() -> bool:
                current = await states(db)
                return all(current[i] == "succeeded" for i in others)
            try:
                await wait_until(others_done, timeout=20,
                                 what="unrelated events to be acknowledged")
            finally:
                await locker.rollback()
    finally:
        gate.set()
        await locker.close()
    assert (await event_row(db, held))["state"] == "succeeded"
