"""An execution ledger and a total-queue checker, for chaos and reliability tests.

Conveyor's own tables say what the queue *believes* happened. The ledger says
what the handlers *did*: every handler call writes a ``start`` record before
its body runs and a ``finish`` record after it, over a connection of its own
(never the worker's), so a SIGKILL, a lost lease or a server restart cannot
hide an execution. Each record also snapshots the event's row at that moment
(lease owner, attempt, state, lease expiry), which is what lets the checker
tell a legitimate re-run from a double claim.

The checker applies Jepsen's *total-queue* semantics to the ledger and the
events table:

* **lost**: committed events that never completed (no successful execution and
  not parked ``failed``/``cancelled``);
* **unexpected**: executions of events that were never committed;
* **duplicated**: executions beyond the first that were not retries of a
  failed attempt. They are *allowed* when the previous execution's worker died
  (SIGKILL), or it had lost its lease by the time it ended, or it was cancelled
  (lease lost, shutdown); otherwise *unexplained* (an acknowledgement vanished);
* **overlapping**: two executions of one event running at the same time while
  both leases were valid (the second started before the first's granted lease
  expired, or the first still held its lease when it ended): a bug. Overlap
  with an execution whose lease had already been taken away is a zombie,
  counted apart and allowed.

Example::

    # the worker processes serve a router built with ledger_router() or recorded():
    #   CONVEYOR_LEDGER_URL=$URL conveyor worker --app conveyor.testing.ledger:chaos_router
    with psycopg.connect(url, autocommit=True) as conn:
        create_ledger(conn)
    ...                                                 # enqueue, run, kill, restart
    with psycopg.connect(url, autocommit=True) as conn:
        report = check(conn, deaths={pid: killed_at})
    assert report.ok, report.summary()

Times are this machine's wall clock (``time.time()``); every process of a test
runs on one machine, so they compare. The ledger table lives in the events'
database by default (``public.conveyor_ledger``), so one statement can record
an execution and snapshot its event row.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import random
import socket
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
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


def _table(name: str) -> sql.Composable:
    return sql.Identifier(*name.split("."))


def _render(template: str, table: str, schema: str) -> bytes:
    query = sql.SQL(template).format(table=_table(table),
                                     events=sql.Identifier(schema, "events"))
    return query.as_string(None).encode()


def ledger_ddl(table: str = TABLE_DEFAULT) -> str:
    """The ``CREATE TABLE IF NOT EXISTS`` statement of a ledger table."""
    return sql.SQL(_DDL).format(table=_table(table)).as_string(None)


def create_ledger(conn: psycopg.Connection[Any], table: str = TABLE_DEFAULT) -> None:
    """Create the ledger table if it does not exist (commits when ``conn`` is autocommit)."""
    conn.execute(ledger_ddl(table).encode())


# --------------------------------------------------------------------- writing

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
    """``--app conveyor.testing.ledger:chaos_router``: ``chaos.*`` with the default sleeper."""
    return ledger_router()


# -------------------------------------------------------------------- checking

@dataclass(frozen=True, slots=True)
class Execution:
    """One handler call as the ledger recorded it (times are epoch seconds)."""

    execution: str
    event_id: int
    attempt: int
    pid: int
    started: float
    finished: float | None = None
    outcome: str | None = None
    lease_owner: str | None = None
    lease_attempt: int | None = None
    lease_state: str | None = None
    lease_expires: float | None = None
    end_lease_owner: str | None = None
    end_lease_attempt: int | None = None
    end_state: str | None = None
    host: str = ""

    @property
    def held_lease_at_start(self) -> bool:
        return (self.lease_state == "running" and self.lease_owner is not None
                and self.lease_attempt == self.attempt)

    @property
    def held_lease_at_end(self) -> bool:
        """Finished while the event row still named this execution's owner and attempt."""
        return (self.finished is not None and self.end_state == "running"
                and self.end_lease_owner is not None
                and self.end_lease_owner == self.lease_owner
                and self.end_lease_attempt == self.attempt)


EXAMPLES = 10


