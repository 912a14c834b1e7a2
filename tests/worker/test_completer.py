"""The completer writes a batch as soon as it has gathered, not when the interval is up."""

from __future__ import annotations

import asyncio
import time
import uuid

from claim_support import claim_params
from conveyor.db.named_queries import queries_for
from conveyor.types import EventState
from conveyor.worker.classify import Outcome
from conveyor.worker.completer import Completer
from conveyor.worker.connection import ManagedConnection
from worker_support import enqueue, query

Q = queries_for("conveyor")


async def _claimed(db: str, owner: str, count: int) -> list[int]:
    """``count`` events claimed by ``owner`` with the worker's own claim statement."""
    for n in range(count):
        await enqueue(db, "completer.job", {"n": n})
    rows = await query(db, Q["event_claim"], claim_params(limit=count, owner=owner, lease_ttl=60))
    return sorted(r["id"] for r in rows)


async def test_a_flush_waiting_for_more_outcomes_goes_once_a_batch_has_gathered(db: str) -> None:
    owner = str(uuid.uuid4())
    ids = await _claimed(db, owner, 3)
    stopping = asyncio.Event()
    conn = ManagedConnection(db, "ack", reconnect_min=0.05, reconnect_max=0.2, stopping=stopping)
    acked: list[float] = []
    # The longest interval the configuration allows: a flush that waits it out
    # is seen at once.
    completer = Completer(conn, Q, owner, flush_size=3, interval=1.0,
                          on_acked=lambda batch, done: acked.append(time.monotonic()))
    runner = asyncio.create_task(completer.run(stopping))
    try:
        completer.add(Outcome(ids[0], 1, EventState.SUCCEEDED))
        # The flusher wakes for the first outcome and starts waiting for more:
        # a few rounds of the loop, no I/O between.
        for _ in range(10):
            await asyncio.sleep(0)
        assert not acked, "one outcome of three was written without waiting"
        gathered = time.monotonic()
        completer.add(Outcome(ids[1], 1, EventState.SUCCEEDED))
        completer.add(Outcome(ids[2], 1, EventState.SUCCEEDED))
        async with asyncio.timeout(10):
            while not acked:
                await asyncio.sleep(0.01)
        # Well inside the interval (1 s) that the flush used to wait out in full.
        assert acked[0] - gathered < 0.5, f"written {acked[0] - gathered:.3f} s after the batch"
        rows = await query(db, "SELECT state FROM conveyor.events WHERE id = ANY(%s)", (ids,))
        assert [r["state"] for r in rows] == ["succeeded"] * 3
    finally:
        stopping.set()
        await asyncio.wait_for(runner, 10)
        await conn.close()
