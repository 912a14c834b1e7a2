# Generated from src/conveyor/producer_async.py by scripts/unasync.py; DO NOT EDIT.
"""Writing events inside the caller's transaction.

``enqueue(conn, ...)`` runs on the caller's psycopg connection and so joins
whatever transaction is open there: the event exists if and only if that
transaction commits. :class:`CommittingProducer` is the convenience that
owns a connection and commits each call on its own.

``conveyor/producer_async.py`` is the source people edit;
``conveyor/producer.py`` is its sync twin, generated from it by
``scripts/unasync.py``. Checks, rows and the COPY routes are the I/O-free
core in :mod:`conveyor.producer_core`.

Example::

    producer = Producer()
    with psycopg.Connection.connect(dsn) as conn:
        conn.execute("INSERT INTO orders ...")
        producer.enqueue(conn, "order.created", {"order_id": 42}, tenant="acme")
    # leaving the block commits both, or neither

Every input is checked before any SQL runs; a refusal raises
:class:`~conveyor.errors.InvalidInputError` naming the value.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, Self

import psycopg
from psycopg.pq import TransactionStatus

from conveyor.canvas import Part, WorkflowIds, plan
from conveyor.config import ProducerConfig
from conveyor.db.connect import connect_for_statements
from conveyor.db.execute import run
from conveyor.db.named_queries import queries_for
from conveyor.errors import InvalidInputError
from conveyor.producer_async import AsyncCommittingProducer as AsyncCommittingProducer
from conveyor.producer_async import AsyncProducer as AsyncProducer
from conveyor.producer_core import COPY_THRESHOLD as COPY_THRESHOLD
from conveyor.producer_core import EventLike as EventLike
from conveyor.producer_core import NewEvent as NewEvent
from conveyor.producer_core import (
    _Copy,
    _NotPlain,
    _Row,
    begins_transaction,
    copy_plain,
    copy_rows,
    copy_with_ids,
    fits_copy,
    fits_copy_plain,
    insert_many_params,
    key_params,
    plain_pairs,
    prepare_many,
    prepare_one,
    producer_tracing,
    single_insert,
    unseen_key,
    workflow_after,
    workflow_params,
    workflow_rows,
    wrap,
)
from conveyor.trace_context import TraceContext


class Producer:
    """Enqueues events on a connection the caller holds.

    Args:
        config: limits and defaults. Defaults to ``ProducerConfig()``.
        tracing: a ``send`` span per call made inside a recording
            OpenTelemetry span, its context stored with the events
            (docs/tracing.md). ``True`` requires the ``otel`` extra, ``False``
            never traces. Defaults to ``None``: traces when the extra is installed.
    """

    def __init__(self, config: ProducerConfig | None = None, *, tracing: bool | None = None) -> None:
        self.config = config or ProducerConfig()
        self._q = queries_for(self.config.schema)
        self._tracing = producer_tracing(tracing)
        # The id sequence's name, the same in every database with this schema.
        self._sequence: str | None = None

    def enqueue(
        self,
        conn: psycopg.Connection[Any],
        topic: str,
        payload: Any = None,
        *,
        tenant: str | None = None,
        idempotency_key: str | None = None,
        delay: float = 0.0,
        priority: int = 0,
        max_attempts: int | None = None,
        run_at: datetime | None = None,
    ) -> int:
        """Write one event in ``conn``'s current transaction; returns its id.

        With an ``idempotency_key`` that already exists for the tenant, returns
        the first event's id and writes nothing. ``run_at``: when it becomes
        due, a timezone-aware datetime, instead of a ``delay`` in seconds (the
        database's clock decides when either has come).
        """
        row = prepare_one(self.config, topic, payload, tenant=tenant,
                          idempotency_key=idempotency_key, delay=delay, priority=priority,
                          max_attempts=max_attempts, run_at=run_at)
        send = self._tracing.start(row.topic) if self._tracing is not None else None
        if send is None:
            return self._insert(conn, row, None)
        with send:
            event_id = self._insert(conn, row, send.trace)
            send.finish(message_id=event_id)
            return event_id

    def _insert(self, conn: psycopg.Connection[Any], row: _Row, trace: TraceContext | None) -> int:
        query, params = single_insert(row, trace)
        try:
            cur = run(conn, self._q[query], params)
            found = cur.fetchone()
            return int(found[0]) if found is not None else self._existing(conn, row)
        except psycopg.Error as exc:
            raise wrap(exc, f"enqueue of topic {row.topic!r}") from exc

    def enqueue_many(
        self,
        conn: psycopg.Connection[Any],
        events: Iterable[EventLike],
    ) -> list[int]:
        """Write many events in one statement (COPY for plain batches); ids in input order."""
        rows = prepare_many(self.config, events)
        if not rows:
            return []
        send = self._tracing.start(None) if self._tracing is not None else None
        if send is None:
            ids, _ = self._write_many(conn, rows, None)
            return ids
        with send:
            ids, written = self._write_many(conn, rows, send.trace)
            send.finish(count=written, topics={row.topic for row in rows})
            return ids

    def enqueue_bulk(
        self,
        conn: psycopg.Connection[Any],
        events: Iterable[EventLike],
    ) -> int:
        """Write many events and return how many were written, not their ids.

        Without ids to hand back, a plain batch goes out as one bare COPY (no
        id reservation first): the fastest way in. Events with an idempotency
        key or a delay take the :meth:`enqueue_many` path; a key that already
        exists is skipped and not counted.

        When the call begins the transaction (an idle connection, not in
        autocommit), any exception rolls back what it began and is raised as
        it was: the connection is idle again.
        """
        send = self._tracing.start(None) if self._tracing is not None else None
        if send is None:
            return self._bulk(conn, events, None)
        with send:
            written = self._bulk(conn, events, send.trace)
            send.finish(count=written)
            return written

    def _bulk(
        self, conn: psycopg.Connection[Any], events: Iterable[EventLike], trace: TraceContext | None,
    ) -> int:
        began = begins_transaction(conn)
        try:
            events = events if isinstance(events, list | tuple) else list(events)
            if fits_copy_plain(self.config, events):
                try:
                    return self._copy_plain(conn, events, trace)
                except _NotPlain:
                    pass
            rows = prepare_many(self.config, events)
            if fits_copy(rows):
                return self._copy(conn, copy_rows(self._q, rows, trace), f"{len(rows)} events")
            if not rows:
                return 0
            _, written = self._write_many(conn, rows, trace)
            return written
        except BaseException:
            if began:
                _rollback_quietly(conn)
            raise

    def _write_many(
        self, conn: psycopg.Connection[Any], rows: list[_Row], trace: TraceContext | None,
    ) -> tuple[list[int], int]:
        """Write ``rows``; returns their ids in input order and how many rows are new."""
        try:
            ids = self._reserve_ids(conn, len(rows))
            if fits_copy(rows):
                self._copy(conn, copy_with_ids(self._q, rows, ids, trace), f"{len(rows)} events")
                return ids, len(ids)
            params = insert_many_params(rows, ids, trace)
            query = "event_insert_many_ids" if trace is None else "event_insert_many_ids_traced"
            cur = run(conn, self._q[query], params)
            inserted = {r[0] for r in cur.fetchall()}
            return [rid if rid in inserted else self._existing(conn, row)
                    for rid, row in zip(ids, rows, strict=True)], len(inserted)
        except psycopg.Error as exc:
            raise wrap(exc, f"enqueue of {len(rows)} events") from exc

    def _copy_plain(
        self, conn: psycopg.Connection[Any], events: Sequence[EventLike], trace: TraceContext | None,
    ) -> int:
        """COPY plain events; :class:`_NotPlain` (nothing written) at the first that is not."""
        pairs = plain_pairs(self.config, events)
        if conn.info.transaction_status != TransactionStatus.IDLE:
            # Inside the caller's transaction every event is checked before a
            # byte is sent, so a refusal leaves that transaction as it was (a
            # savepoint would allow streaming, at a subtransaction per call).
            return self._copy(conn, copy_plain(self._q, list(pairs), trace), "a bulk batch")
        # The call begins the transaction: rows go out as they are checked, so
        # the server stores while the client encodes (about 10 % faster). An
        # autocommit COPY that stops half-way writes nothing; otherwise the
        # transaction this call began is rolled back (here for the next route
        # to start afresh; by enqueue_bulk for any error).
        try:
            return self._copy(conn, copy_plain(self._q, pairs, trace), "a bulk batch")
        except _NotPlain:
            if not conn.autocommit:
                conn.rollback()
            raise

    def _copy(self, conn: psycopg.Connection[Any], copy: _Copy, what: str) -> int:
        """Run one COPY and the wake-up for its topics; returns how many records it sent.

        COPY returns nothing to hang a NOTIFY on, so the topics are gathered on
        the way out and named in one statement after it, in the same
        transaction (on an autocommit connection, right after the COPY's own).
        """
        written = 0
        topics: set[str] = set()
        seen, at = topics.add, copy.topic_at
        try:
            with conn.cursor().copy(copy.statement) as out:
                write = out.write_row
                for written, record in enumerate(copy.records, 1):  # noqa: B007
                    seen(record[at])
                    write(record)
            if topics:
                run(conn, self._q["event_wake_topics"], {"topics": list(topics)})
        except psycopg.Error as exc:
            raise wrap(exc, f"enqueue of {what}") from exc
        return written

    def enqueue_workflow(
        self,
        conn: psycopg.Connection[Any],
        workflow: Part,
        *,
        after: Iterable[int] = (),
    ) -> WorkflowIds:
        """Write a workflow's steps in ``conn``'s current transaction (docs/workflows.md).

        The steps that wait for others are written ``waiting``; the rest are
        due as any event. ``after``: ids of events written before (or earlier
        in this transaction) that the workflow's first steps wait for too.
        Returns the steps' ids (``ids[step]`` for one step).
        """
        p = plan(workflow)
        rows = workflow_rows(self.config, p)
        outside = workflow_after(after)
        try:
            if outside:
                cur = run(conn, self._q["step_parents_missing"], {"ids": outside})
                found = cur.fetchone()
                missing = found[0] if found is not None else []
                if missing:
                    raise InvalidInputError(
                        f"after: no event {', '.join(map(str, missing))} to wait for")
            ids = self._reserve_ids(conn, len(rows))
            steps, edges = workflow_params(rows, ids, p, outside)
            run(conn, self._q["step_insert_many"], steps)
            if edges["event_ids"]:
                run(conn, self._q["step_edges_add"], edges)
        except psycopg.Error as exc:
            raise wrap(exc, f"enqueue of a workflow of {len(rows)} steps") from exc
        return WorkflowIds(p, ids)

    def _reserve_ids(self, conn: psycopg.Connection[Any], count: int) -> list[int]:
        q = self._q
        if self._sequence is None:
            cur = run(conn, q["event_sequence"], {"table": q.events_table})
            found = cur.fetchone()
            self._sequence = found[0]  # type: ignore[index]
        params = {"sequence": self._sequence, "count": count}
        cur = run(conn, q["event_reserve_ids"], params)
        found = cur.fetchone()
        ids: list[int] = found[0]  # type: ignore[index]
        return ids

    def _existing(self, conn: psycopg.Connection[Any], row: _Row) -> int:
        """The id of the event that already holds ``row``'s idempotency key."""
        cur = run(conn, self._q["event_id_by_key"], key_params(row))
        found = cur.fetchone()
        if found is None:
            raise unseen_key(row)
        return int(found[0])


def _rollback_quietly(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.rollback()
    except psycopg.Error:
        pass  # the error being raised says more; psycopg closes a broken connection


class CommittingProducer:
    """Owns one connection and commits every enqueue on its own.

    For scripts and tools with no business transaction to join. Use as a
    context manager::

        with CommittingProducer(dsn) as producer:
            event_id = producer.enqueue("report.requested", {"month": "2026-11"})
    """

    def __init__(self, conninfo: str, config: ProducerConfig | None = None, *,
                 tracing: bool | None = None) -> None:
        self._producer = Producer(config, tracing=tracing)
        self._conninfo = conninfo
        self._conn: psycopg.Connection[Any] | None = None

    def __enter__(self) -> Self:
        self._conn = connect_for_statements(self._conninfo, autocommit=True)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect_for_statements(self._conninfo, autocommit=True)
        return self._conn

    def enqueue(self, topic: str, payload: Any = None, **options: Any) -> int:
        """Enqueue and commit one event; same options as :meth:`Producer.enqueue`."""
        conn = self._connection()
        with conn.transaction():
            return self._producer.enqueue(conn, topic, payload, **options)

    def enqueue_many(self, events: Iterable[EventLike]) -> list[int]:
        """Enqueue and commit many events in one transaction."""
        conn = self._connection()
        with conn.transaction():
            return self._producer.enqueue_many(conn, events)

    def enqueue_bulk(self, events: Iterable[EventLike]) -> int:
        """Enqueue and commit many events in one transaction; returns the count written."""
        conn = self._connection()
        with conn.transaction():
            return self._producer.enqueue_bulk(conn, events)
