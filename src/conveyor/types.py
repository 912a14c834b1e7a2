"""Shared vocabulary: event states, the event row handed to handlers, operator views."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

# The filter checks itself on creation; validation is a leaf (it imports only errors).
from conveyor.errors import InvalidInputError
from conveyor.validation import (
    DELAY_MAX_SECONDS,
    check_event_id,
    check_tenant,
    check_topic_pattern,
)


class EventState(StrEnum):
    """Life cycle of an event.

    ``pending`` -> ``running`` -> ``succeeded`` | ``failed`` | ``cancelled``;
    a failed attempt with attempts left goes back to ``pending`` with a later
    ``run_at``.
    """

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATES


FINISHED_STATES = frozenset({EventState.SUCCEEDED, EventState.FAILED, EventState.CANCELLED})


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


@dataclass(frozen=True, slots=True)
class AttemptError:
    """One failed attempt as kept in an event's error history."""

    attempt: int
    at: str
    error: str
    traceback: str | None = None
    worker: str | None = None


@dataclass(frozen=True, slots=True)
class EventRecord:
    """A full event row, as the operator API returns it."""

    id: int
    tenant: str | None
    topic: str
    payload: Any
    state: EventState
    attempts: int
    max_attempts: int
    priority: int
    run_at: datetime
    lease_owner: str | None
    lease_expires_at: datetime | None
    last_error: str | None
    errors: list[AttemptError]
    idempotency_key: str | None
    created_at: datetime
    updated_at: datetime
    attempted_at: datetime | None
    finished_at: datetime | None
    result: Any = None   # a store_result route's return value, decoded (docs/results.md)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, datetime):
                value = value.isoformat()
            elif name == "errors":
                value = [
                    {k: getattr(e, k) for k in e.__dataclass_fields__} for e in value
                ]
            elif isinstance(value, EventState):
                value = value.value
            out[name] = value
        return out


FINAL_STATES = frozenset({EventState.SUCCEEDED, EventState.FAILED, EventState.CANCELLED})


@dataclass(frozen=True, slots=True)
class EventResult:
    """Where one event stands and what its handler returned, as
    :meth:`conveyor.Admin.result` and :meth:`conveyor.Admin.wait` read it.

    Attributes:
        id: the event's id.
        state: its state now.
        value: the decoded JSON its handler returned, once it succeeded on a
            route with ``store_result=True``; None otherwise (and when the
            handler returned None).
        error: the last attempt's error, None while none failed.
        finished_at: when it reached a final state, None before.
    """

    id: int
    state: EventState
    value: Any
    error: str | None
    finished_at: datetime | None

    @property
    def finished(self) -> bool:
        """Whether the event is succeeded, failed (parked) or cancelled."""
        return self.state in FINAL_STATES


@dataclass(frozen=True, slots=True)
class TopicCount:
    """Events of one topic in one state, as ``QueueStatus.by_topic`` lists them.

    On a ``pending`` row, ``count`` is the events due now and ``scheduled`` the
    pending events whose ``run_at`` is still in the future (a topic with only
    scheduled events has a pending row with ``count`` 0). Defaults to 0, and
    is 0 on every other state's row. ``oldest_due_s``, on a pending row with
    due events: seconds the topic's oldest due event has waited since it came
    due (its lag: how far a relay or the workers are behind); None otherwise.
    """

    topic: str
    state: EventState
    count: int
    scheduled: int = 0
    oldest_due_s: float | None = None


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    id: str
    name: str
    host: str
    pid: int
    topics: list[str]
    started_at: datetime
    heartbeat_at: datetime
    tenants: list[str] | None = None
    concurrency: int | None = None


