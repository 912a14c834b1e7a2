"""The router of the worker processes in ``test_blocked_loop_leases.py``.

Its async handler makes the documented mistake: it blocks its event loop with
``time.sleep`` for ``payload["block"]`` seconds (on attempts up to
``payload["block_attempts"]``, default all), then records the call in
``public.block_ledger`` so the test sees which process ran which attempt, when.
"""

from __future__ import annotations

import os
import time

import psycopg

from conveyor import Event, Router

LEDGER_URL_ENV = "CONVEYOR_TEST_LEDGER_URL"   # set by tests/acceptance/helpers.WorkerProcess
LEDGER_DDL = ("CREATE TABLE public.block_ledger (event_id bigint, attempt int, pid int, "
              "started double precision, ended double precision)")

router = Router()


@router.route("block.loop")
async def block_loop(event: Event) -> None:
    started = time.time()
    if event.attempt <= event.payload.get("block_attempts", event.max_attempts):
        time.sleep(event.payload["block"])   # the mistake under test
    with psycopg.connect(os.environ[LEDGER_URL_ENV], autocommit=True,
                         application_name="block-ledger") as conn:
        conn.execute("INSERT INTO public.block_ledger VALUES (%s, %s, %s, %s, %s)",
                     (event.id, event.attempt, os.getpid(), started, time.time()))