@dataclass
class CheckReport:
    """What :func:`check` found. ``ok`` is the verdict; the lists hold up to 10 examples."""

    committed: int = 0
    executions: int = 0
    completed: int = 0
    retries: int = 0
    unfinished: int = 0
    lost: int = 0
    unexpected: int = 0
    duplicated: int = 0
    allowed_duplicates: int = 0
    duplicates_after_kill: int = 0
    unexplained_duplicates: int = 0
    overlapping: int = 0
    zombie_overlaps: int = 0
    started_without_lease: int = 0
    not_terminal: int = 0
    orphans: int = 0
    orphans_not_rerun: int = 0
    rerun_delays: list[float] = field(default_factory=list, repr=False)
    lost_examples: list[tuple[int, str]] = field(default_factory=list)
    unexpected_examples: list[int] = field(default_factory=list)
    duplicate_examples: list[int] = field(default_factory=list)
    unexplained_examples: list[int] = field(default_factory=list)
    overlap_examples: list[tuple[str, str]] = field(default_factory=list)
    started_without_lease_examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No loss, no unexpected execution, no unexplained duplicate, no overlap.

        ``started_without_lease`` is reported but not part of the verdict: a
        handler whose start record could only be written after its lease was
        taken (a long outage) is a zombie that at-least-once allows; if it ran
        alongside the new owner, ``overlapping`` says so.
        """
        return not (self.lost or self.unexpected or self.unexplained_duplicates
                    or self.overlapping)

    @property
    def rerun_max(self) -> float | None:
        return max(self.rerun_delays) if self.rerun_delays else None

    @property
    def rerun_p95(self) -> float | None:
        return percentile(self.rerun_delays, 95)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("rerun_delays")
        data.update(ok=self.ok, rerun_max=self.rerun_max, rerun_p95=self.rerun_p95)
        return data

    def summary(self) -> str:
        parts = [f"{self.committed} committed, {self.executions} executions "
                 f"({self.retries} retries, {self.unfinished} unfinished)",
                 f"lost {self.lost}", f"unexpected {self.unexpected}",
                 f"duplicated {self.duplicated} ({self.allowed_duplicates} allowed, "
                 f"{self.unexplained_duplicates} unexplained)",
                 f"overlapping {self.overlapping} (+{self.zombie_overlaps} after lease loss)",
                 f"started without lease {self.started_without_lease}",
                 f"not terminal {self.not_terminal}"]
        if self.orphans:
            parts.append(f"orphans {self.orphans}, re-run max {_fmt(self.rerun_max)} "
                         f"p95 {_fmt(self.rerun_p95)}, never re-run {self.orphans_not_rerun}")
        text = "; ".join(parts)
        for name in ("lost_examples", "unexpected_examples", "unexplained_examples",
                     "overlap_examples", "started_without_lease_examples"):
            value = getattr(self, name)
            if value:
                text += f"\n  {name}: {value}"
        return text


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def percentile(values: Iterable[float], pct: float) -> float | None:
    """Nearest-rank percentile, ``None`` for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def _add_example(examples: list[Any], value: Any) -> None:
    if len(examples) < EXAMPLES:
        examples.append(value)


