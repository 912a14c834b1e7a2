"""The producer's I/O-free core: events in, checked rows and COPY plans out.

Everything here is shared by :class:`~conveyor.AsyncProducer` and its
generated sync twin :class:`~conveyor.Producer`; none of it touches a
connection. An event reaches the table by one of four routes:

* one ``INSERT`` (``enqueue``, and small batches or batches with idempotency
  keys or delays, which COPY cannot express);
* :func:`copy_with_ids`: a batch whose ids were reserved first, so
  ``enqueue_many`` can hand them back;
* :func:`copy_rows`: a batch that needs no ids back (``enqueue_bulk``),
  sending only the columns some row sets away from the table's default;
* :func:`copy_plain`: a bulk batch of plain events (:func:`is_plain`) as bare
  ``(topic, payload)`` rows, checked while they stream: the raw COPY rate.

Inside a recording span (the ``otel`` extra, :mod:`conveyor.tracing`) every
route also writes the send span's W3C context
(:class:`~conveyor.trace_context.TraceContext`); outside one, the statements
and COPY columns are exactly those above.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
from psycopg.pq import TransactionStatus

from conveyor.canvas import Plan
from conveyor.config import MAX_ATTEMPTS_DEFAULT, ProducerConfig
from conveyor.db.named_queries import Queries
from conveyor.errors import DatabaseError, InvalidInputError, MissingExtraError
from conveyor.trace_context import TraceContext
from conveyor.types import EventLike as EventLike
from conveyor.types import NewEvent as NewEvent
from conveyor.validation import (
    KNOWN_TOPICS,
    check_delay,
    check_idempotency_key,
    check_max_attempts,
    check_priority,
    check_run_at,
    check_tenant,
    check_topic,
    encode_payload,
)

if TYPE_CHECKING:
    from conveyor.tracing import ProducerTracing

# Below this many rows a single INSERT beats the extra round trip COPY needs.
COPY_THRESHOLD = 64

# The events table's column defaults (schema.sql; a test holds them to it): a
# column every row of a COPY leaves at its default is not sent.
COLUMN_DEFAULTS: dict[str, Any] = {"tenant": None, "priority": 0,
                                   "max_attempts": MAX_ATTEMPTS_DEFAULT}


def coerce(item: EventLike, index: int) -> NewEvent:
    """``item`` as a :class:`NewEvent`; a mapping gives its fields, a pair its topic and payload."""
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


def is_plain(event: NewEvent) -> bool:
    """Whether ``event`` sets only a topic and a payload, every option at its default.

    Exact types only: a ``True`` priority or a ``Decimal`` delay takes the full
    checks, which refuse or convert it.
    """
    return _plain(event.tenant, event.idempotency_key, event.max_attempts, event.run_at,
                  event.priority, event.delay)


def _plain(tenant: object, key: object, max_attempts: object, run_at: object,
           priority: object, delay: object) -> bool:
    return (tenant is None and key is None and max_attempts is None and run_at is None
            and type(priority) is int and priority == 0
            and type(delay) in (float, int) and delay == 0)


@dataclass(slots=True)   # hot path, measured: see docs/benchmarks.md (not frozen)
class _Row:
    """One checked event, as its columns will hold it."""

    tenant: str | None
    topic: str
    payload: str
    priority: int
    max_attempts: int
    key: str | None
    delay: float
    run_at: datetime | None = None   # absolute due time; wins over delay (which is then 0)


def prepare_one(config: ProducerConfig, topic: str, payload: Any, *, tenant: str | None,
                idempotency_key: str | None, delay: float, priority: int,
                max_attempts: int | None, run_at: datetime | None) -> _Row:
    """:func:`prepare` for the arguments of one ``enqueue`` call. The common event
    (a topic seen valid before and a payload, every option at its default)
    skips the checks that could refuse nothing and the :class:`NewEvent` (hot
    path, measured: see docs/benchmarks.md)."""
    if (_plain(tenant, idempotency_key, max_attempts, run_at, priority, delay)
            and type(topic) is str and topic in KNOWN_TOPICS):
        return _plain_row(topic, payload, config.max_attempts, config.max_payload_bytes,
                          config.max_payload_depth)
    return prepare(config, NewEvent(
        topic=topic, payload=payload, tenant=tenant, idempotency_key=idempotency_key,
        delay=delay, priority=priority, max_attempts=max_attempts, run_at=run_at))


def _plain_row(topic: str, payload: Any, max_attempts: int, max_bytes: int, max_depth: int,
               index: int | None = None) -> _Row:
    """The row of a plain event whose topic is known valid: only its payload to check."""
    try:
        encoded = encode_payload({} if payload is None else payload,
                                 max_bytes=max_bytes, max_depth=max_depth)
    except InvalidInputError as exc:
        if index is None:
            raise
        raise type(exc)(f"event #{index}: {exc}") from None
    return _Row(None, topic, encoded, 0, max_attempts, None, 0.0)


def prepare(config: ProducerConfig, event: NewEvent, index: int | None = None) -> _Row:
    """Check every field of ``event``; a refusal names the event's ``index`` when given."""
    try:
        return _Row(
            tenant=check_tenant(event.tenant),
            topic=check_topic(event.topic),
            payload=encode_payload({} if event.payload is None else event.payload,
                                   max_bytes=config.max_payload_bytes,
                                   max_depth=config.max_payload_depth),
            priority=check_priority(event.priority),
            max_attempts=check_max_attempts(
                config.max_attempts if event.max_attempts is None else event.max_attempts),
            key=check_idempotency_key(event.idempotency_key),
            delay=_one_due_time(check_delay(event.delay), event.run_at),
            run_at=check_run_at(event.run_at),
        )
    except InvalidInputError as exc:
        if index is None:
            raise
        raise type(exc)(f"event #{index}: {exc}") from None


