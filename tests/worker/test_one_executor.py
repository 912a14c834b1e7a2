"""``conveyor.testing.work_event`` runs the worker's own executor, not a copy of it.

Each handler records the code of the function that called it; the worker and
``work_event`` must show the same ``Executor`` function for each handler kind.
"""

from __future__ import annotations

import sys
from types import CodeType
from typing import Any

import psycopg
import pytest

from conveyor import Event, Producer, Router, Worker
from conveyor.testing import work_event
from conveyor.worker.executor import Executor
from waiting import wait_until
from worker_support import enqueue, fast_config, running


def _router(callers: list[CodeType]) -> Router:
    async def async_handler(event: Event) -> None:
        callers.append(sys._getframe(1).f_code)

    def inline_handler(event: Event) -> None:
        callers.append(sys._getframe(1).f_code)

    router = Router()
    router.add("kind.async", async_handler)
    router.add("kind.inline", inline_handler, blocking=False)
    return router


@pytest.mark.parametrize(("topic", "function"), [("kind.async", Executor._call),
                                                 ("kind.inline", Executor._inline)])
async def test_the_worker_and_work_event_call_handlers_from_the_same_function(
        db: str, topic: str, function: Any) -> None:
    from_worker: list[CodeType] = []
    await enqueue(db, topic)
    async with running(Worker(db, _router(from_worker), fast_config())):
        async def called() -> bool:
            return bool(from_worker)
        await wait_until(called, timeout=5, what="the worker's handler call")

    from_helper: list[CodeType] = []
    with psycopg.connect(db) as conn:
        Producer().enqueue(conn, topic, {})
        worked = await _work(conn, _router(from_helper))
        conn.rollback()
    assert worked
    assert from_worker == from_helper == [function.__code__]


async def _work(conn: psycopg.Connection[Any], router: Router) -> bool:
    import asyncio
    # work_event refuses to run inside an event loop: give it a thread of its own.
    return await asyncio.to_thread(lambda: work_event(conn, router) is not None)
