"""Row decoders, one per query whose rows Conveyor turns into objects.

Each decoder reads its query's columns by name, from one column tuple kept
beside it; :data:`DECODED` maps each query to that tuple, and
tests/test_rows.py compares it with the query's ``cursor.description`` on a
real database, so reordering a SELECT cannot silently shift fields (the cheap
stand-in for sqlc's generated structs).

The claim decoder is the exception that proves the rule: it is on the worker's
hot path, so it stays a tuple unpack into slots (``Event._from_claim_row``),
with its column order defined once, in :data:`~conveyor.types.CLAIM_COLUMNS`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.types.numeric import Int8BinaryLoader

from conveyor.records import (
    AttemptError,
    Dependency,
    EventRecord,
    EventResult,
    HistoryPartition,
    ScheduleInfo,
    WorkerInfo,
    WorkflowStep,
)
from conveyor.states import EventState
from conveyor.types import CLAIM_COLUMNS, Event

__all__ = [
    "CLAIM_COLUMNS",
    "CLAIM_PRIORITY",
    "DECODED",
    "EVENT_FIND_COLUMNS",
    "EVENT_GET_COLUMNS",
    "HISTORY_PARTITION_COLUMNS",
    "RESULT_COLUMNS",
    "SCHEDULE_COLUMNS",
    "WORKER_COLUMNS",
    "claim_cursor",
    "dependency_from_row",
    "event_from_claim_row",
    "found_from_event_find_row",
    "history_partition_from_row",
    "record_from_event_get_row",
    "result_from_event_result_row",
    "schedule_from_row",
    "worker_from_row",
    "workflow_step_from_row",
]

# event_claim: the worker sorts a claimed batch on this column.
CLAIM_PRIORITY = CLAIM_COLUMNS.index("priority")
event_from_claim_row = Event._from_claim_row


def claim_cursor(cursor: psycopg.AsyncCursor[Any] | psycopg.Cursor[Any]) -> None:
    """Set up the cursor of the plain claim (binary results): ``created_at`` comes as
    PostgreSQL sends it, microseconds since :data:`~conveyor.types.PG_EPOCH`, and
    :attr:`Event.created_at <conveyor.types.Event.created_at>` makes the datetime
    when first read. Made in the claim, each datetime cost the fetch loop
    0.4-0.9 us an event in the zone conversion of psycopg's loader, before the
    next claim could go (2026-12-06, docs/benchmarks.md); most handlers never read it.
    """
    cursor.adapters.register_loader("timestamptz", Int8BinaryLoader)

# event_get: an EventRecord's fields are the row's columns, in the same order.
EVENT_GET_COLUMNS = tuple(f.name for f in dataclasses.fields(EventRecord))

# event_find: event_get's columns, then the seconds until run_at.
EVENT_FIND_COLUMNS = (*EVENT_GET_COLUMNS, "due_in")

# event_result: an EventResult's fields.
RESULT_COLUMNS = tuple(f.name for f in dataclasses.fields(EventResult))

# step_parent_results, workflow_graph: a Dependency's and a WorkflowStep's fields.
DEPENDENCY_COLUMNS = tuple(f.name for f in dataclasses.fields(Dependency))
WORKFLOW_STEP_COLUMNS = tuple(f.name for f in dataclasses.fields(WorkflowStep))

# cron_list: a ScheduleInfo's fields.
SCHEDULE_COLUMNS = tuple(f.name for f in dataclasses.fields(ScheduleInfo))

# history_list: a HistoryPartition's fields.
HISTORY_PARTITION_COLUMNS = tuple(f.name for f in dataclasses.fields(HistoryPartition))

# worker_list_alive: a WorkerInfo's fields.
WORKER_COLUMNS = tuple(f.name for f in dataclasses.fields(WorkerInfo))


def _named(columns: tuple[str, ...], row: Sequence[Any]) -> dict[str, Any]:
    if len(row) != len(columns):
        raise ValueError(f"expected a row of {len(columns)} columns ({', '.join(columns)}),"
                         f" got {len(row)}")
    return dict(zip(columns, row, strict=True))


def _attempt_errors(raw: Any) -> list[AttemptError]:
    # psycopg decodes jsonb to a list; a text cast would arrive as a string.
    entries = raw if isinstance(raw, list) else json.loads(raw or "[]")
    return [AttemptError(attempt=e.get("attempt", 0), at=str(e.get("at", "")),
                         error=e.get("error", ""), traceback=e.get("traceback"),
                         worker=e.get("worker")) for e in entries]


def _record(fields: dict[str, Any]) -> EventRecord:
    fields["state"] = EventState(fields["state"])
    fields["errors"] = _attempt_errors(fields["errors"])
    return EventRecord(**fields)


def record_from_event_get_row(row: Sequence[Any]) -> EventRecord:
    """An :class:`EventRecord` from one ``event_get`` row (:data:`EVENT_GET_COLUMNS`)."""
    return _record(_named(EVENT_GET_COLUMNS, row))


def found_from_event_find_row(row: Sequence[Any]) -> tuple[EventRecord, float]:
    """``(record, due_in)`` from one ``event_find`` row (:data:`EVENT_FIND_COLUMNS`)."""
    fields = _named(EVENT_FIND_COLUMNS, row)
    due_in: float = fields.pop("due_in")
    return _record(fields), due_in


def result_from_event_result_row(row: Sequence[Any]) -> EventResult:
    """An :class:`EventResult` from one ``event_result`` row (:data:`RESULT_COLUMNS`)."""
    fields = _named(RESULT_COLUMNS, row)
    fields["state"] = EventState(fields["state"])
    return EventResult(**fields)


def dependency_from_row(row: Sequence[Any]) -> Dependency:
    """A :class:`Dependency` from one ``step_parent_results`` row."""
    fields = _named(DEPENDENCY_COLUMNS, row)
    fields["state"] = None if fields["state"] is None else EventState(fields["state"])
    return Dependency(**fields)


def workflow_step_from_row(row: Sequence[Any]) -> WorkflowStep:
    """A :class:`WorkflowStep` from one ``workflow_graph`` row."""
    fields = _named(WORKFLOW_STEP_COLUMNS, row)
    fields["state"] = None if fields["state"] is None else EventState(fields["state"])
    fields["depends_on"] = tuple(fields["depends_on"])
    return WorkflowStep(**fields)


def schedule_from_row(row: Sequence[Any]) -> ScheduleInfo:
    """A :class:`ScheduleInfo` from one ``cron_list`` row (:data:`SCHEDULE_COLUMNS`)."""
    return ScheduleInfo(**_named(SCHEDULE_COLUMNS, row))


def history_partition_from_row(row: Sequence[Any]) -> HistoryPartition:
    """A :class:`HistoryPartition` from one ``history_list`` row."""
    return HistoryPartition(**_named(HISTORY_PARTITION_COLUMNS, row))


def worker_from_row(row: Sequence[Any]) -> WorkerInfo:
    """A :class:`WorkerInfo` from one ``worker_list_alive`` row (:data:`WORKER_COLUMNS`)."""
    fields = _named(WORKER_COLUMNS, row)
    fields["topics"] = list(fields["topics"])
    if fields["tenants"] is not None:
        fields["tenants"] = list(fields["tenants"])
    return WorkerInfo(**fields)


# Each decoded query and the columns its decoder reads, in order.
DECODED: dict[str, tuple[str, ...]] = {
    "event_claim": CLAIM_COLUMNS,
    "event_claim_held": CLAIM_COLUMNS,
    "event_claim_crashed": (*CLAIM_COLUMNS, "state"),
    "event_get": EVENT_GET_COLUMNS,
    "event_find": EVENT_FIND_COLUMNS,
    "event_result": RESULT_COLUMNS,
    "cron_list": SCHEDULE_COLUMNS,
    "history_list": HISTORY_PARTITION_COLUMNS,
    "worker_list_alive": WORKER_COLUMNS,
}
