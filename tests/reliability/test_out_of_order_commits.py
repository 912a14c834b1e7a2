"""R17: producers commit out of id order (a later id becomes visible before an
earlier one): the queue never skips the late committer. Conveyor claims by
state, not by an id high-water mark, so nothing can be stepped over."""

from __future__ import annotations

import asyncio
import random

import psycopg

from conveyor import AsyncProducer, Event, Worker
from waiting import wait_until
from worker_support import router_for

from .helpers import fast_config, running

PRODUCERS = 16
ROUNDS = 12


async def test_sixteen_producers_committing_out_of_id_order_lose_nothing(fresh_db: str) -> None:
    handled: dict[int, int] = {}

    async def handle(event: Event) -> None:
        handled[event.id] = handled.get(event.id, 0) + 1

    committed: set[int] = set()
    rolled_back: set[int] = set()
    rng = random.Random(17)
    producer = AsyncProducer()

    async def produce(n: int) -> None:
        async with await psycopg.AsyncConnection.connect(fresh_db) as conn:
            for r in range(ROUNDS):
                ids = [await producer.enqueue(conn, "r17.evt", {"p": n, "r": r})
                       for _ in range(rng.randint(1, 4))]
                await asyncio.sleep(rng.uniform(0, 0.25))    # hold the ids, commit later
                if rng.random() < 0.15:
                    await conn.rollback()
                    rolled_back.update(ids)
                else:
                    await conn.commit()
                    committed.update(ids)

    worker = Worker(fresh_db, router_for("r17.*", handle),
                    fast_config(concurrency=20, batch_size=20, poll_interval=0.3))
    async with running(worker):
        await asyncio.gather(*(produce(n) for n in range(PRODUCERS)))

        async def delivered() -> bool:
            return committed <= set(handled)
        await wait_until(delivered, timeout=60, what="every committed event to run")
        await asyncio.sleep(0.5)
    ids_in_order = sorted(committed)
    print(f"\nR17: {len(committed)} committed, {len(rolled_back)} rolled back, "
          f"{len(set(handled) & committed)} delivered")
    assert set(handled) == committed
    assert not rolled_back & set(handled)
    assert all(n == 1 for n in handled.values())
    assert len(ids_in_order) > PRODUCERS * ROUNDS