@dataclass(frozen=True, slots=True)
class QueueStatus:
    """What ``conveyor status`` shows.

    ``counts`` maps each state to its number of events, plus ``"scheduled"``:
    pending events whose ``run_at`` is still in the future. ``"pending"``
    counts only the events due now, so the two add up to every pending event.
    ``unhandled_topics`` names topics with due events no live worker claims;
    ``oldest_pending_age_s`` is the age of the oldest due event.

    ``estimated_states`` names the states whose number in ``counts`` is an
    estimate from the planner's statistics rather than a count (succeeded and
    cancelled once there are many finished rows); ``by_topic`` leaves those
    states out. Defaults to empty: every count exact.
    """

    counts: dict[str, int]
    by_topic: list[TopicCount]
    oldest_pending_age_s: float | None
    workers: list[WorkerInfo]
    unhandled_topics: list[str] = field(default_factory=list)
    estimated_states: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "by_topic": [
                {"topic": t.topic, "state": t.state.value, "count": t.count,
                 "scheduled": t.scheduled, "oldest_due_s": t.oldest_due_s}
                for t in self.by_topic
            ],
            "oldest_pending_age_s": self.oldest_pending_age_s,
            "workers_alive": len(self.workers),
            "workers": [
                {"id": w.id, "name": w.name, "host": w.host, "pid": w.pid,
                 "topics": w.topics, "tenants": w.tenants,
                 "started_at": w.started_at.isoformat(),
                 "heartbeat_at": w.heartbeat_at.isoformat(), "concurrency": w.concurrency}
                for w in self.workers
            ],
            "unhandled_topics": list(self.unhandled_topics),
            "estimated_states": list(self.estimated_states),
        }


# A schedule whose next slot is this many seconds past is reported overdue: a
# running scheduler fires a slot within about a second.
SCHEDULE_OVERDUE_AFTER = 30.0


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    """One cron schedule as the database knows it (``Admin.schedules``, ``conveyor status``).

    Attributes:
        name, expression, timezone, topic, catch_up: its definition, as the
            workers declaring it last wrote it.
        fired_through: every slot up to this instant is settled (fired or skipped).
        next_fire_at: its next slot, as the last worker to fire it computed it.
        last_fired_at: the last slot that enqueued an event.
        missed: slots skipped so far because they were past the catch-up window.
        last_missed_at: when the last of those was found.
        overdue_s: seconds the next slot is past (0 when it is still ahead).
    """

    name: str
    expression: str
    timezone: str
    topic: str
    catch_up: float
    fired_through: datetime
    next_fire_at: datetime | None
    last_fired_at: datetime | None
    missed: int
    last_missed_at: datetime | None
    overdue_s: float

    @property
    def overdue(self) -> bool:
        """Whether no worker has fired its next slot for SCHEDULE_OVERDUE_AFTER seconds:
        no scheduler declaring it is running."""
        return self.overdue_s > SCHEDULE_OVERDUE_AFTER

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            out[name] = value.isoformat() if isinstance(value, datetime) else value
        out["overdue"] = self.overdue
        return out


# An error filter longer than this is surely a paste of something else.
ERROR_FILTER_MAX_LENGTH = 1000
# More ids than this belong in several calls (or in a state/topic filter).
FILTER_IDS_MAX = 10_000


@dataclass(frozen=True, kw_only=True)
class EventFilter:
    """Which events an operator means: every field set narrows; an unset field matches all.

    Example::

        EventFilter(states=("failed",), topic="email.*", newer_than=86_400)

    ``states``: :class:`EventState` values; defaults to empty (any state).
    ``topic``: an exact topic or ``"prefix.*"``, matched like the Router
    (``"*"`` names every topic explicitly); defaults to None (any topic).
    ``tenant``: one tenant; defaults to None (any tenant, and none).
    ``older_than`` / ``newer_than``: seconds; ``created_at`` before
    ``now() - older_than`` / at or after ``now() - newer_than``; default None.
    ``error``: a case-insensitive substring of ``last_error``; defaults to None.
    ``payload``: a SQL/JSON path predicate the payload must satisfy (PostgreSQL's
    ``@@``), e.g. ``'$.customer == "acme"'`` or ``'exists($.refund)'``;
    defaults to None. A path that is not a predicate matches nothing.
    ``ids``: only these event ids; defaults to empty (no id restriction).

    Every value is checked on creation: a bad one raises
    :class:`~conveyor.errors.InvalidInputError` naming the field and the value.
    """

    states: tuple[str, ...] = ()
    topic: str | None = None
    tenant: str | None = None
    older_than: float | None = None
    newer_than: float | None = None
    error: str | None = None
    ids: tuple[int, ...] = ()
    payload: str | None = None

    def __post_init__(self) -> None:
        # Frozen: the normalised values (tuples, plain strings, floats) are set
        # through object.__setattr__, the dataclass way.
        object.__setattr__(self, "states", _filter_states(self.states))
        if self.topic is not None:
            object.__setattr__(self, "topic", _filter_field("topic", self.topic,
                                                            check_topic_pattern))
        if self.tenant is not None:
            object.__setattr__(self, "tenant", _filter_field("tenant", self.tenant, check_tenant))
        for name in ("older_than", "newer_than"):
            object.__setattr__(self, name, _filter_seconds(name, getattr(self, name)))
        object.__setattr__(self, "error", _filter_text("error", self.error))
        object.__setattr__(self, "payload", _filter_text("payload", self.payload))
        object.__setattr__(self, "ids", _filter_ids(self.ids))

    def is_empty(self) -> bool:
        """Whether no field is set, so the filter matches every event."""
        return self == EventFilter()


