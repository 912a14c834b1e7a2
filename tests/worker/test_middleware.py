"""Middleware: hooks around every handler call, in every handler kind, and in work_event."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from typing import Any

import psycopg
import pytest

from conveyor import (
    BackoffPolicy,
    ConfigError,
    Event,
    EventState,
    HandlerResult,
    Middleware,
    Producer,
    RetryAfter,
    Router,
    Snooze,
    Worker,
)
from conveyor.testing import work_event
from waiting import wait_until
from worker_support import enqueue, event_row, fast_config, running

SLOW = BackoffPolicy(base_delay=60, max_delay=60, jitter=0)
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class Recorder(Middleware):
    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name = name
        self.log = log

    def before(self, event: Event) -> None:
        self.log.append((self.name, "before", event.id))
        REQUEST_ID.set(f"req-{event.id}")

    def after(self, event: Event, result: HandlerResult) -> None:
        self.log.append((self.name, "after", event.id, result.state, result.error,
                         type(result.exception).__name__ if result.exception else None,
                         result.attempt_spent))
        assert result.duration >= 0


class AsyncRecorder(Recorder):
    async def before(self, event: Event) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        super().before(event)

    async def after(self, event: Event, result: HandlerResult) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        super().after(event, result)


def _router(seen: list[Any], kind: str) -> Router:
    async def async_ok(event: Event) -> None:
        seen.append(REQUEST_ID.get())

    def plain_ok(event: Event) -> None:
        seen.append(REQUEST_ID.get())

    def failing(event: Event) -> None:
        raise ValueError("nope")

    router = Router()
    if kind == "async":
        router.add("mw.ok", async_ok)
    else:
        router.add("mw.ok", plain_ok, blocking=kind == "thread")
    router.add("mw.fail", failing, blocking=kind == "thread")
    return router


@pytest.mark.parametrize("kind", ["async", "thread", "inline"])
@pytest.mark.parametrize("hooks", ["sync", "async"])
async def test_hooks_wrap_each_call_in_order_and_share_its_context(
        db: str, kind: str, hooks: str) -> None:
    log: list[tuple[Any, ...]] = []
    seen: list[Any] = []
    cls = Recorder if hooks == "sync" else AsyncRecorder
    ok = await enqueue(db, "mw.ok")
    bad = await enqueue(db, "mw.fail", max_attempts=1)
    worker = Worker(db, _router(seen, kind), fast_config(backoff=SLOW),
                    middleware=[cls("outer", log), cls("inner", log)])
    async with running(worker):
        async def both_after() -> bool:
            return sum(1 for entry in log if entry[1] == "after") == 4
        await wait_until(both_after, timeout=10, what="four after() calls")
    ok_entries = [e[:2] for e in log if e[2] == ok]
    assert ok_entries == [("outer", "before"), ("inner", "before"),
                          ("inner", "after"), ("outer", "after")]
    assert seen == [f"req-{ok}"], "a context variable set in before() reaches the handler"
    [after_bad] = [e for e in log if e[2] == bad and e[:2] == ("outer", "after")]
    assert after_bad[3:] == (EventState.FAILED, "ValueError: nope", "ValueError", True)
    assert (await event_row(db, bad))["state"] == "failed"


async def test_before_may_end_the_attempt_with_a_signal(db: str) -> None:
    calls: list[int] = []
    log: list[tuple[Any, ...]] = []

    class RateLimit(Middleware):
        def before(self, event: Event) -> None:
            raise RetryAfter(30, reason="rate limited")

    async def handler(event: Event) -> None:
        calls.append(event.id)

    router = Router()
    router.add("limited", handler)
    event_id = await enqueue(db, "limited", max_attempts=5)
    worker = Worker(db, router, fast_config(), middleware=[Recorder("first", log), RateLimit(),
                                                           Recorder("never", log)])
    async with running(worker):
        async def recorded() -> bool:
            return (await event_row(db, event_id))["attempts"] == 1
        await wait_until(recorded, timeout=10, what="the rate-limited attempt")
    assert calls == [], "the handler is not called when before() ends the attempt"
    assert [e[:2] for e in log] == [("first", "before"), ("first", "after")]
    assert log[1][3:6] == (EventState.PENDING, "rate limited", "RetryAfter")
    row = await event_row(db, event_id)
    assert row["state"] == "pending" and row["last_error"] == "rate limited"


async def test_an_after_hook_that_raises_changes_nothing(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    class Broken(Middleware):
        def after(self, event: Event, result: HandlerResult) -> None:
            raise RuntimeError("metrics backend down")

    async def handler(event: Event) -> None:
        pass

    router = Router()
    router.add("x", handler)
    event_id = await enqueue(db, "x")
    async with running(Worker(db, router, fast_config(), middleware=[Broken()])):
        async def done() -> bool:
            return (await event_row(db, event_id))["state"] == "succeeded"
        await wait_until(done, timeout=10, what="the event to succeed")
    assert any(getattr(r, "action", None) == "middleware_failed" for r in caplog.records)


async def test_a_snooze_is_reported_as_no_attempt_spent(db: str) -> None:
    log: list[tuple[Any, ...]] = []

    async def handler(event: Event) -> None:
        raise Snooze(60)

    router = Router()
    router.add("later", handler)
    await enqueue(db, "later")
    async with running(Worker(db, router, fast_config(), middleware=[Recorder("m", log)])):
        async def after() -> bool:
            return any(e[1] == "after" for e in log)
        await wait_until(after, timeout=10, what="after()")
    [entry] = [e for e in log if e[1] == "after"]
    assert entry[3] == EventState.PENDING and entry[6] is False


def test_work_event_runs_the_same_middleware(conn: psycopg.Connection[Any]) -> None:
    log: list[tuple[Any, ...]] = []
    seen: list[Any] = []
    Producer().enqueue(conn, "mw.ok", {})
    worked = work_event(conn, _router(seen, "thread"), middleware=[Recorder("m", log)])
    assert worked is not None and worked.outcome.state is EventState.SUCCEEDED
    assert [e[1] for e in log] == ["before", "after"]
    assert seen == [f"req-{worked.event.id}"]
    assert threading.current_thread() is threading.main_thread()


class Quiet(Recorder):
    """Lets the attempts of ``quiet_topic`` through without its hooks, setting its context."""

    def __init__(self, name: str, log: list[tuple[Any, ...]], quiet_topic: str,
                 var: contextvars.ContextVar[str | None] = REQUEST_ID) -> None:
        super().__init__(name, log)
        self.quiet_topic = quiet_topic
        self.var = var

    def quiet(self, event: Event) -> bool:
        self.log.append((self.name, "quiet", event.id))
        if event.topic != self.quiet_topic:
            return False
        self.var.set(f"{self.name}-{event.id}")
        return True


TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant", default=None)


@pytest.mark.parametrize("kind", ["async", "thread", "inline"])
async def test_an_attempt_every_hook_lets_through_runs_without_hooks_in_their_context(
        db: str, kind: str) -> None:
    log: list[tuple[Any, ...]] = []
    seen: list[Any] = []
    seen_tenant: list[Any] = []
    router = _router(seen, kind)
    router.add("mw.other", lambda event: seen_tenant.append((REQUEST_ID.get(), TENANT.get())),
               blocking=kind == "thread")
    quiet = await enqueue(db, "mw.ok")
    loud = await enqueue(db, "mw.other")
    worker = Worker(db, router, fast_config(),
                    middleware=[Quiet("outer", log, "mw.ok"),
                                Quiet("inner", log, "mw.ok", TENANT)])
    async with running(worker):
        async def both_ran() -> bool:
            return len(seen) == 1 and len(seen_tenant) == 1
        await wait_until(both_ran, timeout=10, what="both handlers")
    # Both hooks said quiet: no before or after, and the handler saw what each set.
    assert [e[:2] for e in log if e[2] == quiet] == [("outer", "quiet"), ("inner", "quiet")]
    assert seen == [f"outer-{quiet}"]
    # The first said no: the second was not asked, every hook ran, and the handler
    # saw what before() set, in a context without what quiet() did.
    assert [e[:2] for e in log if e[2] == loud] == [
        ("outer", "quiet"), ("outer", "before"), ("inner", "before"),
        ("inner", "after"), ("outer", "after")]
    assert seen_tenant == [(f"req-{loud}", None)]
    assert (await event_row(db, quiet))["state"] == "succeeded"


async def test_a_quiet_that_raises_runs_the_hooks_and_is_logged(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    log: list[tuple[Any, ...]] = []
    seen: list[Any] = []

    class Broken(Quiet):
        def quiet(self, event: Event) -> bool:
            raise RuntimeError("sampler down")

    ok = await enqueue(db, "mw.ok")
    worker = Worker(db, _router(seen, "async"), fast_config(),
                    middleware=[Broken("broken", log, "mw.ok")])
    async with running(worker):
        async def after() -> bool:
            return any(e[1] == "after" for e in log)
        await wait_until(after, timeout=10, what="after()")
    assert [e[:2] for e in log] == [("broken", "before"), ("broken", "after")]
    assert seen == [f"req-{ok}"]
    assert (await event_row(db, ok))["state"] == "succeeded"
    assert any(getattr(r, "action", None) == "middleware_failed" and r.event_id == ok
               for r in caplog.records)


async def test_one_hook_without_quiet_makes_every_attempt_run_the_hooks(db: str) -> None:
    log: list[tuple[Any, ...]] = []
    seen: list[Any] = []
    ok = await enqueue(db, "mw.ok")
    worker = Worker(db, _router(seen, "async"), fast_config(),
                    middleware=[Quiet("quiet", log, "mw.ok"), Recorder("plain", log)])
    async with running(worker):
        async def both_after() -> bool:
            return len(seen) == 1 and sum(e[1] == "after" for e in log) == 2
        await wait_until(both_after, timeout=10, what="the handler and both after() calls")
    assert [e[:2] for e in log if e[2] == ok] == [
        ("quiet", "before"), ("plain", "before"), ("plain", "after"), ("quiet", "after")]
    assert seen == [f"req-{ok}"]


async def test_a_batch_handlers_events_always_run_the_hooks(db: str) -> None:
    log: list[tuple[Any, ...]] = []
    seen: list[Any] = []

    async def batch(events: list[Event]) -> None:
        seen.append((len(events), REQUEST_ID.get()))

    router = Router()
    router.add("mw.batch", batch, batch=True)
    ids = [await enqueue(db, "mw.batch") for _ in range(2)]
    async with running(Worker(db, router, fast_config(),
                              middleware=[Quiet("quiet", log, "mw.batch")])):
        async def both_after() -> bool:
            return sum(e[1] == "after" for e in log) == 2
        await wait_until(both_after, timeout=10, what="after() for both events")
    assert not [e for e in log if e[1] == "quiet"]
    assert sorted(e[2] for e in log if e[1] == "before") == ids
    assert sum(n for n, _ in seen) == 2


def test_something_that_is_no_middleware_is_refused() -> None:
    router = Router()
    router.add("x", lambda event: None)
    with pytest.raises(ConfigError, match=r"expected middleware\[1\] to have before\(\) and after\(\)"):
        Worker("postgresql://unused", router, middleware=[Middleware(), object()])  # type: ignore[list-item]


def test_the_base_class_hooks_do_nothing() -> None:
    m = Middleware()
    event = Event(id=1, topic="t", payload_text="{}")
    assert m.before(event) is None
    assert m.quiet(event) is False
    assert m.after(event, HandlerResult(EventState.SUCCEEDED, None, None, 0.0, None, True)) is None
    logging.getLogger(__name__).debug("base hooks are no-ops")
