"""The router of ``test_complete_storm.py``'s worker processes.

``business.write`` writes one row of ``public.business`` and completes its
event in the same transaction, on a connection of its own: the row exists
exactly when the event succeeded, however the process dies. It sleeps
``payload["sleep"]`` seconds inside the transaction, so a SIGKILL finds some
open.
"""

from __future__ import annotations

import asyncio
import os

import psycopg

import conveyor
from conveyor import Event, Router

from .apps import LEDGER_ENV

BUSINESS_DDL = ("CREATE TABLE public.business (event_id bigint NOT NULL, attempt int NOT NULL, "
                "pid int NOT NULL)")

router = Router()


@router.route("business.write")
async def write(event: Event) -> None:
    async with await psycopg.AsyncConnection.connect(os.environ[LEDGER_ENV]) as conn, \
            conn.transaction():
        await conn.execute("INSERT INTO public.business VALUES (%s, %s, %s)",
                           (event.id, event.attempt, os.getpid()))
        await asyncio.sleep(event.payload.get("sleep", 0))
        await conveyor.complete_async(conn, event)
