"""The router of ``test_cancel_running.py``'s worker processes.

Each handler records when it starts and how it stopped in
``public.cancel_ledger``, over a connection of its own: the async one when
its task is cancelled, the plain one (in a thread, which nothing can
interrupt) when it sees ``event.cancelled``. Neither ever finishes by itself.
"""

from __future__ import annotations

import asyncio
import os
import time

import psycopg

from conveyor import Event, Router

from .apps import LEDGER_ENV

CANCEL_LEDGER_DDL = ("CREATE TABLE public.cancel_ledger (event_id bigint NOT NULL, "
                     "attempt int NOT NULL, what text NOT NULL, at double precision NOT NULL)")

router = Router()


def _record(event: Event, what: str) -> None:
    with psycopg.connect(os.environ[LEDGER_ENV], autocommit=True) as conn:
        conn.execute("INSERT INTO public.cancel_ledger VALUES (%s, %s, %s, %s)",
                     (event.id, event.attempt, what, time.time()))


@router.route("cancel.async")
async def waits_for_ever(event: Event) -> None:
    await asyncio.to_thread(_record, event, "started")
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await asyncio.shield(asyncio.to_thread(_record, event, "task cancelled"))
        raise


@router.route("cancel.sync", blocking=True)
def polls_cancelled(event: Event) -> None:
    _record(event, "started")
    while not event.cancelled:
        time.sleep(0.05)
    _record(event, "saw cancelled")
