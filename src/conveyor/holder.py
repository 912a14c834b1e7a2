"""Who holds a claimed event: what :func:`conveyor.complete` needs to fence its write.

A worker hands every event it claims one shared :class:`Holder`: its lease
owner (the worker's id) and schema. ``complete`` finishes the event only where
that owner still holds the same attempt, and records that it did, so the
worker does not take its own acknowledgement's miss for a lost lease.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


def _no_route(topic: str) -> int | None:
    return None


@dataclass(slots=True, eq=False)
class Holder:
    """A worker's claim on its events: its ``owner`` id, its ``schema``, the
    (event id, attempt) pairs its handlers finished themselves (``completed``),
    and the stored-result limit of a topic's route (``result_limit``: None,
    the default, for a topic the worker does not route)."""

    owner: str
    schema: str
    completed: set[tuple[int, int]] = field(default_factory=set)
    result_limit: Callable[[str], int | None] = _no_route
