"""A notification is a hint from anyone: no payload may make a worker misbehave.

NOTIFY needs no grant, so any role that can connect can send a worker's
channel anything. Adversary finding F4: ``'*|nan'`` put NaN at the root of the
due-time heap, and the worker claimed ~860 times a second until restarted.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from conveyor import Event, Worker
from waiting import wait_until
from worker_support import CallCounter, enqueue, fast_config, router_for, running

HOSTILE = ["*|nan", "*|NaN", "*|inf", "*|-inf", "*|1e300", "*|-5", "*|0", "*|abc",
           "*|" + "9" * 400, "*|1e-300", "*|", "|", "*|1|2", "x" * 7000, "*|\u0661\u0662"]


async def _notify(url: str, payload: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("SELECT pg_notify('conveyor.events', %s)", (payload,))


@pytest.mark.parametrize("payload", HOSTILE)
async def test_a_hostile_notification_never_makes_an_idle_worker_spin(
        db: str, payload: str) -> None:
    handled: list[int] = []

    async def handler(event: Event) -> None:
        handled.append(event.id)

    # A 30 s poll: the real event below must be woken by its NOTIFY.
    worker = Worker(db, router_for("*", handler), fast_config(poll_interval=30.0))
    claims = CallCounter(worker.claims, "claim")
    async with running(worker):
        await asyncio.sleep(0.2)
        before = claims.count
        await _notify(db, payload)
        await asyncio.sleep(1.0)
        # At most the one claim a wake-up may cost; the spin made hundreds.
        made = claims.count - before
        assert made <= 2, f"{made} claims in 1 s after NOTIFY {payload[:40]!r}"
        assert all(due == due and due != float("inf") for due in worker.due_times.heap)
        # And the worker still answers a real event at once.
        event_id = await enqueue(db, "real.event")

        async def handled_it() -> bool:
            return event_id in handled
        # Far under the poll, with room for a loaded machine (it was 2 s under a 5 s poll).
        await wait_until(handled_it, timeout=10, what="a real event after the hostile NOTIFY")