def _show(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sequence(name: str, value: object, example: str) -> tuple[Any, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidInputError(
            f"expected {name} to be a tuple such as {example}, got {_show(value)}")
    return tuple(value)


def _filter_states(states: object) -> tuple[str, ...]:
    out = []
    for state in _sequence("states", states, "('failed',)"):
        try:
            out.append(EventState(state).value)
        except ValueError:
            raise InvalidInputError(
                f"unknown state {_show(state)} in states: expected one of "
                + ", ".join(s.value for s in EventState)) from None
    return tuple(dict.fromkeys(out))


def _filter_field(name: str, value: object, check: Any) -> Any:
    try:
        return check(value)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{name}: {exc}") from None


def _filter_seconds(name: str, value: object) -> float | None:
    if value is None:
        return None
    seconds = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    try:
        seconds = None if seconds is None else float(seconds)
    except OverflowError:
        seconds = math.inf
    if seconds is None or not 0 <= seconds <= DELAY_MAX_SECONDS:
        raise InvalidInputError(
            f"expected {name} to be a number of seconds from 0 to {DELAY_MAX_SECONDS:.0f}"
            f" (100 years), got {_show(value)}")
    return seconds


def _filter_text(name: str, value: object) -> str | None:
    """A free-text filter field (``error``, ``payload``): non-empty, bounded, storable."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"expected {name} to be a non-empty string, got {_show(value)}")
    if len(value) > ERROR_FILTER_MAX_LENGTH:
        raise InvalidInputError(
            f"{name} is {len(value)} characters, the limit is {ERROR_FILTER_MAX_LENGTH}:"
            f" {_show(value)}")
    if "\x00" in value:
        raise InvalidInputError(f"{name} contains a NUL character: {_show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInputError(
            f"{name} is not valid Unicode (lone surrogate): {_show(value)}") from None
    return value


def _filter_ids(ids: object) -> tuple[int, ...]:
    values = _sequence("ids", ids, "(12, 15)")
    if len(values) > FILTER_IDS_MAX:
        raise InvalidInputError(
            f"ids holds {len(values)} ids, the limit is {FILTER_IDS_MAX}")
    out = []
    for value in values:
        if isinstance(value, str):       # the caller parses command-line text
            raise InvalidInputError(f"invalid event id {_show(value)} in ids: expected an integer")
        out.append(_filter_field("ids", value, check_event_id))
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True, slots=True)
class EventSummary:
    """One event as ``Admin.events`` lists it: the row without payload or history."""

    id: int
    tenant: str | None
    topic: str
    state: EventState
    attempts: int
    max_attempts: int
    priority: int
    run_at: datetime
    created_at: datetime
    updated_at: datetime
    last_error: str | None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, EventState):
                value = value.value
            out[name] = value
        return out


@dataclass(frozen=True, slots=True)
class EventPage:
    """One page of ``Admin.events``, newest first.

    ``next_after``: pass it as ``after=`` for the next page; None when this
    page was the last.
    """

    events: list[EventSummary]
    next_after: int | None

    def to_json(self) -> dict[str, Any]:
        return {"events": [e.to_json() for e in self.events], "next_after": self.next_after}


@dataclass(frozen=True, slots=True)
class Pause:
    """A paused topic pattern, as ``Admin.paused`` lists it.

    Workers claim no pending event whose topic matches ``pattern`` (an exact
    topic, ``"prefix.*"`` or ``"*"``) and, when ``tenant`` is set, whose
    tenant is that one; with ``tenant`` None every tenant's events wait.
    ``reason``: who paused and why, free text; None when not given.
    """

    pattern: str
    tenant: str | None
    reason: str | None
    paused_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "tenant": self.tenant, "reason": self.reason,
                "paused_at": self.paused_at.isoformat()}
