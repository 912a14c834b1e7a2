"""Every way a handler can end is a recorded outcome; none wedges or kills the worker.

Adversary findings F1 (a reason that is not a str, an exception whose
``__str__`` raises: the event stayed ``running`` with its lease renewed), F2
(``sys.exit()`` in a handler killed the worker and its neighbours spent
attempts) and F7 (StopIteration from a plain handler hung until the timeout).
Each case runs in all three handler kinds: async, plain in a thread, and plain
inline (``blocking=False``), inside a running worker beside a neighbour that
must finish normally.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import pytest

from conveyor import BackoffPolicy, Event, PermanentFailure, RetryAfter, Router, Worker
from waiting import wait_until
from worker_support import enqueue, event_row, fast_config, running

NO_RETRY_SOON = BackoffPolicy(base_delay=60, max_delay=60, jitter=0)


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ exploded")


class NotStr(Exception):
    def __str__(self) -> Any:
        return 42


def _exhausted() -> None:
    next(iter(()))


# name -> (what the handler does, expected state, expected last_error check)
ENDINGS: dict[str, tuple[Callable[[], None], str, Callable[[str], bool]]] = {
    "permanent_failure_exc": (lambda: _raise(PermanentFailure(KeyError("sku"))), "failed",
                              lambda e: e == "KeyError: 'sku'"),
    "permanent_failure_int": (lambda: _raise(PermanentFailure(404)), "failed",
                              lambda e: e == "404"),
    "retry_after_bytes": (lambda: _raise(RetryAfter(1, reason=b"x")), "pending",  # type: ignore[arg-type]
                          lambda e: e == "b'x'"),
    "str_raises": (lambda: _raise(BadStr()), "pending",
                   lambda e: e.startswith("BadStr") and "unprintable" in e),
    "str_not_str": (lambda: _raise(NotStr()), "pending",
                    lambda e: e.startswith("NotStr") and "unprintable" in e),
    "system_exit": (lambda: sys.exit(2), "pending", lambda e: e == "SystemExit: 2"),
    "keyboard_interrupt": (lambda: _raise(KeyboardInterrupt()), "pending",
                           lambda e: e == "KeyboardInterrupt"),
    "generator_exit": (lambda: _raise(GeneratorExit()), "pending",
                       lambda e: e == "GeneratorExit"),
}


def _raise(exc: BaseException) -> None:
    raise exc


def _router(kind: str, ending: Callable[[], None], neighbour_done: list[int]) -> Router:
    router = Router()
    if kind == "async":
        async def bad_async(event: Event) -> None:
            ending()

        async def slow_async(event: Event) -> None:
            await asyncio.sleep(0.3)
            neighbour_done.append(event.id)
        router.add("bad", bad_async)
        router.add("slow", slow_async)
    else:
        def bad_plain(event: Event) -> None:
            ending()

        def slow_plain(event: Event) -> None:
            import time
            time.sleep(0.3)
            neighbour_done.append(event.id)
        blocking = kind == "thread"
        router.add("bad", bad_plain, blocking=blocking)
        router.add("slow", slow_plain)  # always in a thread: the neighbour must overlap
    return router


@pytest.mark.parametrize("kind", ["async", "thread", "inline"])
@pytest.mark.parametrize("name", list(ENDINGS))
async def test_every_handler_ending_is_recorded_and_the_worker_lives_on(
        db: str, kind: str, name: str) -> None:
    ending, state, error_ok = ENDINGS[name]
    done: list[int] = []
    slow_ids = [await enqueue(db, "slow") for _ in range(3)]
    bad_id = await enqueue(db, "bad", max_attempts=3)
    worker = Worker(db, _router(kind, ending, done),
                    fast_config(backoff=NO_RETRY_SOON, handler_timeout=30))
    async with running(worker) as task:
        async def settled() -> bool:
            row = await event_row(db, bad_id)
            return row["state"] != "running" and row["attempts"] >= 1 and len(done) == 3

        await wait_until(settled, timeout=10, what=f"{name} ({kind}) recorded, neighbours done")
        assert not task.done(), "the worker must keep running"
        # Still alive: a new event after the bad one is handled.
        later = await enqueue(db, "slow")

        async def later_done() -> bool:
            return later in done
        await wait_until(later_done, timeout=10, what="an event after the bad one")
    row = await event_row(db, bad_id)
    assert row["state"] == state, row
    assert row["attempts"] == 1
    assert row["last_error"] is not None and error_ok(row["last_error"]), row["last_error"]
    assert row["lease_owner"] is None
    for slow in slow_ids:
        neighbour = await event_row(db, slow)
        assert neighbour["state"] == "succeeded" and neighbour["attempts"] == 1, neighbour
    assert worker.in_flight == 0


@pytest.mark.parametrize("kind", ["thread", "inline"])
async def test_stop_iteration_from_a_plain_handler_is_a_prompt_failed_attempt(
        db: str, kind: str) -> None:
    def handler(event: Event) -> None:
        _exhausted()

    router = Router()
    router.add("gen", handler, blocking=kind == "thread")
    event_id = await enqueue(db, "gen", max_attempts=2)
    worker = Worker(db, router, fast_config(backoff=NO_RETRY_SOON, handler_timeout=30))
    async with running(worker):
        async def recorded() -> bool:
            return (await event_row(db, event_id))["attempts"] == 1 and \
                (await event_row(db, event_id))["state"] == "pending"
        # Far below the 30 s handler timeout it used to wait for.
        await wait_until(recorded, timeout=5, what="the StopIteration attempt recorded")
    row = await event_row(db, event_id)
    assert "StopIteration" in row["last_error"]
    assert "timed out" not in row["last_error"]
    assert "_exhausted" in row["errors"][0]["traceback"]
