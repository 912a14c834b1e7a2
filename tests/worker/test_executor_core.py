"""The executor's one call core, driven inline and in a task, without a database.

Each test hands claimed events to an :class:`Executor` over a bare
:class:`RunningSet` and reads the outcomes it passes to its sink: the same
ending must give the same outcome whichever driver ran the call.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conveyor import Event, EventState, Router
from conveyor.middleware import HandlerResult, Middleware
from conveyor.retry import BackoffPolicy
from conveyor.worker.executor import Executor, Outcome
from conveyor.worker.running import RunningSet

BACKOFF = BackoffPolicy(base_delay=5.0, max_delay=5.0, jitter=0.0)


def _event(event_id: int, topic: str, *, attempt: int = 1, max_attempts: int = 3) -> Event:
    return Event(id=event_id, topic=topic, payload_text="null", attempt=attempt,
                 max_attempts=max_attempts)


async def _run(router: Router, events: list[Event], *, middleware: Any = (),
               handler_timeout: float = 5.0) -> tuple[list[Outcome], RunningSet]:
    """Start ``events`` as a claim would, wait for their calls, return what reached the sink."""
    outcomes: list[Outcome] = []
    running = RunningSet(10)
    executor = Executor(router, running, outcomes.append, handler_timeout=handler_timeout,
                        backoff=BACKOFF, threads=2, middleware=middleware)
    try:
        running.take(events)
        executor.start(events)
        await asyncio.gather(*running.tasks(), return_exceptions=True)
    finally:
        executor.close()
    return outcomes, running


def _raise_value_error(event: Event) -> None:
    raise ValueError(f"bad payload in {event.id}")


async def _raise_value_error_async(event: Event) -> None:
    raise ValueError(f"bad payload in {event.id}")


@pytest.mark.parametrize("options", [{"blocking": False}, {"blocking": True}, {}],
                         ids=["inline", "thread", "async"])
async def test_every_driver_gives_a_raised_error_the_same_failed_attempt(
        options: dict[str, Any]) -> None:
    router = Router()
    handler = _raise_value_error_async if not options else _raise_value_error
    router.add("core.job", handler, **options)
    outcomes, _ = await _run(router, [_event(7, "core.job")])
    assert [(o.event_id, o.state, o.error, o.delay) for o in outcomes] == [
        (7, EventState.PENDING, "ValueError: bad payload in 7", 5.0)]
    assert outcomes[0].traceback is not None and "bad payload in 7" in outcomes[0].traceback


@pytest.mark.parametrize("blocking", [False, True], ids=["inline", "thread"])
async def test_a_stored_result_is_watched_whichever_driver_ran_it(blocking: bool) -> None:
    router = Router()
    router.add("core.sum", lambda event: {"sum": event.id * 2}, blocking=blocking,
               store_result=True)
    outcomes, _ = await _run(router, [_event(21, "core.sum")])
    assert [(o.state, o.result, o.watched) for o in outcomes] == [
        (EventState.SUCCEEDED, '{"sum":42}', True)]


@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
async def test_a_call_past_its_deadline_is_a_timed_out_attempt_not_a_stop(batch: bool) -> None:
    router = Router()

    async def slow(events: Any) -> None:
        await asyncio.sleep(30)

    router.add("core.slow", slow, timeout=0.05, batch=batch)
    events = [_event(1, "core.slow"), _event(2, "core.slow")]
    outcomes, running = await _run(router, events)
    what = "batch handler" if batch else "handler"
    assert sorted((o.event_id, o.state, o.error) for o in outcomes) == [
        (1, EventState.PENDING, f"{what} timed out after 0.05s"),
        (2, EventState.PENDING, f"{what} timed out after 0.05s")]
    # The timeout's cancel was taken back: the tasks ended normally, with their outcome.
    assert all(not task.cancelled() for task in running.tasks())


async def test_a_call_cancelled_from_outside_hands_on_no_outcome() -> None:
    router = Router()
    started = asyncio.Event()

    async def waits(event: Event) -> None:
        started.set()
        await asyncio.sleep(30)

    router.add("core.wait", waits)
    outcomes: list[Outcome] = []
    running = RunningSet(10)
    executor = Executor(router, running, outcomes.append, handler_timeout=30.0,
                        backoff=BACKOFF, threads=2)
    events = [_event(3, "core.wait")]
    running.take(events)
    executor.start(events)
    await asyncio.wait_for(started.wait(), 5)
    (task,) = running.tasks()
    task.cancel()                      # a stop or a lost lease: the worker decides
    await asyncio.gather(task, return_exceptions=True)
    executor.close()
    assert task.cancelled()
    assert outcomes == []


class _Recording(Middleware):
    def __init__(self, name: str, seen: list[tuple[str, Any, Any]], *, fails: bool = False) -> None:
        self.name, self.seen, self.fails = name, seen, fails

    def before(self, event: Event) -> None:
        self.seen.append((self.name, "before", event.id))

    def after(self, event: Event, result: HandlerResult) -> None:
        self.seen.append((self.name, "after", (event.id, result.state)))
        if self.fails:
            raise RuntimeError("hook bug")


@pytest.mark.parametrize("options", [{"blocking": False}, {"blocking": True}],
                         ids=["inline", "thread"])
async def test_hooks_wrap_the_call_in_order_and_a_failing_after_changes_no_outcome(
        options: dict[str, Any]) -> None:
    seen: list[tuple[str, Any, Any]] = []
    router = Router()
    router.add("core.job", _raise_value_error, **options)
    hooks = [_Recording("outer", seen, fails=True), _Recording("inner", seen)]
    outcomes, _ = await _run(router, [_event(4, "core.job")], middleware=hooks)
    assert seen == [("outer", "before", 4), ("inner", "before", 4),
                    ("inner", "after", (4, EventState.PENDING)),
                    ("outer", "after", (4, EventState.PENDING))]
    assert [(o.state, o.error) for o in outcomes] == [
        (EventState.PENDING, "ValueError: bad payload in 4")]


async def test_a_batch_call_gives_each_event_its_own_hooks_and_outcome() -> None:
    seen: list[tuple[str, Any, Any]] = []
    router = Router()

    async def half(events: list[Event]) -> list[Any]:
        return [None if e.id % 2 else ValueError(f"odd one {e.id}") for e in events]

    router.add("core.batch", half, batch=True)
    events = [_event(10, "core.batch"), _event(11, "core.batch", attempt=3, max_attempts=3)]
    outcomes, _ = await _run(router, events, middleware=[_Recording("only", seen)])
    assert seen == [("only", "before", 10), ("only", "before", 11),
                    ("only", "after", (11, EventState.SUCCEEDED)),
                    ("only", "after", (10, EventState.PENDING))]
    assert [(o.event_id, o.state) for o in outcomes] == [
        (10, EventState.PENDING), (11, EventState.SUCCEEDED)]
