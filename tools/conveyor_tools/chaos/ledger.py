"""The execution ledger: what the handlers *did*, for chaos and reliability runs.

Conveyor's own tables say what the queue *believes* happened. The ledger says
what the handlers *did*: every handler call writes a ``start`` record before
its body runs and a ``finish`` record after it, over a connection of its own
(never the worker's), so a SIGKILL, a lost lease or a server restart cannot
hide an execution. Each record also snapshots the event's row at that moment
(lease owner, attempt, state, lease expiry), which is what lets the checker
(:mod:`conveyor_tools.chaos.checker`) tell a legitimate re-run from a double
claim.

Example::

    # the worker processes serve a router built with ledger_router() or recorded():
    #   CONVEYOR_LEDGER_URL=$URL conveyor worker --app conveyor_tools.chaos:chaos_router
    with psycopg.connect(url, autocommit=True) as conn:
        create_ledger(conn)

Times are this machine's wall clock (``time.time()``); every process of a run
is on one machine, so they compare. The ledger table lives in the events'
database by default (``public.conveyor_ledger``), so one statement can record
an execution and snapshot its event row.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from conveyor.router import Router
from conveyor.types import Event

LEDGER_URL_ENV = "CONVEYOR_LEDGER_URL"
TABLE_DEFAULT = "public.conveyor_ledger"
SCHEMA_DEFAULT = "conveyor"
RETRY_FOR_DEFAULT = 120.0
APPLICATION_NAME = "ledger-writer"  # not "conveyor-*": fault injectors aim at those

SUCCEEDED = "succeeded"
RAISED = "raised"
CANCELLED = "cancelled"

_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    execution         uuid PRIMARY KEY,
    event_id          bigint      NOT NULL,
    attempt           integer     NOT NULL,
    worker_pid        integer     NOT NULL,
    host              text        NOT NULL,
    started_at        timestamptz NOT NULL,
    finished_at       timestamptz,
    outcome           text,
    lease_owner       uuid,
    lease_attempt     integer,
    lease_state       text,
    lease_expires_at  timestamptz,
    end_lease_owner   uuid,
    end_lease_attempt integer,
    end_state         text
)
"""
_START = """
INSERT INTO {table} (execution, event_id, attempt, worker_pid, host, started_at,
                     lease_owner, lease_attempt, lease_state, lease_expires_at)
SELECT v.execution, v.event_id, v.attempt, v.pid, v.host, to_timestamp(v.started),
       e.lease_owner, e.attempts, e.state, e.lease_expires_at
FROM unnest(%s::uuid[], %s::bigint[], %s::int[], %s::int[], %s::text[], %s::float8[])
     AS v(execution, event_id, attempt, pid, host, started)
LEFT JOIN {events} AS e ON e.id = v.event_id
ON CONFLICT (execution) DO NOTHING
"""
_FINISH = """
UPDATE {table} AS l
SET finished_at = to_timestamp(v.finished), outcome = v.outcome,
    end_lease_owner = e.lease_owner, end_lease_attempt = e.attempts, end_state = e.state
FROM unnest(%s::uuid[], %s::bigint[], %s::float8[], %s::text[])
     AS v(execution, event_id, finished, outcome)
LEFT JOIN {events} AS e ON e.id = v.event_id
WHERE l.execution = v.execution
"""


def table_identifier(name: str) -> sql.Composable:
    """``"schema.table"`` (or ``"table"``) as an identifier, each part quoted."""
    return sql.Identifier(*name.split("."))


def _render(template: str, table: str, schema: str) -> bytes:
    query = sql.SQL(template).format(table=table_identifier(table),
                                     events=sql.Identifier(schema, "events"))
    return query.as_string(None).encode()


def ledger_ddl(table: str = TABLE_DEFAULT) -> str:
    """The ``CREATE TABLE IF NOT EXISTS`` statement of a ledger table."""
    return sql.SQL(_DDL).format(table=table_identifier(table)).as_string(None)


