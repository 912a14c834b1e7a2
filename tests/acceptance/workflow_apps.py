"""The router of ``test_workflow_kills.py``'s worker processes.

``wf.member`` returns its payload's ``i`` (stored: ``store_result``) after a
short sleep, so a SIGKILL finds some running. ``wf.callback`` reads what its
dependencies returned (``Admin.dependencies``) and writes one row of
``public.callbacks`` with their count and sum, completing its event in the
same transaction: a row exists exactly when the callback succeeded.
"""

from __future__ import annotations

import asyncio
import os

import psycopg

import conveyor
from conveyor import AsyncAdmin, Event, Router

from .apps import LEDGER_ENV

CALLBACKS_DDL = ("CREATE TABLE public.callbacks (event_id bigint NOT NULL, members int NOT NULL,"
                 " succeeded int NOT NULL, total bigint NOT NULL, started timestamptz NOT NULL"
                 " DEFAULT clock_timestamp())")

router = Router()


@router.route("wf.start")
async def start(event: Event) -> None:
    await asyncio.sleep(0.05)


@router.route("wf.member", store_result=True)
async def member(event: Event) -> int:
    await asyncio.sleep(event.payload.get("sleep", 0))
    return int(event.payload["i"])


@router.route("wf.callback")
async def callback(event: Event) -> None:
    async with await psycopg.AsyncConnection.connect(os.environ[LEDGER_ENV]) as conn:
        results = await AsyncAdmin().dependencies(conn, event.id)
        succeeded = [r for r in results if r.state == conveyor.EventState.SUCCEEDED]
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO public.callbacks (event_id, members, succeeded, total)"
                " VALUES (%s, %s, %s, %s)",
                (event.id, len(results), len(succeeded), sum(r.value for r in succeeded)))
            await conveyor.complete_async(conn, event)
