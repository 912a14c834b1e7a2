"""What the operator API returns: event rows, results, listings, queue status, pauses.

Read models, built from rows by :mod:`conveyor.db.rows` and
:mod:`conveyor.admin_core`; handlers never see them (they get a
:class:`~conveyor.types.Event`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from conveyor.states import FINAL_STATES, EventState


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
        return _json_fields(self)


@dataclass(frozen=True, slots=True)
class Dependency:
    """An event another one waits for, as :meth:`conveyor.Admin.dependencies` reads it.

    Attributes:
        id: the dependency's id.
        topic: its topic.
        state: its state now (None once retention pruned it).
        value: what its handler returned, on a ``store_result`` route.
    """

    id: int
    topic: str | None
    state: EventState | None
    value: Any


@dataclass(frozen=True, slots=True)
class WorkflowStep:
    """One event of a workflow graph, as :meth:`conveyor.Admin.workflow` reads it.

    Attributes:
        id: the event's id.
        topic: its topic (None once retention pruned it).
        state: its state now (None once pruned).
        attempts: the attempts it has made.
        error: its last error: for a step parked by a dependency, which one.
        finished_at: when it reached a final state.
        depends_on: the ids it waits (or waited) for.
    """

    id: int
    topic: str | None
    state: EventState | None
    attempts: int | None
    error: str | None
    finished_at: datetime | None
    depends_on: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return _json_fields(self)


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
    ``capped``: ``count`` is the bound of a bounded status (``Admin.status(conn,
    bounded=True)``) and the topic has more events in this state. Defaults
    to False: ``count`` is exact.
    """

    topic: str
    state: EventState
    count: int
    scheduled: int = 0
    oldest_due_s: float | None = None
    capped: bool = False


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

    ``capped_states`` names the states whose number in ``counts`` is the bound
    of a bounded status (``Admin.status(conn, bounded=True)``), with more
    events beyond it (failed, past ``FAILED_EXACT_LIMIT``). Defaults to
    empty: nothing capped.
    """

    counts: dict[str, int]
    by_topic: list[TopicCount]
    oldest_pending_age_s: float | None
    workers: list[WorkerInfo]
    unhandled_topics: list[str] = field(default_factory=list)
    estimated_states: list[str] = field(default_factory=list)
    capped_states: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "by_topic": [
                {"topic": t.topic, "state": t.state.value, "count": t.count,
                 "scheduled": t.scheduled, "oldest_due_s": t.oldest_due_s, "capped": t.capped}
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
            "capped_states": list(self.capped_states),
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
        overdue_s: seconds the next slot is past (0 when it is still ahead,
            and always 0 for a disabled schedule).
        expression_override: the expression an operator set at run time
            (``Admin.set_schedule``), which the workers fire instead of
            ``expression`` until it is cleared; None: none.
        enabled: False while an operator has disabled it: its slots pass
            without firing.
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
    expression_override: str | None = None
    enabled: bool = True

    @property
    def effective_expression(self) -> str:
        """The expression the workers fire: the operator's override, else the declared one."""
        return self.expression_override or self.expression

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
        return _json_fields(self)


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



@dataclass(frozen=True, slots=True)
class HistoryPartition:
    """One partition of the history (docs/history-partitions.md): the succeeded
    and cancelled events that finished in ``[starts, ends)``.

    ``rows``: about how many it holds, from the server's statistics (no row is
    read); ``bytes``: its size with its indexes.
    """

    name: str
    starts: datetime
    ends: datetime
    rows: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return _json_fields(self)


@dataclass(frozen=True, slots=True)
class HistoryLayout:
    """The history's partitions, as ``Admin.history`` reads them.

    ``span``: how long each partition made from now on is, in seconds (a day
    by default, 0026); ``until``: the end of the last partition made, past
    which finished events stay live until the next is made (None before the
    first); ``replayable``: whether the partitions made get the index a
    relay's replay reads (0027: set by ``conveyor relay``);
    ``partitions``: oldest first.
    """

    span: float
    until: datetime | None
    replayable: bool
    partitions: tuple[HistoryPartition, ...]

    def to_json(self) -> dict[str, Any]:
        return {"span": self.span,
                "until": None if self.until is None else self.until.isoformat(),
                "replayable": self.replayable,
                "partitions": [p.to_json() for p in self.partitions]}

def _json_fields(record: Any) -> dict[str, Any]:
    """A record's fields as JSON values: times in ISO 8601, states by name, the
    error history as one object per attempt (``--json`` output, the dashboard)."""
    out: dict[str, Any] = {}
    for name in record.__dataclass_fields__:
        value = getattr(record, name)
        if isinstance(value, datetime):
            value = value.isoformat()
        elif name == "errors":
            value = [{k: getattr(e, k) for k in e.__dataclass_fields__} for e in value]
        elif isinstance(value, EventState):
            value = value.value
        out[name] = value
    return out
