"""R16: a worker whose clock is five minutes off makes no premature rescue, runs no
scheduled event early and misses none: every decision uses the database's now()."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

from conveyor import AsyncCommittingProducer, Event, Router, Worker
from waiting import wait_until

from .helpers import fast_config, query, running

SKEW = 300.0


@pytest.mark.parametrize("skew", [SKEW, -SKEW], ids=["ahead_5min", "behind_5min"])
async def test_skewed_worker_clock_changes_nothing(fresh_db: str, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture,
                                                   skew: float) -> None:
    import conveyor.worker.accounting as accounting_module
    import conveyor.worker.lease as lease_module
    import conveyor.worker.maintenance as maintenance_module
    import conveyor.worker.wakeups as wakeups_module

    # Every worker module that reads the wall clock sees this machine's, skewed.
    skewed = SimpleNamespace(time=lambda: time.time() + skew, monotonic=time.monotonic)
    for module in (accounting_module, maintenance_module, lease_module, wakeups_module):
        monkeypatch.setattr(module, "time", skewed)
    caplog.set_level(logging.WARNING, logger="conveyor.worker")
    starts: dict[int, float] = {}

    async def long(event: Event) -> None:
        starts[event.id] = time.time()
        await asyncio.sleep(3 * 1.5)            # three lease TTLs, kept alive by heartbeats

    async def quick(event: Event) -> None:
        starts[event.id] = time.time()

    router = Router()
    router.add("skew.long", long)
    router.add("skew.at", quick)
    router.add("skew.far", quick)
    # A 30 s poll: only the local timer (fed by the database clock) can run a
    # scheduled event on time.
    config = fast_config(lease_ttl=1.5, heartbeat_interval=0.4, rescue_interval=0.3,
                         poll_interval=30.0, shutdown_timeout=6.0)
    worker = Worker(fresh_db, router, config)
    async with running(worker):
        # The first heartbeat measures the offset; until it has, the worker's
        # timers would follow its own clock (a loaded machine may be slow to it).
        async def offset_measured() -> bool:
            return abs(worker.clock_offset + skew) < 5
        await wait_until(offset_measured, timeout=30, what="the clock offset to be measured")
        async with AsyncCommittingProducer(fresh_db) as producer:
            long_ids = [await producer.enqueue("skew.long") for _ in range(3)]
            at_ids = [await producer.enqueue("skew.at", delay=d) for d in (1.0, 2.0, 3.0)]
            # Due within the skew: a worker trusting its own clock ahead by 5 min runs it now.
            far_id = await producer.enqueue("skew.far", delay=SKEW / 2)

        async def all_ran() -> bool:
            return all(i in starts for i in at_ids) and all(i in starts for i in long_ids)
        await wait_until(all_ran, timeout=10, what="scheduled and long events to start")

        async def long_done() -> bool:
            rows = await query(fresh_db, "SELECT count(*) AS n FROM conveyor.events "
                                         "WHERE topic = 'skew.long' AND state = 'succeeded'")
            return rows[0]["n"] == 3
        await wait_until(long_done, timeout=15, what="the long events to succeed")
        rows = await query(fresh_db, "SELECT id, run_at, attempts, COALESCE(errors, '[]')"
                                     " AS errors, state "
                                     "FROM conveyor.events ORDER BY id")
    by_id = {r["id"]: r for r in rows}
    early = [i for i in at_ids if starts[i] < by_id[i]["run_at"].timestamp()]
    late = {i: starts[i] - by_id[i]["run_at"].timestamp() for i in at_ids}
    print(f"\nR16 skew {skew:+.0f}s: rescued {worker.stats.rescued}, lost {worker.stats.lost}, "
          f"early {len(early)}, lateness {max(late.values()):.3f}s max")
    assert worker.stats.rescued == 0 and worker.stats.lost == 0
    assert all(by_id[i]["attempts"] == 1 and by_id[i]["errors"] == [] for i in long_ids)
    assert early == []
    assert max(late.values()) < 1.0, "scheduled events ran on the timer, not at the 30 s poll"
    assert far_id not in starts and by_id[far_id]["state"] == "pending"
    warned = [r for r in caplog.records if getattr(r, "action", "") == "clock_skew"]
    assert warned, "a skew over 60 s is logged as a warning"