def create_ledger(conn: psycopg.Connection[Any], table: str = TABLE_DEFAULT) -> None:
    """Create the ledger table if it does not exist (commits when ``conn`` is autocommit)."""
    conn.execute(ledger_ddl(table).encode())


_CONNECTION_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError, OSError)


class LedgerWriter:
    """Records executions from one process, group-committing concurrent handlers' records.

    Each ``start``/``finish`` call waits until its record is committed (a record
    is written before the handler body runs, and before the handler returns),
    but records of handlers running at the same time share one statement. While
    the database is away, writes are retried for ``retry_for`` seconds.

    Args:
        conninfo: where the ledger table is; defaults to ``$CONVEYOR_LEDGER_URL``.
        table: the ledger table. Defaults to ``public.conveyor_ledger``.
        schema: Conveyor's schema, for the event-row snapshots. Defaults to ``conveyor``.
        retry_for: seconds to keep retrying a write. Defaults to 120.
    """

    def __init__(self, conninfo: str | None = None, *, table: str = TABLE_DEFAULT,
                 schema: str = SCHEMA_DEFAULT, retry_for: float = RETRY_FOR_DEFAULT) -> None:
        self._conninfo = conninfo
        self._start_sql = _render(_START, table, schema)
        self._finish_sql = _render(_FINISH, table, schema)
        self._retry_for = retry_for
        self._host = socket.gethostname()
        self._queue: list[tuple[str, tuple[Any, ...], asyncio.Future[None]]] = []
        self._kick: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._sync = threading.local()

    @property
    def conninfo(self) -> str:
        url = self._conninfo or os.environ.get(LEDGER_URL_ENV)
        if not url:
            raise RuntimeError(f"no ledger database: pass conninfo or set {LEDGER_URL_ENV}")
        return url

    async def start(self, event: Event, execution: str | None = None) -> str:
        """Record that ``event``'s handler starts now; returns the execution id."""
        execution = execution or str(uuid.uuid4())
        await self._submit("start", (execution, event.id, event.attempt, os.getpid(), self._host,
                                     time.time()))
        return execution

    async def finish(self, execution: str, event: Event, outcome: str) -> None:
        """Record that the execution ended now with ``outcome`` (succeeded/raised/cancelled)."""
        await self._submit("finish", (execution, event.id, time.time(), outcome))

    async def _submit(self, kind: str, row: tuple[Any, ...]) -> None:
        loop = asyncio.get_running_loop()
        if self._kick is None:
            self._kick = asyncio.Event()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.append((kind, row, future))
        self._kick.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._flush_loop(), name="conveyor-ledger")
        await asyncio.shield(future)

    async def _flush_loop(self) -> None:
        assert self._kick is not None
        while True:
            if not self._queue:
                self._kick.clear()
                await self._kick.wait()
                continue
            batch, self._queue = self._queue, []
            try:
                await self._write(batch)
            except Exception as exc:  # noqa: BLE001 - handed to every waiting handler
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for _, _, future in batch:
                if not future.done():
                    future.set_result(None)

    async def _write(self, batch: list[tuple[str, tuple[Any, ...], asyncio.Future[None]]]) -> None:
        starts = [row for kind, row, _ in batch if kind == "start"]
        finishes = [row for kind, row, _ in batch if kind == "finish"]
        deadline = time.monotonic() + self._retry_for
        while True:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = await psycopg.AsyncConnection.connect(
                        self.conninfo, autocommit=True, application_name=APPLICATION_NAME,
                        connect_timeout=5)
                async with self._conn.transaction():
                    if starts:
                        await self._conn.execute(self._start_sql, [list(c) for c in zip(*starts,
                                                                                          strict=True)])
                    if finishes:
                        await self._conn.execute(self._finish_sql,
                                                 [list(c) for c in zip(*finishes, strict=True)])
                return
            except _CONNECTION_ERRORS:
                if time.monotonic() > deadline:
                    raise
                conn, self._conn = self._conn, None
                if conn is not None:
                    try:
                        await conn.close()
                    except Exception:  # noqa: BLE001 - already broken
                        pass
                await asyncio.sleep(0.2)

    # Plain (threaded) handlers: one connection per thread, no batching.
    def start_sync(self, event: Event) -> str:
        execution = str(uuid.uuid4())
        self._write_sync(self._start_sql, [[execution], [event.id], [event.attempt],
                                           [os.getpid()], [self._host], [time.time()]])
        return execution

    def finish_sync(self, execution: str, event: Event, outcome: str) -> None:
        self._write_sync(self._finish_sql, [[execution], [event.id], [time.time()], [outcome]])

    def _write_sync(self, query: bytes, params: list[list[Any]]) -> None:
        deadline = time.monotonic() + self._retry_for
        while True:
            conn: psycopg.Connection[Any] | None = getattr(self._sync, "conn", None)
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.conninfo, autocommit=True,
                                           application_name=APPLICATION_NAME, connect_timeout=5)
                    self._sync.conn = conn
                conn.execute(query, params)
                return
            except _CONNECTION_ERRORS:
                self._sync.conn = None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


