"""Claims grow with a backlog and shrink back when the worker has caught up.

A claim that comes back full is followed by one asking for up to twice as
many (up to the free slots and max_batch_size, by default half the slots); the first short claim goes
back to batch_size. Measured by the worker's own counters on a real drain.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from conveyor import Event, NewEvent, Worker
from waiting import wait_until
from worker_support import enqueue, enqueue_many, fast_config, router_for, running, states

BACKLOG = 1200


def _now(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    """``check`` as the coroutine function wait_until polls."""
    async def poll() -> bool:
        return check()
    return poll


async def _drain_backlog(url: str, **config: object) -> Worker:
    done: list[int] = []

    async def handle(event: Event) -> None:
        done.append(event.id)

    await enqueue_many(url, [NewEvent(topic="grow.x", payload={"i": i}) for i in range(BACKLOG)])
    worker = Worker(url, router_for("grow.*", handle),
                    fast_config(batch_size=10, concurrency=160, **config))
    async with running(worker):
        await wait_until(_now(lambda: len(done) >= BACKLOG), timeout=60, what="the backlog drained")
        await wait_until(_now(lambda: worker.stats.succeeded >= BACKLOG), timeout=10,
                         what="every success acknowledged")
    assert sorted(set(done)) == sorted(done), "no event ran twice"
    assert set((await states(url)).values()) == {"succeeded"}
    return worker


async def test_a_backlog_is_claimed_in_growing_batches(fresh_db: str) -> None:
    grown = await _drain_backlog(fresh_db)
    assert grown.stats.claimed == BACKLOG
    # 10, 20, 40, then 80 (half the 160 slots, so the next claim is sent while
    # a batch runs): far fewer statements than 120 claims of 10.
    assert grown.stats.claims <= 60, grown.stats.claims
    assert grown.stats.claimed / grown.stats.claims >= 20
    # Never a claim of all 160 slots (that would be about 110 a claim on average).
    assert grown.stats.claimed / grown.stats.claims <= 80, grown.stats.claims


async def test_max_batch_size_equal_to_batch_size_keeps_claims_fixed(fresh_db: str) -> None:
    fixed = await _drain_backlog(fresh_db, max_batch_size=10)
    assert fixed.stats.claimed == BACKLOG
    assert fixed.stats.claims >= BACKLOG // 10, fixed.stats.claims


async def test_claims_and_acknowledgements_shrink_back_once_caught_up(fresh_db: str) -> None:
    seen: list[int] = []

    async def handle(event: Event) -> None:
        seen.append(event.id)

    await enqueue_many(fresh_db, [NewEvent(topic="grow.y", payload={}) for _ in range(400)])
    worker = Worker(fresh_db, router_for("grow.*", handle),
                    fast_config(batch_size=10, concurrency=160))
    async with running(worker):
        await wait_until(_now(lambda: len(seen) >= 400), timeout=60, what="the backlog drained")
        # The drain ended with a short claim: the next claims are batch_size again.
        await wait_until(_now(lambda: worker.completer.flush_size == 10), timeout=10,
                         what="acknowledgements flushed at batch_size again")
        claims = worker.stats.claims
        one = await enqueue(fresh_db, "grow.y", {"late": True})
        await wait_until(_now(lambda: one in seen), timeout=10, what="a single late event ran")
        assert worker.stats.claims == claims + 1
        assert worker.completer.flush_size == 10
