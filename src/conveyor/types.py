"""The event vocabulary: the event to enqueue, the event handed to handlers, its states.

:class:`NewEvent`, :class:`Event` and :data:`CLAIM_COLUMNS` live here; :class:`EventState` in
:mod:`conveyor.states`. The operator's read models (:mod:`conveyor.records`)
and :class:`EventFilter` (:mod:`conveyor.filters`) are re-exported, so
``from conveyor.types import EventRecord`` keeps working.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from conveyor.filters import ERROR_FILTER_MAX_LENGTH, FILTER_IDS_MAX, EventFilter
from conveyor.records import (
    SCHEDULE_OVERDUE_AFTER,
    AttemptError,
    EventPage,
    EventRecord,
    EventResult,
    EventSummary,
    Pause,
    QueueStatus,
    ScheduleInfo,
    TopicCount,
    WorkerInfo,
)
from conveyor.states import FINAL_STATES, FINISHED_STATES, EventState

if TYPE_CHECKING:
    from conveyor.holder import Holder

__all__ = [
    "CLAIM_COLUMNS", "ERROR_FILTER_MAX_LENGTH", "FILTER_IDS_MAX", "FINAL_STATES",
    "FINISHED_STATES", "SCHEDULE_OVERDUE_AFTER", "AttemptError", "Event", "EventFilter",
    "EventLike", "EventPage", "EventRecord", "EventResult", "EventState", "EventSummary",
    "NewEvent", "Pause", "QueueStatus", "ScheduleInfo", "TopicCount", "WorkerInfo",
]


@dataclass(frozen=True, kw_only=True, slots=True, init=False)
class NewEvent:
    """One event to enqueue with :meth:`conveyor.Producer.enqueue_many`.

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
        run_at: when the event becomes due, a timezone-aware datetime, instead
            of a ``delay``. Defaults to None (``delay`` decides).
    """

    topic: str
    payload: Any = None
    tenant: str | None = None
    idempotency_key: str | None = None
    delay: float = 0.0
    priority: int = 0
    max_attempts: int | None = None
    run_at: datetime | None = None

    def __init__(self, *, topic: str, payload: Any = None, tenant: str | None = None,
                 idempotency_key: str | None = None, delay: float = 0.0, priority: int = 0,
                 max_attempts: int | None = None, run_at: datetime | None = None) -> None:
        # hot path, measured: see docs/benchmarks.md (the slots' own setters,
        # not the frozen dataclass's object.__setattr__ per field; still immutable)
        _set_topic(self, topic)
        _set_payload(self, payload)
        _set_tenant(self, tenant)
        _set_key(self, idempotency_key)
        _set_delay(self, delay)
        _set_priority(self, priority)
        _set_max_attempts(self, max_attempts)
        _set_run_at(self, run_at)


_slot_setters = {f.name: NewEvent.__dict__[f.name].__set__ for f in fields(NewEvent)}
_set_topic, _set_payload = _slot_setters["topic"], _slot_setters["payload"]
_set_tenant, _set_key = _slot_setters["tenant"], _slot_setters["idempotency_key"]
_set_delay, _set_priority = _slot_setters["delay"], _slot_setters["priority"]
_set_max_attempts, _set_run_at = _slot_setters["max_attempts"], _slot_setters["run_at"]

EventLike = NewEvent | Mapping[str, Any] | tuple[str, Any]


# event_claim's RETURNING columns, in order. Event._from_claim_row unpacks a row
# in exactly this order (``payload`` into ``_payload_text``, ``attempts`` into
# ``attempt``); tests/test_rows.py holds the query, this tuple and the decoder together.
CLAIM_COLUMNS = ("id", "tenant", "topic", "payload", "attempts", "max_attempts", "priority",
                 "idempotency_key", "created_at", "traceparent", "tracestate")
# Where PostgreSQL's binary timestamps count from: the claim reads ``created_at``
# as that count of microseconds (conveyor.db.rows.claim_cursor says why).
PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
PG_EPOCH_SECONDS = PG_EPOCH.timestamp()


class Event:
    """One claimed event, as a handler receives it.

    The payload is decoded from JSON on first access, so handlers that only
    look at ``id`` or ``topic`` never pay for decoding. ``traceparent`` and
    ``tracestate`` are the W3C trace context of the span that enqueued it, or
    None (docs/tracing.md).
    """

    __slots__ = ("_cancelled", "_created", "_holder", "_payload", "_payload_text", "attempt",
                 "id", "idempotency_key", "max_attempts", "priority", "tenant", "topic",
                 "traceparent", "tracestate")
    _cancelled: bool
    _created: datetime | int | None   # an int until first read: see created_at
    _holder: Holder      # set by the worker that claimed it (conveyor.complete reads it)

    def __init__(
        self,
        *,
        id: int,
        topic: str,
        payload_text: str,
        tenant: str | None = None,
        attempt: int = 1,
        max_attempts: int = 1,
        priority: int = 0,
        idempotency_key: str | None = None,
        created_at: datetime | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> None:
        self.id = id
        self.topic = topic
        self.tenant = tenant
        self.attempt = attempt
        self.max_attempts = max_attempts
        self.priority = priority
        self.idempotency_key = idempotency_key
        self._created = created_at
        self.traceparent = traceparent
        self.tracestate = tracestate
        self._payload_text = payload_text
        self._payload: Any = _UNSET

    @classmethod
    def _from_claim_row(cls, row: tuple[Any, ...]) -> Event:
        """An event from one row of ``event_claim``, its columns in :data:`CLAIM_COLUMNS` order.

        Hot path (one per claimed event), measured: see docs/benchmarks.md.
        Unpacking into the slots costs a quarter of the keyword call.
        """
        event = cls.__new__(cls)
        (event.id, event.tenant, event.topic, event._payload_text, event.attempt,
         event.max_attempts, event.priority, event.idempotency_key, event._created,
         event.traceparent, event.tracestate) = row
        event._payload = _UNSET
        return event

    @property
    def payload(self) -> Any:
        """The JSON payload, decoded."""
        if self._payload is _UNSET:
            self._payload = json.loads(self._payload_text)
        return self._payload

    @property
    def created_at(self) -> datetime | None:
        """When the event was enqueued (the database's clock), an aware datetime:
        in UTC from the plain claim, which reads it as a count (see below), and
        in the session's time zone from the others."""
        created = self._created
        if isinstance(created, int):
            # The claim's count of microseconds, made a datetime on first use:
            # most handlers never look (hot path, measured: docs/benchmarks.md).
            created = self._created = PG_EPOCH + timedelta(microseconds=created)
        return created

    @created_at.setter
    def created_at(self, value: datetime | None) -> None:
        self._created = value

    def _created_epoch(self) -> float | None:
        """:attr:`created_at` in epoch seconds, without making the datetime."""
        created = self._created
        if isinstance(created, int):
            return created / 1_000_000 + PG_EPOCH_SECONDS
        return None if created is None else created.timestamp()

    @property
    def payload_text(self) -> str:
        """The payload as JSON text, as PostgreSQL keeps it (the relay publishes it as is)."""
        return self._payload_text

    @property
    def cancelled(self) -> bool:
        """True once this attempt is no longer wanted: an operator cancelled the
        event while it ran, or the worker lost its lease. An async handler is
        cancelled then; a plain one in a thread cannot be interrupted, so a long
        one checks this now and then and returns (docs/workers.md)."""
        # Unset until then: a claimed event pays nothing for it (hot path).
        try:
            return self._cancelled
        except AttributeError:
            return False

    def _stop(self) -> None:
        """Mark this attempt as no longer wanted: the worker's call (see :attr:`cancelled`)."""
        self._cancelled = True

    @property
    def is_last_attempt(self) -> bool:
        return self.attempt >= self.max_attempts

    def __repr__(self) -> str:
        return (f"Event(id={self.id}, topic={self.topic!r}, tenant={self.tenant!r}, "
                f"attempt={self.attempt}/{self.max_attempts})")


_UNSET: Any = object()
