"""Writing events inside the caller's transaction.

``enqueue(conn, ...)`` runs on the caller's psycopg connection and so joins
whatever transaction is open there: the event exists if and only if that
transaction commits. :class:`CommittingProducer` is the convenience that owns
a connection and commits each call on its own.

Example::

    producer = Producer()
    with psycopg.connect(dsn) as conn:
        run(conn, "INSERT INTO orders ...")
        producer.enqueue(conn, "order.created", {"order_id": 42}, tenant="acme")
    # leaving the block commits both, or neither

Every input is checked before any SQL runs; a refusal raises
:class:`~conveyor.errors.InvalidInputError` naming the value.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any, Self

import psycopg
from psycopg.pq import TransactionStatus

from conveyor.config import ProducerConfig
from conveyor.db.connect import connect_for_statements, connect_for_statements_async
from conveyor.db.execute import run, run_async
from conveyor.db.named_queries import Queries, queries_for
from conveyor.errors import DatabaseError, InvalidInputError
from conveyor.validation import (
    KNOWN_TOPICS,
    check_delay,
    check_idempotency_key,
    check_max_attempts,
    check_priority,
    check_tenant,
    check_topic,
    encode_payload,
)

# Below this many rows a single INSERT beats the extra round trip COPY needs.
COPY_THRESHOLD = 64


@dataclass(frozen=True, kw_only=True, slots=True, init=False)
class NewEvent:
    """One event to enqueue with :meth:`Producer.enqueue_many`.

    Attributes:
        topic: dot-separated topic, e.g. ``"email.send"``.
        payload: any JSON-serialisable value. Defaults to ``{}``.
        tenant: owning tenant (a DNS label) or ``None``. Defaults to ``None``.
        idempotency_key: enqueuing the same (tenant, key) again yields the first id.
            Defaults to ``None``.
        delay: seconds before the event becomes due. Defaults to 0.
        priority: higher runs first. Defaults to 0.
        max_attempts: attempts before it is parked ``failed``. Defaults to the
            producer's ``max_attempts``.
    """

    topic: str
    payload: Any = None
    tenant: str | None = None
    idempotency_key: str | None = None
    delay: float = 0.0
    priority: int = 0
    max_attempts: int | None = None

    def __init__(self, *, topic: str, payload: Any = None, tenant: str | None = None,
                 idempotency_key: str | None = None, delay: float = 0.0, priority: int = 0,
                 max_attempts: int | None = None) -> None:
        # Batches build thousands of these: writing through the slots' own
        # setters costs 0.4 us less per event than the frozen dataclass's
        # generated __init__ (object.__setattr__ per field); still immutable.
        _set_topic(self, topic)
        _set_payload(self, payload)
        _set_tenant(self, tenant)
        _set_key(self, idempotency_key)
        _set_delay(self, delay)
        _set_priority(self, priority)
        _set_max_attempts(self, max_attempts)


_slot_setters = {f.name: NewEvent.__dict__[f.name].__set__ for f in fields(NewEvent)}
_set_topic, _set_payload = _slot_setters["topic"], _slot_setters["payload"]
_set_tenant, _set_key = _slot_setters["tenant"], _slot_setters["idempotency_key"]
_set_delay, _set_priority = _slot_setters["delay"], _slot_setters["priority"]
_set_max_attempts = _slot_setters["max_attempts"]


@dataclass(slots=True)   # not frozen: a frozen dataclass costs 1 us more per row
class _Row:
    tenant: str | None
    topic: str
    payload: str
    priority: int
    max_attempts: int
    key: str | None
    delay: float


def _prepare(config: ProducerConfig, event: NewEvent, index: int | None = None) -> _Row:
    where = "" if index is None else f"event #{index}: "
    try:
        payload = {} if event.payload is None else event.payload
        return _Row(
            tenant=check_tenant(event.tenant),
            topic=check_topic(event.topic),
            payload=encode_payload(
                payload,
                max_bytes=config.max_payload_bytes,
                max_depth=config.max_payload_depth,
            ),
            priority=check_priority(event.priority),
            max_attempts=check_max_attempts(
                config.max_attempts if event.max_attempts is None else event.max_attempts
            ),
            key=check_idempotency_key(event.idempotency_key),
            delay=check_delay(event.delay),
        )
    except InvalidInputError as exc:
        if not where:
            raise
        raise type(exc)(where + str(exc)) from None


EventLike = NewEvent | Mapping[str, Any] | tuple[str, Any]


def _coerce(item: EventLike, index: int) -> NewEvent:
    if isinstance(item, NewEvent):
        return item
    if isinstance(item, Mapping):
        try:
            return NewEvent(**item)
        except TypeError as exc:
            raise InvalidInputError(f"event #{index}: {exc}") from None
    if type(item) is tuple and len(item) == 2:
        return NewEvent(topic=item[0], payload=item[1])
    raise InvalidInputError(
        f"event #{index}: expected NewEvent, a mapping or a (topic, payload) pair, got {item!r:.60}")


class _NotPlain(Exception):
    """An event sets more than a topic and a payload: the bulk fast path steps aside."""


def _plain_path(config: ProducerConfig, events: Sequence[EventLike]) -> bool:
    # Only the table's own max_attempts lets the two-column COPY stand for it.
    return (len(events) >= COPY_THRESHOLD
            and config.max_attempts == _TABLE_DEFAULTS["max_attempts"])


def _pairs(config: ProducerConfig, events: Iterable[EventLike]) -> Iterator[tuple[str, str]]:
    """``(topic, JSON text)`` per event, checked; :class:`_NotPlain` at the first that sets more.

    The bulk path's inner loop: it checks inline what :func:`_prepare` checks
    through a dozen calls, and yields, so rows can go out while later ones are
    still being encoded.
    """
    max_bytes, max_depth = config.max_payload_bytes, config.max_payload_depth
    for i, item in enumerate(events):
        kind = type(item)
        if kind is tuple and len(item) == 2:  # type: ignore[arg-type]
            topic, payload = item  # type: ignore[misc]
        elif kind is NewEvent:
            event: NewEvent = item  # type: ignore[assignment]
            if (event.tenant is not None or event.idempotency_key is not None
                    or event.max_attempts is not None
                    or type(event.priority) is not int or event.priority != 0
                    or type(event.delay) not in (float, int) or event.delay != 0):
                raise _NotPlain
            topic, payload = event.topic, event.payload
        else:
            raise _NotPlain
        try:
            if type(topic) is not str or topic not in KNOWN_TOPICS:
                check_topic(topic)
            yield topic, encode_payload({} if payload is None else payload,
                                        max_bytes=max_bytes, max_depth=max_depth)
        except InvalidInputError as exc:
            raise type(exc)(f"event #{i}: {exc}") from None


def _prepare_many(config: ProducerConfig, events: Iterable[EventLike]) -> list[_Row]:
    rows: list[_Row] = []
    append = rows.append
    max_attempts, max_bytes, max_depth = (config.max_attempts, config.max_payload_bytes,
                                          config.max_payload_depth)
    for i, item in enumerate(events):
        event = item if type(item) is NewEvent else _coerce(item, i)
        # The common event (a topic and a payload, every option at its default)
        # needs only those two checked; anything else takes the full path.
        if (event.tenant is None and event.idempotency_key is None and event.max_attempts is None
                and type(event.priority) is int and event.priority == 0
                and type(event.delay) in (float, int) and event.delay == 0
                and type(event.topic) is str and event.topic in KNOWN_TOPICS):
            try:
                payload = encode_payload({} if event.payload is None else event.payload,
                                         max_bytes=max_bytes, max_depth=max_depth)
            except InvalidInputError as exc:
                raise type(exc)(f"event #{i}: {exc}") from None
            append(_Row(None, event.topic, payload, 0, max_attempts, None, 0.0))
        else:
            append(_prepare(config, event, i))
    return rows


def _single_params(row: _Row) -> dict[str, Any]:
    return {
        "tenant": row.tenant,
        "topic": row.topic,
        "payload": row.payload,
        "priority": row.priority,
        "max_attempts": row.max_attempts,
        "idempotency_key": row.key,
        "delay": row.delay,
    }


def _use_copy(rows: Sequence[_Row]) -> bool:
    # COPY cannot skip key conflicts or compute now() + delay, so it is only
    # used for plain batches.
    return len(rows) >= COPY_THRESHOLD and all(r.key is None and r.delay == 0 for r in rows)


def _insert_many_params(rows: Sequence[_Row], ids: Sequence[int]) -> dict[str, Any]:
    return {
        "ids": list(ids),
        "tenants": [r.tenant for r in rows],
        "topics": [r.topic for r in rows],
        "payloads": [r.payload for r in rows],
        "priorities": [r.priority for r in rows],
        "max_attempts": [r.max_attempts for r in rows],
        "keys": [r.key for r in rows],
        "delays": [r.delay for r in rows],
    }


def _copy_statement(q: Queries) -> str:
    return (f"COPY {q.events_table} (id, tenant, topic, payload, priority, max_attempts) "
            "FROM STDIN")


# The table's own defaults: a column every row leaves at its default is not sent.
_TABLE_DEFAULTS = {"tenant": None, "priority": 0, "max_attempts": 5}


def _bulk_copy(q: Queries, rows: Sequence[_Row]) -> tuple[str, Callable[[_Row], Any]]:
    """The COPY statement for ``rows`` and how to turn a row into its values.

    Only the columns some row sets away from the table default are sent:
    fewer columns are measurably cheaper to format and to parse.
    """
    extra = [name for name, default in _TABLE_DEFAULTS.items()
             if any(getattr(r, name) != default for r in rows)]
    columns = ["topic", "payload", *extra]
    return (f"COPY {q.events_table} ({', '.join(columns)}) FROM STDIN",
            operator.attrgetter(*columns))


def _pairs_copy_statement(q: Queries) -> str:
    return f"COPY {q.events_table} (topic, payload) FROM STDIN"


def _copy_rows(rows: Sequence[_Row], ids: Sequence[int]) -> Iterable[tuple[Any, ...]]:
    for rid, r in zip(ids, rows, strict=True):
        yield (rid, r.tenant, r.topic, r.payload, r.priority, r.max_attempts)


def _begins_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    return not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE


def _rollback_quietly(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.rollback()
    except psycopg.Error:
        pass  # the error being raised says more; psycopg closes a broken connection


async def _rollback_quietly_async(conn: psycopg.AsyncConnection[Any]) -> None:
    try:
        await conn.rollback()
    except psycopg.Error:
        pass  # the error being raised says more; psycopg closes a broken connection


def _wrap(exc: psycopg.Error, what: str) -> DatabaseError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return DatabaseError(f"{what} failed: {first}")


class Producer:
    """Enqueues events on a connection the caller holds (sync).

    Args:
        config: limits and defaults. Defaults to ``ProducerConfig()``.
    """

    def __init__(self, config: ProducerConfig | None = None) -> None:
        self.config = config or ProducerConfig()
        self._q = queries_for(self.config.schema)
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
    ) -> int:
        """Write one event in ``conn``'s current transaction; returns its id.

        With an ``idempotency_key`` that already exists for the tenant, returns
        the first event's id and writes nothing.
        """
        row = _prepare(self.config, NewEvent(
            topic=topic, payload=payload, tenant=tenant, idempotency_key=idempotency_key,
            delay=delay, priority=priority, max_attempts=max_attempts))
        q = self._q
        try:
            found = run(conn, q["event_insert"], _single_params(row)).fetchone()
            if found is None:
                found = run(conn,
                    q["event_id_by_key"], {"tenant": row.tenant, "idempotency_key": row.key}
                ).fetchone()
        except psycopg.Error as exc:
            raise _wrap(exc, f"enqueue of topic {row.topic!r}") from exc
        if found is None:
            raise DatabaseError(
                f"idempotency key {row.key!r} conflicts with an event this transaction cannot see"
            )
        return int(found[0])

    def enqueue_many(
        self,
        conn: psycopg.Connection[Any],
        events: Iterable[EventLike],
    ) -> list[int]:
        """Write many events in one statement (COPY for plain batches); ids in input order."""
        rows = _prepare_many(self.config, events)
        if not rows:
            return []
        return self._write_many(conn, rows)[0]

    def _write_many(self, conn: psycopg.Connection[Any], rows: list[_Row]
                    ) -> tuple[list[int], int]:
        """Write ``rows``; returns their ids in input order and how many rows are new."""
        q = self._q
        try:
            if self._sequence is None:
                self._sequence = run(conn, q["event_sequence"], {"table": q.events_table}
                                     ).fetchone()[0]  # type: ignore[index]
            ids = run(conn, q["event_reserve_ids"], {
                "sequence": self._sequence, "count": len(rows)}).fetchone()[0]  # type: ignore[index]
            if _use_copy(rows):
                with conn.cursor().copy(_copy_statement(q)) as copy:
                    for record in _copy_rows(rows, ids):
                        copy.write_row(record)
                return ids, len(ids)
            cur = run(conn, q["event_insert_many_ids"], _insert_many_params(rows, ids))
            inserted = {r[0] for r in cur.fetchall()}
            return [rid if rid in inserted else self._existing(conn, row)
                    for rid, row in zip(ids, rows, strict=True)], len(inserted)
        except psycopg.Error as exc:
            raise _wrap(exc, f"enqueue of {len(rows)} events") from exc

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
        began = _begins_transaction(conn)
        try:
            return self._enqueue_bulk(conn, events)
        except BaseException:
            if began:
                _rollback_quietly(conn)
            raise

    def _enqueue_bulk(self, conn: psycopg.Connection[Any], events: Iterable[EventLike]) -> int:
        events = events if isinstance(events, list | tuple) else list(events)
        if _plain_path(self.config, events):
            try:
                return self._bulk_pairs(conn, events)
            except _NotPlain:
                pass
        rows = _prepare_many(self.config, events)
        if not rows:
            return 0
        if not _use_copy(rows):
            return self._write_many(conn, rows)[1]
        statement, values = _bulk_copy(self._q, rows)
        try:
            with conn.cursor().copy(statement) as copy:
                for r in rows:
                    copy.write_row(values(r))
        except psycopg.Error as exc:
            raise _wrap(exc, f"enqueue of {len(rows)} events") from exc
        return len(rows)

    def _bulk_pairs(self, conn: psycopg.Connection[Any], events: Sequence[EventLike]) -> int:
        """COPY plain events; :class:`_NotPlain` (nothing written) at the first that is not."""
        if conn.info.transaction_status != TransactionStatus.IDLE:
            # Inside the caller's transaction every event is checked before a
            # byte is sent, so a refusal leaves that transaction as it was (a
            # savepoint would allow streaming, at a subtransaction per call).
            return self._copy_pairs(conn, list(_pairs(self.config, events)))
        # The call begins the transaction: rows go out as they are checked, so
        # the server stores while the client encodes (about 10 % faster). An
        # autocommit COPY that stops half-way writes nothing; otherwise the
        # transaction this call began is rolled back (here for the full path
        # to start afresh; by enqueue_bulk for any error).
        try:
            return self._copy_pairs(conn, _pairs(self.config, events))
        except _NotPlain:
            if not conn.autocommit:
                conn.rollback()
            raise

    def _copy_pairs(self, conn: psycopg.Connection[Any], pairs: Iterable[tuple[str, str]]) -> int:
        written = 0
        try:
            with conn.cursor().copy(_pairs_copy_statement(self._q)) as copy:
                write = copy.write_row
                for written, pair in enumerate(pairs, 1):  # noqa: B007
                    write(pair)
        except psycopg.Error as exc:
            raise _wrap(exc, "enqueue of a bulk batch") from exc
        return written

    def _existing(self, conn: psycopg.Connection[Any], row: _Row) -> int:
        found = run(conn,
            self._q["event_id_by_key"], {"tenant": row.tenant, "idempotency_key": row.key}
        ).fetchone()
        if found is None:
            raise DatabaseError(
                f"idempotency key {row.key!r} conflicts with an event this transaction cannot see"
            )
        return int(found[0])


class AsyncProducer:
    """Enqueues events on an async connection the caller holds; mirrors :class:`Producer`."""

    def __init__(self, config: ProducerConfig | None = None) -> None:
        self.config = config or ProducerConfig()
        self._q = queries_for(self.config.schema)
        # The id sequence's name, the same in every database with this schema.
        self._sequence: str | None = None

    async def enqueue(
        self,
        conn: psycopg.AsyncConnection[Any],
        topic: str,
        payload: Any = None,
        *,
        tenant: str | None = None,
        idempotency_key: str | None = None,
        delay: float = 0.0,
        priority: int = 0,
        max_attempts: int | None = None,
    ) -> int:
        """Write one event in ``conn``'s current transaction; returns its id."""
        row = _prepare(self.config, NewEvent(
            topic=topic, payload=payload, tenant=tenant, idempotency_key=idempotency_key,
            delay=delay, priority=priority, max_attempts=max_attempts))
        q = self._q
        try:
            cur = await run_async(conn, q["event_insert"], _single_params(row))
            found = await cur.fetchone()
            if found is None:
                cur = await run_async(conn,
                    q["event_id_by_key"], {"tenant": row.tenant, "idempotency_key": row.key})
                found = await cur.fetchone()
        except psycopg.Error as exc:
            raise _wrap(exc, f"enqueue of topic {row.topic!r}") from exc
        if found is None:
            raise DatabaseError(
                f"idempotency key {row.key!r} conflicts with an event this transaction cannot see"
            )
        return int(found[0])

    async def enqueue_many(
        self,
        conn: psycopg.AsyncConnection[Any],
        events: Iterable[EventLike],
    ) -> list[int]:
        """Write many events in one statement (COPY for plain batches); ids in input order."""
        rows = _prepare_many(self.config, events)
        if not rows:
            return []
        return (await self._write_many(conn, rows))[0]

    async def _write_many(self, conn: psycopg.AsyncConnection[Any], rows: list[_Row]
                          ) -> tuple[list[int], int]:
        """Write ``rows``; returns their ids in input order and how many rows are new."""
        q = self._q
        try:
            if self._sequence is None:
                cur = await run_async(conn, q["event_sequence"], {"table": q.events_table})
                self._sequence = (await cur.fetchone())[0]  # type: ignore[index]
            cur = await run_async(conn, q["event_reserve_ids"], {
                "sequence": self._sequence, "count": len(rows)})
            ids = (await cur.fetchone())[0]  # type: ignore[index]
            if _use_copy(rows):
                async with conn.cursor().copy(_copy_statement(q)) as copy:
                    for record in _copy_rows(rows, ids):
                        await copy.write_row(record)
                return ids, len(ids)
            cur = await run_async(conn, q["event_insert_many_ids"], _insert_many_params(rows, ids))
            inserted = {r[0] for r in await cur.fetchall()}
            out = []
            for rid, row in zip(ids, rows, strict=True):
                out.append(rid if rid in inserted else await self._existing(conn, row))
            return out, len(inserted)
        except psycopg.Error as exc:
            raise _wrap(exc, f"enqueue of {len(rows)} events") from exc

    async def enqueue_bulk(
        self,
        conn: psycopg.AsyncConnection[Any],
        events: Iterable[EventLike],
    ) -> int:
        """Write many events and return how many were written; see :meth:`Producer.enqueue_bulk`."""
        began = _begins_transaction(conn)
        try:
            return await self._enqueue_bulk(conn, events)
        except BaseException:
            if began:
                await _rollback_quietly_async(conn)
            raise

    async def _enqueue_bulk(self, conn: psycopg.AsyncConnection[Any],
                            events: Iterable[EventLike]) -> int:
        events = events if isinstance(events, list | tuple) else list(events)
        if _plain_path(self.config, events):
            try:
                return await self._bulk_pairs(conn, events)
            except _NotPlain:
                pass
        rows = _prepare_many(self.config, events)
        if not rows:
            return 0
        if not _use_copy(rows):
            return (await self._write_many(conn, rows))[1]
        statement, values = _bulk_copy(self._q, rows)
        try:
            async with conn.cursor().copy(statement) as copy:
                for r in rows:
                    await copy.write_row(values(r))
        except psycopg.Error as exc:
            raise _wrap(exc, f"enqueue of {len(rows)} events") from exc
        return len(rows)

    async def _bulk_pairs(self, conn: psycopg.AsyncConnection[Any],
                          events: Sequence[EventLike]) -> int:
        """Mirrors :meth:`Producer._bulk_pairs`."""
        if conn.info.transaction_status != TransactionStatus.IDLE:
            return await self._copy_pairs(conn, list(_pairs(self.config, events)))
        try:
            return await self._copy_pairs(conn, _pairs(self.config, events))
        except _NotPlain:
            if not conn.autocommit:
                await conn.rollback()
            raise

    async def _copy_pairs(self, conn: psycopg.AsyncConnection[Any],
                          pairs: Iterable[tuple[str, str]]) -> int:
        written = 0
        try:
            async with conn.cursor().copy(_pairs_copy_statement(self._q)) as copy:
                write = copy.write_row
                for written, pair in enumerate(pairs, 1):  # noqa: B007
                    await write(pair)
        except psycopg.Error as exc:
            raise _wrap(exc, "enqueue of a bulk batch") from exc
        return written

    async def _existing(self, conn: psycopg.AsyncConnection[Any], row: _Row) -> int:
        cur = await run_async(conn,
            self._q["event_id_by_key"], {"tenant": row.tenant, "idempotency_key": row.key})
        found = await cur.fetchone()
        if found is None:
            raise DatabaseError(
                f"idempotency key {row.key!r} conflicts with an event this transaction cannot see"
            )
        return int(found[0])


