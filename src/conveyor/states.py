"""The states of an event, and which of them are final."""

from __future__ import annotations

from enum import StrEnum


class EventState(StrEnum):
    """Life cycle of an event.

    ``pending`` -> ``running`` -> ``succeeded`` | ``failed`` | ``cancelled``;
    a failed attempt with attempts left goes back to ``pending`` with a later
    ``run_at``. An event written with dependencies starts ``waiting`` and
    becomes ``pending`` when they have succeeded (docs/workflows.md).
    """

    WAITING = "waiting"
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATES


FINISHED_STATES = frozenset({EventState.SUCCEEDED, EventState.FAILED, EventState.CANCELLED})
# The same set under the name the completer and EventResult use.
FINAL_STATES = FINISHED_STATES