def check_records(executions: Iterable[Execution], states: Mapping[int, str], *,
                  committed: Iterable[int] | None = None,
                  deaths: Mapping[int, float] | None = None) -> CheckReport:
    """The checker over plain records (what :func:`check` reads, or a fabricated history).

    Args:
        executions: the ledger.
        states: every event in the events table: id -> state.
        committed: ids the producers saw committed; defaults to every id in ``states``.
            An id committed but absent from the table is lost.
        deaths: pid -> epoch second of every worker process known to have died
            (SIGKILL). Unfinished executions on other pids are presumed dead too.
    """
    committed_ids = set(states) if committed is None else set(committed)
    deaths = dict(deaths or {})
    by_event: dict[int, list[Execution]] = defaultdict(list)
    report = CheckReport(committed=len(committed_ids))
    for ex in executions:
        by_event[ex.event_id].append(ex)
        report.executions += 1
        if ex.finished is None:
            report.unfinished += 1
        if not ex.held_lease_at_start:
            report.started_without_lease += 1
            _add_example(report.started_without_lease_examples, ex.execution)

    for event_id in sorted(set(by_event) - committed_ids):
        report.unexpected += len(by_event[event_id])
        _add_example(report.unexpected_examples, event_id)

    for event_id in sorted(committed_ids):
        runs = by_event.get(event_id, [])
        state = states.get(event_id)
        succeeded = any(r.outcome == SUCCEEDED for r in runs)
        if succeeded or state in ("failed", "cancelled"):
            report.completed += 1
        else:
            reason = "not in the events table" if state is None else (
                f"state {state}, no successful execution" if runs else f"state {state}, never run")
            report.lost += 1
            _add_example(report.lost_examples, (event_id, reason))
        if state not in ("succeeded", "failed", "cancelled"):
            report.not_terminal += 1

    for event_id, runs in by_event.items():
        runs.sort(key=lambda r: r.started)
        for i, run in enumerate(runs):
            if i:
                prev = runs[i - 1]
                if prev.outcome == RAISED:
                    report.retries += 1
                else:
                    report.duplicated += 1
                    _add_example(report.duplicate_examples, event_id)
                    died = prev.pid in deaths or prev.finished is None
                    if prev.pid in deaths:
                        report.duplicates_after_kill += 1
                    if died or prev.outcome == CANCELLED or not prev.held_lease_at_end:
                        report.allowed_duplicates += 1
                    else:
                        report.unexplained_duplicates += 1
                        _add_example(report.unexplained_examples, event_id)
            # Orphans: executions on a worker that died; when did the event run again?
            if run.pid in deaths and (run.finished is None or run.outcome != RAISED):
                later = runs[i + 1:] if i + 1 < len(runs) else []
                if later:
                    report.orphans += 1
                    report.rerun_delays.append(later[0].started - deaths[run.pid])
                elif run.outcome != SUCCEEDED and states.get(event_id) != "succeeded":
                    report.orphans += 1
                    report.orphans_not_rerun += 1
            # Overlaps with every later execution that started before this one ended.
            end = run.finished if run.finished is not None else deaths.get(run.pid)
            if end is None:
                continue
            for other in runs[i + 1:]:
                if other.started >= end:
                    break
                both_valid = (
                    (run.lease_expires is not None and other.started < run.lease_expires)
                    or (run.held_lease_at_end and other.held_lease_at_start))
                if both_valid:
                    report.overlapping += 1
                    _add_example(report.overlap_examples, (run.execution, other.execution))
                else:
                    report.zombie_overlaps += 1
    return report


def _epoch(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def read_executions(conn: psycopg.Connection[Any], table: str = TABLE_DEFAULT) -> list[Execution]:
    """Every ledger record, as :class:`Execution` values."""
    query = sql.SQL(
        "SELECT execution::text, event_id, attempt, worker_pid, started_at, finished_at, outcome, "
        "lease_owner::text, lease_attempt, lease_state, lease_expires_at, end_lease_owner::text, "
        "end_lease_attempt, end_state, host FROM {}").format(_table(table))
    rows = conn.execute(query).fetchall()
    return [Execution(execution=r[0], event_id=r[1], attempt=r[2], pid=r[3],
                      started=r[4].timestamp(), finished=_epoch(r[5]), outcome=r[6],
                      lease_owner=r[7], lease_attempt=r[8], lease_state=r[9],
                      lease_expires=_epoch(r[10]), end_lease_owner=r[11],
                      end_lease_attempt=r[12], end_state=r[13], host=r[14]) for r in rows]


def check(conn: psycopg.Connection[Any], *, table: str = TABLE_DEFAULT,
          schema: str = SCHEMA_DEFAULT, committed: Iterable[int] | None = None,
          deaths: Mapping[int, float] | None = None,
          topic_like: str | None = None) -> CheckReport:
    """Check the ledger against the events table (see :func:`check_records`).

    ``topic_like`` limits the committed set to events whose topic matches a
    LIKE pattern (e.g. ``'chaos.%'``) when the table holds other events too.
    """
    query = sql.SQL("SELECT id, state FROM {} WHERE {}").format(
        sql.Identifier(schema, "events"),
        sql.SQL("true") if topic_like is None else sql.SQL("topic LIKE {}").format(
            sql.Literal(topic_like)))
    states = {int(i): str(s) for i, s in conn.execute(query).fetchall()}
    return check_records(read_executions(conn, table), states, committed=committed, deaths=deaths)


__all__ = [
    "LEDGER_URL_ENV",
    "CheckReport",
    "Execution",
    "LedgerWriter",
    "chaos_router",
    "check",
    "check_records",
    "create_ledger",
    "default_writer",
    "ledger_ddl",
    "ledger_router",
    "percentile",
    "read_executions",
    "recorded",
]