class CommittingProducer:
    """Owns one connection and commits every enqueue on its own.

    For scripts and tools with no business transaction to join. Use as a
    context manager::

        with CommittingProducer(dsn) as producer:
            event_id = producer.enqueue("report.requested", {"month": "2026-11"})
    """

    def __init__(self, conninfo: str, config: ProducerConfig | None = None) -> None:
        self._producer = Producer(config)
        self._conninfo = conninfo
        self._conn: psycopg.Connection[Any] | None = None

    def __enter__(self) -> Self:
        self._conn = connect_for_statements(self._conninfo, autocommit=True)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
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


class AsyncCommittingProducer:
    """The async mirror of :class:`CommittingProducer`."""

    def __init__(self, conninfo: str, config: ProducerConfig | None = None) -> None:
        self._producer = AsyncProducer(config)
        self._conninfo = conninfo
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def __aenter__(self) -> Self:
        self._conn = await connect_for_statements_async(self._conninfo, autocommit=True)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await connect_for_statements_async(self._conninfo, autocommit=True)
        return self._conn

    async def enqueue(self, topic: str, payload: Any = None, **options: Any) -> int:
        """Enqueue and commit one event; same options as :meth:`AsyncProducer.enqueue`."""
        conn = await self._connection()
        async with conn.transaction():
            return await self._producer.enqueue(conn, topic, payload, **options)

    async def enqueue_many(self, events: Iterable[EventLike]) -> list[int]:
        """Enqueue and commit many events in one transaction."""
        conn = await self._connection()
        async with conn.transaction():
            return await self._producer.enqueue_many(conn, events)

    async def enqueue_bulk(self, events: Iterable[EventLike]) -> int:
        """Enqueue and commit many events in one transaction; returns the count written."""
        conn = await self._connection()
        async with conn.transaction():
            return await self._producer.enqueue_bulk(conn, events)