def _one_due_time(delay: float, run_at: object) -> float:
    if run_at is not None and delay:
        raise InvalidInputError(f"give delay or run_at, not both: delay={delay:g}, run_at={run_at!r}")
    return delay


def prepare_many(config: ProducerConfig, events: Iterable[EventLike]) -> list[_Row]:
    """Every event checked, in order; the first refusal names its index."""
    rows: list[_Row] = []
    append = rows.append
    max_attempts, max_bytes, max_depth = (config.max_attempts, config.max_payload_bytes,
                                          config.max_payload_depth)
    for i, item in enumerate(events):
        event = item if type(item) is NewEvent else coerce(item, i)
        # A plain event with a known topic needs only its payload checked.
        if is_plain(event) and type(event.topic) is str and event.topic in KNOWN_TOPICS:
            append(_plain_row(event.topic, event.payload, max_attempts, max_bytes, max_depth, i))
        else:
            append(prepare(config, event, i))
    return rows


def producer_tracing(tracing: bool | None) -> ProducerTracing | None:
    """The producer's tracing: off (False), required (True) or when the ``otel`` extra is there (None).

    Decided once per producer: an untraced producer then pays one attribute
    test per call, a traced one a context look-up outside a span.
    """
    if tracing is False:
        return None
    try:
        from conveyor.tracing import ProducerTracing
    except MissingExtraError:
        if tracing:
            raise
        return None
    return ProducerTracing()


def single_insert(row: _Row, trace: TraceContext | None = None) -> tuple[str, dict[str, Any]]:
    """The named query that writes one event, and its parameters.

    An event with no idempotency key and no delay or run_at (the common one) takes
    ``event_insert_plain``: fewer parameters to send and no ON CONFLICT.
    """
    if trace is None and row.key is None and row.delay == 0 and row.run_at is None:
        return "event_insert_plain", {"tenant": row.tenant, "topic": row.topic,
                                      "payload": row.payload, "priority": row.priority,
                                      "max_attempts": row.max_attempts}
    params = {"tenant": row.tenant, "topic": row.topic, "payload": row.payload,
              "priority": row.priority, "max_attempts": row.max_attempts,
              "idempotency_key": row.key, "delay": row.delay, "run_at": row.run_at}
    if trace is None:
        return "event_insert", params
    params["traceparent"], params["tracestate"] = trace
    return "event_insert_traced", params


def key_params(row: _Row) -> dict[str, Any]:
    """``event_id_by_key``'s parameters."""
    return {"tenant": row.tenant, "idempotency_key": row.key}


def insert_many_params(rows: Sequence[_Row], ids: Sequence[int],
                       trace: TraceContext | None = None) -> dict[str, Any]:
    """``event_insert_many_ids``'s parameters: one array per column (and a ``trace``'s two)."""
    params = {
        "ids": list(ids),
        "tenants": [r.tenant for r in rows],
        "topics": [r.topic for r in rows],
        "payloads": [r.payload for r in rows],
        "priorities": [r.priority for r in rows],
        "max_attempts": [r.max_attempts for r in rows],
        "keys": [r.key for r in rows],
        "delays": [r.delay for r in rows],
        "run_ats": [r.run_at for r in rows],
    }
    if trace is not None:
        params["traceparent"], params["tracestate"] = trace
    return params


def workflow_rows(config: ProducerConfig, p: Plan) -> list[_Row]:
    """A workflow's steps checked, in plan order; a refusal names the step."""
    try:
        return prepare_many(config, [s.event for s in p.steps])
    except InvalidInputError as exc:
        raise type(exc)(str(exc).replace("event #", "step #", 1)) from None


def workflow_after(after: Iterable[int]) -> list[int]:
    """The ids of events outside the workflow its first steps wait for, checked."""
    ids = list(after)
    for i in ids:
        if type(i) is not int or i <= 0:
            raise InvalidInputError(f"after: an event id is a positive integer, not {i!r}")
    return ids


