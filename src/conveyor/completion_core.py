"""The I/O-free half of :func:`conveyor.complete`: its checks, parameters and refusal."""

from __future__ import annotations

from typing import Any

from conveyor.db.named_queries import Queries
from conveyor.errors import InvalidStateError, LeaseLostError
from conveyor.holder import Holder
from conveyor.router import RESULT_LIMIT_DEFAULT, RESULT_MAX_DEPTH
from conveyor.types import Event
from conveyor.validation import encode_payload


def holder_of(event: Event) -> Holder:
    """The worker's claim on ``event``; refused for an event no worker handed over."""
    holder: Holder | None = getattr(event, "_holder", None)
    if holder is None:
        raise InvalidStateError(
            f"event {event.id} was not handed to this handler by a worker (or by "
            "conveyor.testing.work_event): complete() finishes a claimed event")
    return holder


def complete_params(q: Queries, holder: Holder, event: Event, result: Any) -> dict[str, Any]:
    limit = holder.result_limit(event.topic) or RESULT_LIMIT_DEFAULT
    text = None if result is None else encode_payload(
        result, max_bytes=limit, max_depth=RESULT_MAX_DEPTH)
    return {"id": event.id, "attempt": event.attempt, "owner": holder.owner, "result": text,
            "results_channel": q.results_channel}


def refused(event: Event) -> LeaseLostError:
    return LeaseLostError(
        f"event {event.id} (attempt {event.attempt}) is no longer this worker's: its lease "
        "expired and another worker took it, or it was cancelled; roll the transaction back")
