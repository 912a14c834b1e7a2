"""Who holds a claimed event: what :func:`conveyor.complete` needs to fence its write.

A worker hands every event it claims one shared :class:`Holder`: its lease
owner (the worker's id) and schema. ``complete`` finishes the event only where
that owner still holds the same attempt, and records that it did, so the
worker does not take its own acknowledgement's miss for a lost lease.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Holder:
    """A worker's claim on its events: its ``owner`` id, its ``schema``, and the
    (event id, attempt) pairs its handlers finished themselves (``completed``)."""

    owner: str
    schema: str
    completed: set[tuple[int, int]] = field(default_factory=set)
