"""Shared vocabulary: event states and the event row handed to handlers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any


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


class Event:
    """One claimed event, as a handler receives it.

    The payload is decoded from JSON on first access, so handlers that only
    look at ``id`` or ``topic`` never pay for decoding.
    """

    __slots__ = ("_payload", "_payload_text", "attempt", "created_at", "id",
                 "idempotency_key", "max_attempts", "priority", "tenant", "topic")

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
    ) -> None:
        self.id = id
        self.topic = topic
        self.tenant = tenant
        self.attempt = attempt
        self.max_attempts = max_attempts
        self.priority = priority
        self.idempotency_key = idempotency_key
        self.created_at = created_at
        self._payload_text = payload_text
        self._payload: Any = _UNSET

    @classmethod
    def _from_claim_row(cls, row: tuple[Any, ...]) -> Event:
        """An event from one row of the claim query (``event_claim``'s RETURNING order).

        The worker makes one per claimed event; unpacking the row into the slots
        costs a quarter of the keyword call (0.13 against 0.56 us).
        """
        event = cls.__new__(cls)
        (event.id, event.tenant, event.topic, event._payload_text, event.attempt,
         event.max_attempts, event.priority, event.idempotency_key, event.created_at) = row
        event._payload = _UNSET
        return event

    @property
    def payload(self) -> Any:
        """The JSON payload, decoded."""
        if self._payload is _UNSET:
            self._payload = json.loads(self._payload_text)
        return self._payload

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


@dataclass(frozen=True, slots=True)
class TopicCount:
    topic: str
    state: EventState
    count: int


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


@dataclass(frozen=True, slots=True)
class QueueStatus:
    """What ``conveyor status`` shows.

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
                {"topic": t.topic, "state": t.state.value, "count": t.count}
                for t in self.by_topic
            ],
            "oldest_pending_age_s": self.oldest_pending_age_s,
            "workers_alive": len(self.workers),
            "workers": [
                {"id": w.id, "name": w.name, "host": w.host, "pid": w.pid,
                 "topics": w.topics, "tenants": w.tenants,
                 "started_at": w.started_at.isoformat(),
                 "heartbeat_at": w.heartbeat_at.isoformat()}
                for w in self.workers
            ],
            "unhandled_topics": list(self.unhandled_topics),
            "estimated_states": list(self.estimated_states),
        }
