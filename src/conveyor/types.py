"""The event vocabulary: the event row handed to handlers and its states.

:class:`Event` and :data:`CLAIM_COLUMNS` live here; :class:`EventState` in
:mod:`conveyor.states`. The operator's read models (:mod:`conveyor.records`)
and :class:`EventFilter` (:mod:`conveyor.filters`) are re-exported, so
``from conveyor.types import EventRecord`` keeps working.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

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

__all__ = [
    "CLAIM_COLUMNS", "ERROR_FILTER_MAX_LENGTH", "FILTER_IDS_MAX", "FINAL_STATES",
    "FINISHED_STATES", "SCHEDULE_OVERDUE_AFTER", "AttemptError", "Event", "EventFilter",
    "EventPage", "EventRecord", "EventResult", "EventState", "EventSummary", "Pause",
    "QueueStatus", "ScheduleInfo", "TopicCount", "WorkerInfo",
]


# event_claim's RETURNING columns, in order. Event._from_claim_row unpacks a row
# in exactly this order (``payload`` into ``_payload_text``, ``attempts`` into
# ``attempt``); tests/test_rows.py holds the query, this tuple and the decoder together.
CLAIM_COLUMNS = ("id", "tenant", "topic", "payload", "attempts", "max_attempts", "priority",
                 "idempotency_key", "created_at", "traceparent", "tracestate")


class Event:
    """One claimed event, as a handler receives it.

    The payload is decoded from JSON on first access, so handlers that only
    look at ``id`` or ``topic`` never pay for decoding. ``traceparent`` and
    ``tracestate`` are the W3C trace context of the span that enqueued it, or
    None (docs/tracing.md).
    """

    __slots__ = ("_payload", "_payload_text", "attempt", "created_at", "id",
                 "idempotency_key", "max_attempts", "priority", "tenant", "topic",
                 "traceparent", "tracestate")

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
        self.created_at = created_at
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
         event.max_attempts, event.priority, event.idempotency_key, event.created_at,
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
    def payload_text(self) -> str:
        """The payload as JSON text, as PostgreSQL keeps it (the relay publishes it as is)."""
        return self._payload_text

    @property
    def is_last_attempt(self) -> bool:
        return self.attempt >= self.max_attempts

    def __repr__(self) -> str:
        return (f"Event(id={self.id}, topic={self.topic!r}, tenant={self.tenant!r}, "
                f"attempt={self.attempt}/{self.max_attempts})")


_UNSET: Any = object()
