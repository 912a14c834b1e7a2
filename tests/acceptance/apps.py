"""Routers served by the worker subprocesses of the acceptance tests.

Every handler call records one ledger row (event id, attempt, pid, start and
end time) over a connection of its own, so a test can see exactly which
process ran what and when, independently of Conveyor's own bookkeeping.

The payload steers the handler:

* ``sleep``: seconds to sleep before finishing;
* ``sleep_attempts``: sleep only while ``attempt <= sleep_attempts`` (default: always);
* ``fail``: raise ``RuntimeError`` (after recording) on every attempt: a poison event;
* ``crash``: SIGKILL the worker process itself (after recording): a poison event that
  takes its worker down with it.

The ledger URL comes from ``CONVEYOR_TEST_LEDGER_URL``; the ledger table is
created by the test (:data:`LEDGER_DDL`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import psycopg

from conveyor import Router
from conveyor.types import Event

LEDGER_ENV = "CONVEYOR_TEST_LEDGER_URL"
LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS public.ledger (
    event_id bigint           NOT NULL,
    attempt  integer          NOT NULL,
    pid      integer          NOT NULL,
    started  double precision NOT NULL,
    ended    double precision NOT NULL,
    failed   boolean          NOT NULL DEFAULT false
)
"""
_INSERT = ("INSERT INTO public.ledger (event_id, attempt, pid, started, ended, failed) "
           "VALUES (%s, %s, %s, %s, %s, %s)")
# Keep trying for this long while the database is away (a server restart).
LEDGER_RETRY_FOR = 60.0
APPLICATION_NAME = "acceptance-ledger"


class AsyncLedger:
    """One async connection per worker process, reopened when it breaks."""

    def __init__(self) -> None:
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock: asyncio.Lock | None = None

    async def record(self, row: tuple[Any, ...]) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        deadline = time.monotonic() + LEDGER_RETRY_FOR
        async with self._lock:
            while True:
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = await psycopg.AsyncConnection.connect(
                            os.environ[LEDGER_ENV], autocommit=True,
                            application_name=APPLICATION_NAME, connect_timeout=5)
                    await self._conn.execute(_INSERT, row)
                    return
                except (psycopg.OperationalError, psycopg.InterfaceError):
                    if time.monotonic() > deadline:
                        raise
                    if self._conn is not None:
                        try:
                            await self._conn.close()
                        except Exception:  # noqa: BLE001 - already broken
                            pass
                    self._conn = None
                    await asyncio.sleep(0.2)


class SyncLedger:
    """A connection per handler thread (plain handlers run in a thread pool)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def record(self, row: tuple[Any, ...]) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            conn = psycopg.connect(os.environ[LEDGER_ENV], autocommit=True,
                                   application_name=APPLICATION_NAME, connect_timeout=5)
            self._local.conn = conn
        conn.execute(_INSERT, row)


_async_ledger = AsyncLedger()
_sync_ledger = SyncLedger()


def _sleep_for(event: Event) -> float:
    payload = event.payload if isinstance(event.payload, dict) else {}
    sleep = float(payload.get("sleep", 0))
    limit = payload.get("sleep_attempts")
    if limit is not None and event.attempt > int(limit):
        return 0.0
    return sleep


def _fails(event: Event) -> bool:
    return isinstance(event.payload, dict) and bool(event.payload.get("fail"))


async def handle_async(event: Event) -> None:
    started = time.time()
    sleep = _sleep_for(event)
    if sleep:
        await asyncio.sleep(sleep)
    failed = _fails(event)
    await _async_ledger.record((event.id, event.attempt, os.getpid(), started, time.time(), failed))
    if isinstance(event.payload, dict) and event.payload.get("crash"):
        os.kill(os.getpid(), signal.SIGKILL)
    if failed:
        raise RuntimeError(f"poison event {event.id} failed on attempt {event.attempt}")


def handle_sync(event: Event) -> None:
    started = time.time()
    sleep = _sleep_for(event)
    if sleep:
        time.sleep(sleep)
    failed = _fails(event)
    _sync_ledger.record((event.id, event.attempt, os.getpid(), started, time.time(), failed))
    if failed:
        raise RuntimeError(f"poison event {event.id} failed on attempt {event.attempt}")


router = Router()
router.add("acc.*", handle_async)
router.add("sync.*", handle_sync)


def make_router() -> Router:
    """A factory: ``--app tests.acceptance.apps:make_router`` works too."""
    return router


not_a_router = 42
