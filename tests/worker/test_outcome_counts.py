"""The worker adds the outcomes it wrote to event_counts (0008), by minute and topic.

What the dashboard's throughput and failure charts read: counted by the
worker as it acknowledges, written with its heartbeats and at its stop, and
never counted twice when a write fails.
"""

from __future__ import annotations

from typing import Any

import psycopg

from conveyor import Event, NewEvent, PermanentFailure, RetryAfter, Worker
from conveyor.router import Router
from conveyor.worker.stats import OutcomeTally
from waiting import wait_until
from worker_support import enqueue_many, fast_config, running


def _counts(url: str) -> dict[str, tuple[int, int, int, int]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT topic, sum(succeeded), sum(retried), sum(failed), sum(cancelled)"
                            " FROM conveyor.event_counts GROUP BY topic").fetchall()
    return {topic: (int(s), int(r), int(f), int(c)) for topic, s, r, f, c in rows}


async def test_outcomes_are_counted_by_topic_and_written_with_the_heartbeat(db: str) -> None:
    router = Router()
    tries: dict[int, int] = {}

    @router.route("count.ok")
    async def ok(event: Event) -> None:
        pass

    @router.route("count.flaky")
    async def flaky(event: Event) -> None:
        tries[event.id] = tries.get(event.id, 0) + 1
        if tries[event.id] == 1:
            raise RetryAfter(0.01, "first try fails")

    @router.route("count.bad")
    async def bad(event: Event) -> None:
        raise PermanentFailure("never works")

    await enqueue_many(db, [NewEvent(topic="count.ok", payload={}) for _ in range(57)]
                       + [NewEvent(topic="count.flaky", payload={}) for _ in range(4)]
                       + [NewEvent(topic="count.bad", payload={}) for _ in range(3)])
    worker = Worker(db, router, fast_config(heartbeat_interval=0.2))
    async with running(worker):
        async def counted() -> bool:
            return _counts(db).get("count.ok", (0,))[0] == 57 and "count.bad" in _counts(db) \
                and _counts(db).get("count.flaky", (0,))[0] == 4
        # Written while the worker runs (a heartbeat), not only at its stop.
        await wait_until(counted, timeout=20, what="the heartbeat wrote the counts")
    assert _counts(db) == {"count.ok": (57, 0, 0, 0), "count.flaky": (4, 4, 0, 0),
                           "count.bad": (0, 0, 3, 0)}
    with psycopg.connect(db) as conn:
        minutes = conn.execute("SELECT DISTINCT extract(epoch FROM minute)::bigint % 60,"
                               " minute <= now() AND minute > now() - interval '5 minutes'"
                               " FROM conveyor.event_counts").fetchall()
    assert set(minutes) == {(0, True)}, "whole minutes on the database's clock"


async def test_counts_of_a_failed_write_are_kept_for_the_next(db: str) -> None:
    async def noop(event: Event) -> None:
        pass

    router = Router()
    router.route("count.x")(noop)
    worker = Worker(db, router, fast_config())
    tally: OutcomeTally = worker.tally
    tally.add(1_700_000_040, "count.x", 0, 3)
    broken = await psycopg.AsyncConnection.connect(db, autocommit=True)
    await broken.close()
    try:
        await worker.maintenance.flush_counts(broken)
    except psycopg.Error:
        pass
    else:
        raise AssertionError("a closed connection must fail the write")
    tally.add(1_700_000_040, "count.x", 0, 2)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        await worker.maintenance.flush_counts(conn)
        await worker.maintenance.flush_counts(conn)      # nothing left: writes nothing
    assert _counts(db) == {"count.x": (5, 0, 0, 0)}
    assert not tally


def test_tally_params_are_sorted_so_concurrent_workers_lock_rows_in_one_order() -> None:
    tally = OutcomeTally()
    for minute, topic in ((120, "b"), (60, "z"), (120, "a"), (60, "a")):
        tally.add(minute, topic, 1)
    params: dict[str, Any] = OutcomeTally.params(tally.take())
    assert list(zip(params["minutes"], params["topics"], strict=True)) == [
        (60.0, "a"), (60.0, "z"), (120.0, "a"), (120.0, "b")]
    assert params["retried"] == [1, 1, 1, 1] and params["succeeded"] == [0, 0, 0, 0]