def workflow_params(rows: Sequence[_Row], ids: Sequence[int], p: Plan,
                    after: Sequence[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``step_insert_many``'s and ``step_edges_add``'s parameters."""
    edges = [(ids[later], ids[earlier], p.steps[later].on_failure) for later, earlier in p.edges]
    edges += [(ids[first], outside, p.steps[first].on_failure)
              for first in p.firsts for outside in after]
    waiting = {later for later, _, _ in edges}
    params = insert_many_params(rows, ids)
    del params["keys"]
    params["states"] = ["waiting" if i in waiting else "pending" for i in ids]
    return params, {"event_ids": [e[0] for e in edges], "depends_on": [e[1] for e in edges],
                    "on_failure": [e[2] for e in edges]}


class _Copy(NamedTuple):
    """One COPY: its statement, the records it sends, where a record holds its topic."""

    statement: str
    records: Iterable[tuple[Any, ...]]
    topic_at: int = 0


def fits_copy(rows: Sequence[_Row]) -> bool:
    """Whether ``rows`` may go by COPY: enough of them, and none needing ``ON CONFLICT`` or now()."""
    return len(rows) >= COPY_THRESHOLD and all(r.key is None and r.delay == 0 and r.run_at is None
                                               for r in rows)


def copy_with_ids(q: Queries, rows: Sequence[_Row], ids: Sequence[int],
                  trace: TraceContext | None = None) -> _Copy:
    """Rows with the ids reserved for them, every column sent."""
    copy = _Copy(f"COPY {q.live_table} (id, tenant, topic, payload, priority, max_attempts)"
                 " FROM STDIN",
                 ((rid, r.tenant, r.topic, r.payload, r.priority, r.max_attempts)
                  for rid, r in zip(ids, rows, strict=True)), topic_at=2)
    return copy if trace is None else traced_copy(copy, trace)


def copy_rows(q: Queries, rows: Sequence[_Row], trace: TraceContext | None = None) -> _Copy:
    """Rows without ids, sending only the columns some row sets away from its default.

    Fewer columns are measurably cheaper to format and to parse.
    """
    columns = ["topic", "payload", *(name for name, default in COLUMN_DEFAULTS.items()
                                     if any(getattr(r, name) != default for r in rows))]
    getter = operator.attrgetter(*columns)
    copy = _Copy(f"COPY {q.live_table} ({', '.join(columns)}) FROM STDIN", map(getter, rows))
    return copy if trace is None else traced_copy(copy, trace)


def traced_copy(copy: _Copy, trace: TraceContext) -> _Copy:
    """``copy`` with the two trace columns appended to its column list and to every record."""
    statement = copy.statement.replace(") FROM STDIN", ", traceparent, tracestate) FROM STDIN")
    return copy._replace(statement=statement, records=(record + trace for record in copy.records))


def fits_copy_plain(config: ProducerConfig, events: Sequence[EventLike]) -> bool:
    """Whether a bulk batch may try :func:`copy_plain` (it steps aside at a non-plain event)."""
    # Only the table's own max_attempts lets the two-column COPY stand for it.
    return (len(events) >= COPY_THRESHOLD
            and config.max_attempts == COLUMN_DEFAULTS["max_attempts"])


class _NotPlain(Exception):
    """An event sets more than a topic and a payload: :func:`copy_plain` steps aside."""


def copy_plain(q: Queries, pairs: Iterable[tuple[str, str]], trace: TraceContext | None = None) -> _Copy:
    """``(topic, JSON text)`` rows, every other column left to the table's default."""
    copy = _Copy(f"COPY {q.live_table} (topic, payload) FROM STDIN", pairs)
    return copy if trace is None else traced_copy(copy, trace)


def plain_pairs(config: ProducerConfig, events: Iterable[EventLike]) -> Iterator[tuple[str, str]]:
    """``(topic, JSON text)`` per event, checked; :class:`_NotPlain` at the first that is not plain.

    The bulk route's inner loop: it checks inline what :func:`prepare` checks
    through a dozen calls, and yields, so rows can go out while later ones are
    still being encoded.
    """
    max_bytes, max_depth = config.max_payload_bytes, config.max_payload_depth
    for i, item in enumerate(events):
        kind = type(item)
        if kind is tuple and len(item) == 2:  # type: ignore[arg-type]
            topic, payload = item  # type: ignore[misc]
        elif kind is NewEvent and is_plain(item):  # type: ignore[arg-type]
            topic, payload = item.topic, item.payload  # type: ignore[union-attr]
        else:
            raise _NotPlain
        try:
            if type(topic) is not str or topic not in KNOWN_TOPICS:
                check_topic(topic)
            yield topic, encode_payload({} if payload is None else payload,
                                        max_bytes=max_bytes, max_depth=max_depth)
        except InvalidInputError as exc:
            raise type(exc)(f"event #{i}: {exc}") from None


def begins_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether a statement on ``conn`` now would begin a transaction (idle, not autocommit)."""
    return not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE


def unseen_key(row: _Row) -> DatabaseError:
    """The error for a key whose event exists but is invisible to this transaction."""
    return DatabaseError(
        f"idempotency key {row.key!r} conflicts with an event this transaction cannot see")


def wrap(exc: psycopg.Error, what: str) -> DatabaseError:
    """A driver error as Conveyor's, its first line naming what failed."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return DatabaseError(f"{what} failed: {first}")
