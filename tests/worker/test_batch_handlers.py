"""Batch handlers (``Router.add(..., batch=True)``): one call for a route's events of
one claim, one result per event, against a real database and a real worker."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conveyor import (
    Cancel,
    ConfigError,
    NewEvent,
    PermanentFailure,
    RetryAfter,
    Router,
    Snooze,
    Worker,
)
from conveyor.middleware import HandlerResult
from conveyor.types import Event
from conveyor.worker.running import RunningSet
from waiting import wait_until
from worker_support import FAST_BACKOFF, enqueue_many, fast_config, query, running, wait_all_in


@pytest.fixture
def db(fresh_db: str) -> str:
    return fresh_db


def _events(n: int, topic: str = "sync.row") -> list[NewEvent]:
    return [NewEvent(topic=topic, payload={"n": i}, max_attempts=2) for i in range(n)]


async def test_a_batch_handler_gets_a_claims_events_at_once_and_answers_per_event(
        db: str) -> None:
    calls: list[list[int]] = []

    async def handle(events: list[Event]) -> list[BaseException | None]:
        calls.append([e.payload["n"] for e in events])
        answers: list[BaseException | None] = []
        for e in events:
            n = e.payload["n"]
            if n % 5 == 1 and e.attempt == 1:
                answers.append(RetryAfter(0.01, "busy"))
            elif n % 5 == 2:
                answers.append(PermanentFailure("no such row"))
            elif n % 5 == 3:
                answers.append(Cancel("obsolete"))
            elif n % 5 == 4 and e.attempt == 1:
                answers.append(ValueError(f"bad row {n}"))
            else:
                answers.append(None)
        return answers

    router = Router()
    router.add("sync.*", handle, batch=True, backoff=FAST_BACKOFF)
    ids = await enqueue_many(db, _events(50))
    async with running(Worker(db, router, fast_config(concurrency=50, batch_size=25))):
        states = await wait_all_in(db, {"succeeded", "failed", "cancelled"}, timeout=15)
    assert max(len(c) for c in calls) > 1                 # events came together
    assert sorted(n for c in calls for n in c if True) == sorted(
        [n for n in range(50)] + [n for n in range(50) if n % 5 in (1, 4)])  # retries came back
    by_n = {row["n"]: row for row in await query(
        db, "SELECT (payload->>'n')::int AS n, state, attempts, last_error FROM conveyor.events")}
    assert len(states) == len(ids) == 50
    for n, row in by_n.items():
        expected = {0: ("succeeded", 1), 1: ("succeeded", 2), 2: ("failed", 1),
                    3: ("cancelled", 1), 4: ("succeeded", 2)}[n % 5]
        assert (row["state"], row["attempts"]) == expected, (n, row)
    assert by_n[2]["last_error"] == "no such row"
    assert by_n[4]["last_error"] == "ValueError: bad row 4"


async def test_a_batch_handler_that_raises_or_returns_nonsense_fails_every_event_of_it(
        db: str) -> None:
    async def raises(events: list[Event]) -> None:
        raise RuntimeError(f"warehouse down ({len(events)} rows)")

    async def nonsense(events: list[Event]) -> list[Any]:
        return ["ok"] * len(events)

    async def short(events: list[Event]) -> list[None]:
        return [None] * (len(events) - 1)

    router = Router()
    router.add("a.*", raises, batch=True)
    router.add("b.*", nonsense, batch=True)
    router.add("c.*", short, batch=True)
    await enqueue_many(db, [NewEvent(topic=f"{t}.x", payload=i, max_attempts=1)
                            for t in "abc" for i in range(4)])
    async with running(Worker(db, router, fast_config(batch_size=20, concurrency=20))):
        await wait_all_in(db, {"failed"}, timeout=10)
    rows = await query(db, "SELECT topic, last_error FROM conveyor.events ORDER BY id")
    for row in rows:
        if row["topic"] == "a.x":
            assert row["last_error"].startswith("RuntimeError: warehouse down (")
        elif row["topic"] == "b.x":
            assert row["last_error"] == ("batch handler of b.* returned 4 items for 4 events: "
                                         "expected None or one None-or-exception per event")
        else:
            assert row["last_error"] == ("batch handler of c.* returned 3 items for 4 events: "
                                         "expected None or one None-or-exception per event")


async def test_a_batch_past_its_timeout_fails_every_event_and_the_worker_goes_on(
        db: str) -> None:
    async def slow(events: list[Event]) -> None:
        await asyncio.sleep(30)

    async def quick(events: list[Event]) -> None:
        return None

    router = Router()
    router.add("slow.*", slow, batch=True, timeout=0.3)
    router.add("quick.*", quick, batch=True)
    await enqueue_many(db, [NewEvent(topic="slow.x", payload=i, max_attempts=1)
                            for i in range(3)] + [NewEvent(topic="quick.x", payload=1)])
    async with running(Worker(db, router, fast_config())):
        states = await wait_all_in(db, {"failed", "succeeded"}, timeout=30)
    assert sorted(states.values()) == ["failed"] * 3 + ["succeeded"]
    rows = await query(db, "SELECT last_error FROM conveyor.events WHERE topic = 'slow.x'")
    assert {r["last_error"] for r in rows} == {"batch handler timed out after 0.3s"}


async def test_middleware_sees_each_event_of_a_batch(db: str) -> None:
    seen: list[tuple[str, int, str]] = []

    class Recorder:
        def before(self, event: Event) -> None:
            seen.append(("before", event.id, ""))

        def after(self, event: Event, result: HandlerResult) -> None:
            seen.append(("after", event.id, result.state.value))

    async def handle(events: list[Event]) -> list[BaseException | None]:
        return [None if e.payload % 2 else Snooze(60) for e in events]

    router = Router()
    router.add("m.*", handle, batch=True)
    ids = await enqueue_many(db, [NewEvent(topic="m.x", payload=i) for i in range(6)])
    async with running(Worker(db, router, fast_config(batch_size=10), middleware=[Recorder()])):
        # Waited for, not slept for: the events start pending, so waiting for
        # 'succeeded or pending' alone returned at once and left 0.2 s for the batch.
        async def all_after() -> bool:
            return sum(kind == "after" for kind, _, _ in seen) >= len(ids)
        await wait_until(all_after, timeout=30, what="the middleware's after() for every event")
    befores = [i for kind, i, _ in seen if kind == "before"]
    afters = {i: state for kind, i, state in seen if kind == "after"}
    assert sorted(befores) == ids
    assert afters == {i: ("succeeded" if n % 2 else "pending") for n, i in enumerate(ids)}


async def test_losing_one_events_lease_leaves_its_batch_running_for_the_others() -> None:
    slots = RunningSet(10)
    a, b = (Event(id=i, topic="t", payload_text="{}") for i in (1, 2))
    slots.take([a, b])
    task = asyncio.ensure_future(asyncio.sleep(10))
    for running_ in slots.entries.values():
        running_.task = task
    assert slots.lose([(1, 1)], keep=set()) == 1
    await asyncio.sleep(0)
    assert not task.cancelled()                    # event 2 still needs the call
    assert slots.lose([(2, 1)], keep=set()) == 1
    await asyncio.sleep(0)
    assert task.cancelled()


def test_a_batch_route_must_be_async_and_stores_no_results() -> None:
    router = Router()
    with pytest.raises(ConfigError, match=r"^batch handler for 'x' must be an async def taking "
                                          r"a list of events, got <function"):
        router.add("x", lambda events: None, batch=True)

    async def handle(events: list[Event]) -> None:
        return None

    with pytest.raises(ConfigError, match=r"^route 'y': a batch handler's results are not "
                                          r"stored"):
        router.add("y", handle, batch=True, store_result=True)
    assert router.add("z", handle, batch=True).batch


async def test_a_batch_still_running_at_shutdown_is_handed_back_whole(db: str) -> None:
    started = asyncio.Event()

    async def stuck(events: list[Event]) -> None:
        started.set()
        await asyncio.sleep(60)

    router = Router()
    router.add("s.*", stuck, batch=True)
    await enqueue_many(db, [NewEvent(topic="s.x", payload=i) for i in range(5)])
    async with running(Worker(db, router, fast_config(shutdown_timeout=0.3))):
        await asyncio.wait_for(started.wait(), 30)
    rows = await query(db, "SELECT state, attempts FROM conveyor.events")
    assert rows == [{"state": "pending", "attempts": 0}] * 5


class _Counting:
    """A middleware that only counts: its presence takes the per-event hook path."""

    def __init__(self) -> None:
        self.seen = 0

    def before(self, event: Event) -> None:
        return None

    def after(self, event: Event, result: HandlerResult) -> None:
        self.seen += 1


async def test_a_batch_handler_that_changes_its_list_still_answers_for_every_event(
        db: str) -> None:
    # Adversary finding N1: the handler got the very list its results were
    # zipped with, so emptying or shrinking it left events without an outcome,
    # `running` for good (and a KeyError with middleware).
    async def pops(events: list[Event]) -> None:
        while events:
            events.pop()            # consumed them all, then "every event succeeded"

    async def clears(events: list[Event]) -> list[None]:
        events.clear()
        return [None for _ in events]

    async def shrinks(events: list[Event]) -> list[None]:
        events[:] = events[:2]
        return [None for _ in events]

    router = Router()
    router.add("p.*", pops, batch=True, backoff=FAST_BACKOFF)
    router.add("c.*", clears, batch=True, backoff=FAST_BACKOFF)
    router.add("s.*", shrinks, batch=True, backoff=FAST_BACKOFF)
    await enqueue_many(db, [NewEvent(topic=f"{t}.x", payload=i, max_attempts=2)
                            for t in "pcs" for i in range(4)])
    hooks = _Counting()
    async with running(Worker(db, router, fast_config(batch_size=20, concurrency=20),
                              middleware=[hooks])) as task:
        await wait_all_in(db, {"succeeded", "failed"}, timeout=15)
        assert not task.done()
    rows = await query(db, "SELECT topic, state, attempts, last_error FROM conveyor.events "
                           "ORDER BY id")
    by_topic: dict[str, set[tuple[str, int, str | None]]] = {}
    for row in rows:
        by_topic.setdefault(row["topic"], set()).add(
            (row["state"], row["attempts"], row["last_error"]))
    assert by_topic["p.x"] == {("succeeded", 1, None)}
    # Each retry comes back in a batch of its own (or with its neighbours):
    # whatever the size, an emptied list answers with no item at all.
    [(state, attempts, error)] = by_topic["c.x"]
    assert (state, attempts) == ("failed", 2)
    assert error.startswith("batch handler of c.* returned 0 items for ")
    shrunk = by_topic["s.x"]
    assert {(s, a) for s, a, _ in shrunk} <= {("failed", 2), ("succeeded", 1), ("succeeded", 2)}
    assert any(e and e.startswith("batch handler of s.* returned 2 items for ") for _, _, e in shrunk)
    assert hooks.seen >= 12


async def test_a_batch_handler_whose_results_raise_part_way_fails_each_event_and_parks_it(
        db: str) -> None:
    async def generator(events: list[Event]) -> Any:
        def answers() -> Any:
            yield None
            raise ValueError("generator broke mid-way")
        return answers()

    class Unlistable:
        def __iter__(self) -> Any:
            raise KeyboardInterrupt

    async def unlistable(events: list[Event]) -> Any:
        return Unlistable()

    router = Router()
    router.add("g.*", generator, batch=True, backoff=FAST_BACKOFF)
    router.add("u.*", unlistable, batch=True, backoff=FAST_BACKOFF)
    await enqueue_many(db, [NewEvent(topic=f"{t}.x", payload=i, max_attempts=2)
                            for t in "gu" for i in range(3)])
    async with running(Worker(db, router, fast_config(batch_size=20, concurrency=20))) as task:
        await wait_all_in(db, {"failed"}, timeout=15)
        assert not task.done()
    rows = await query(db, "SELECT topic, attempts, last_error FROM conveyor.events ORDER BY id")
    for row in rows:
        assert row["attempts"] == 2, row
        if row["topic"] == "g.x":
            assert row["last_error"] == ("batch handler of g.* returned a generator that raised "
                                         "ValueError: generator broke mid-way"), row
        else:
            assert row["last_error"] == ("batch handler of u.* returned an Unlistable that "
                                         "raised KeyboardInterrupt"), row


async def test_a_batch_handler_that_empties_its_list_and_hangs_still_times_out(db: str) -> None:
    async def hangs(events: list[Event]) -> None:
        events.clear()
        await asyncio.sleep(30)

    router = Router()
    router.add("h.*", hangs, batch=True, timeout=0.3)
    await enqueue_many(db, [NewEvent(topic="h.x", payload=i, max_attempts=1) for i in range(3)])
    async with running(Worker(db, router, fast_config())):
        await wait_all_in(db, {"failed"}, timeout=10)
    rows = await query(db, "SELECT last_error FROM conveyor.events")
    assert {r["last_error"] for r in rows} == {"batch handler timed out after 0.3s"}
