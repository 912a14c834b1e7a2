"""The executor's safety net: a call that ends without an outcome still gets one.

Adversary findings N1 and N2 were two ways of the same bug: something between
the handler's return and the outcome raised, and the event stayed ``running``
with its lease renewed for as long as the worker lived (or an inline route
killed the worker). Each known way is fixed where it happened; these tests
inject an unknown one (a bug inside the executor itself) and prove that every
kind of call still ends in a failed attempt, parked after the last, with the
worker alive.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from conveyor import BackoffPolicy, Event, NewEvent, Router, Worker
from conveyor.middleware import HandlerResult
from conveyor.worker import call_steps
from worker_support import enqueue_many, fast_config, query, running, wait_all_in

QUICK_RETRY = BackoffPolicy(base_delay=0.01, max_delay=0.02, jitter=0.0)


class _FailingAfter:
    def before(self, event: Event) -> None:
        return None

    def after(self, event: Event, result: HandlerResult) -> None:
        raise ValueError("hook failed")


def _injected_bug(*args: Any) -> Any:
    raise RuntimeError("injected executor bug")


def _router(kind: str) -> Router:
    router = Router()
    if kind == "async":
        async def handle(event: Event) -> None:
            return None
        router.add("net", handle, backoff=QUICK_RETRY)
    elif kind == "batch":
        async def handle_all(events: list[Event]) -> None:
            return None
        router.add("net", handle_all, batch=True, backoff=QUICK_RETRY)
    else:
        router.add("net", lambda event: None, blocking=kind == "thread", backoff=QUICK_RETRY)
    return router


@pytest.mark.parametrize("kind", ["async", "thread", "inline", "batch"])
async def test_a_call_that_ends_without_an_outcome_is_a_failed_attempt_then_parked(
        db: str, kind: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    if kind == "batch":
        # Between the decided outcomes and handing them on: only the task's
        # done callback is left to see the events.
        monkeypatch.setattr(call_steps, "hook_failed", _injected_bug)
    else:
        # After the handler returned, before its outcome is decided.
        monkeypatch.setattr(call_steps, "success", _injected_bug)
    ids = await enqueue_many(db, [NewEvent(topic="net", payload=i, max_attempts=2)
                                  for i in range(3)])
    worker = Worker(db, _router(kind), fast_config(), middleware=[_FailingAfter()])
    async with running(worker) as task:
        await wait_all_in(db, {"failed"}, timeout=15)
        assert not task.done(), "the worker must keep running"
    rows = await query(db, "SELECT id, state, attempts, last_error, lease_owner "
                           "FROM conveyor.events ORDER BY id")
    assert [r["id"] for r in rows] == ids
    for row in rows:
        assert (row["state"], row["attempts"], row["lease_owner"]) == ("failed", 2, None), row
        assert row["last_error"] == ("handler call of net ended without an outcome: "
                                     "RuntimeError: injected executor bug"), row
    missing = [r for r in caplog.records if getattr(r, "action", None) == "outcome_missing"]
    assert len(missing) == 6
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert worker.in_flight == 0


class _ExitingAfter:
    def before(self, event: Event) -> None:
        return None

    def after(self, event: Event, result: HandlerResult) -> None:
        raise SystemExit(3)     # a hook calling sys.exit(): its own doing, as in a handler


@pytest.mark.parametrize("kind", ["async", "thread", "inline", "batch"])
async def test_a_middleware_after_hook_raising_system_exit_changes_no_outcome(
        db: str, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    await enqueue_many(db, [NewEvent(topic="net", payload=i) for i in range(3)])
    worker = Worker(db, _router(kind), fast_config(), middleware=[_ExitingAfter()])
    async with running(worker) as task:
        await wait_all_in(db, {"succeeded"}, timeout=15)
        assert not task.done(), "the worker must keep running"
    failed_hooks = [r for r in caplog.records if getattr(r, "action", None) == "middleware_failed"]
    assert len(failed_hooks) == 3
    assert worker.stats.succeeded == 3