_default_writer: LedgerWriter | None = None


def default_writer() -> LedgerWriter:
    """The process-wide writer (``$CONVEYOR_LEDGER_URL``, default table and schema)."""
    global _default_writer
    if _default_writer is None:
        _default_writer = LedgerWriter()
    return _default_writer


Handler = Callable[[Event], Any]


def recorded(handler: Handler, writer: LedgerWriter | None = None) -> Handler:
    """Wrap a handler (async or plain) so every call is recorded in the ledger.

    The outcome is ``succeeded`` when it returns, ``raised`` when it raises (a
    failed attempt, retried by the worker) and ``cancelled`` when the worker
    cancels it (lost lease, shutdown, timeout). The exception goes through.
    """
    if asyncio.iscoroutinefunction(handler):
        @functools.wraps(handler)
        async def wrapped_async(event: Event) -> Any:
            w = writer or default_writer()
            execution = str(uuid.uuid4())
            try:
                await w.start(event, execution)
                result = await handler(event)
            except asyncio.CancelledError:
                await w.finish(execution, event, CANCELLED)
                raise
            except BaseException:
                await w.finish(execution, event, RAISED)
                raise
            await w.finish(execution, event, SUCCEEDED)
            return result
        return wrapped_async

    @functools.wraps(handler)
    def wrapped(event: Event) -> Any:
        w = writer or default_writer()
        execution = w.start_sync(event)
        try:
            result = handler(event)
        except BaseException:
            w.finish_sync(execution, event, RAISED)
            raise
        w.finish_sync(execution, event, SUCCEEDED)
        return result
    return wrapped


async def _chaos_handler(event: Event) -> None:
    """Sleeps ``payload["ms"]`` ms (or a random ``ms_min``..``ms_max``; ``first_ms`` on attempt 1).

    Raises ``RuntimeError`` when the payload has ``fail``.
    """
    payload = event.payload if isinstance(event.payload, dict) else {}
    if "first_ms" in payload and event.attempt == 1:
        ms = float(payload["first_ms"])
    elif "ms" in payload:
        ms = float(payload["ms"])
    else:
        ms = random.uniform(float(payload.get("ms_min", 0)), float(payload.get("ms_max", 0)))
    if ms > 0:
        await asyncio.sleep(ms / 1000)
    if payload.get("fail"):
        raise RuntimeError(f"event {event.id} asked to fail")


def ledger_router(pattern: str = "chaos.*", handler: Handler | None = None,
                  writer: LedgerWriter | None = None) -> Router:
    """A router whose one route records every call of ``handler`` in the ledger.

    ``handler`` defaults to a sleeper steered by the payload (``ms``, or
    ``ms_min``/``ms_max``; ``first_ms`` for the first attempt; ``fail``).
    """
    router = Router()
    router.add(pattern, recorded(handler or _chaos_handler, writer))
    return router


def chaos_router() -> Router:
    """``--app conveyor_tools.chaos:chaos_router``: ``chaos.*`` with the default sleeper."""
    return ledger_router()
