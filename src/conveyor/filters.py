"""Which events an operator means: :class:`EventFilter`, checked when it is built.

Every bad value raises :class:`~conveyor.errors.InvalidInputError` naming the
field and the value; a filter that exists is one the SQL can bind as is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from conveyor.errors import InvalidInputError
from conveyor.patterns import check_topic_pattern
from conveyor.states import EventState
from conveyor.validation import DELAY_MAX_SECONDS, check_event_id, check_tenant, show

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
    ``"scheduled"`` among them names the pending events not due yet (a
    delayed event, a retry waiting out its backoff): it sets ``scheduled``.
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
    ``scheduled``: pending events match only while not due yet (``run_at`` in
    the future); with no ``states``, only those. Defaults to False.

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
    scheduled: bool = False

    def __post_init__(self) -> None:
        # Frozen: the normalised values (tuples, plain strings, floats) are set
        # through object.__setattr__, the dataclass way.
        if not isinstance(self.scheduled, bool):
            raise InvalidInputError(f"expected scheduled to be True or False, got "
                                    f"{show(self.scheduled)}")
        states, scheduled = _filter_states(self.states)
        object.__setattr__(self, "states", states)
        object.__setattr__(self, "scheduled", scheduled or self.scheduled)
        if self.scheduled and self.states and EventState.PENDING.value not in self.states:
            raise InvalidInputError(
                f"scheduled narrows pending events, but states {show(self.states)} has none")
        if self.scheduled and not self.states:
            object.__setattr__(self, "states", (EventState.PENDING.value,))
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


def _sequence(name: str, value: object, example: str) -> tuple[Any, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidInputError(
            f"expected {name} to be a tuple such as {example}, got {show(value)}")
    return tuple(value)


# Not a state of its own: pending events whose run_at is still ahead.
SCHEDULED = "scheduled"
# What a filter's states may name, in the order lists show them.
FILTER_STATES = tuple(
    name for state in EventState
    for name in ((state.value, SCHEDULED) if state is EventState.PENDING else (state.value,)))


def _filter_states(states: object) -> tuple[tuple[str, ...], bool]:
    """The states, and whether ``"scheduled"`` narrows the pending ones (it stands for
    pending events not due yet; beside ``"pending"`` itself it narrows nothing)."""
    named: list[str] = []
    scheduled = False
    for state in _sequence("states", states, "('failed',)"):
        if state == SCHEDULED:
            scheduled = True
            continue
        try:
            named.append(EventState(state).value)
        except ValueError:
            raise InvalidInputError(
                f"unknown state {show(state)} in states: expected one of "
                + ", ".join([*(s.value for s in EventState), SCHEDULED])) from None
    narrows = scheduled and EventState.PENDING.value not in named
    if narrows:
        named.append(EventState.PENDING.value)
    return tuple(dict.fromkeys(named)), narrows


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
            f" (100 years), got {show(value)}")
    return seconds


def _filter_text(name: str, value: object) -> str | None:
    """A free-text filter field (``error``, ``payload``): non-empty, bounded, storable."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"expected {name} to be a non-empty string, got {show(value)}")
    if len(value) > ERROR_FILTER_MAX_LENGTH:
        raise InvalidInputError(
            f"{name} is {len(value)} characters, the limit is {ERROR_FILTER_MAX_LENGTH}:"
            f" {show(value)}")
    if "\x00" in value:
        raise InvalidInputError(f"{name} contains a NUL character: {show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInputError(
            f"{name} is not valid Unicode (lone surrogate): {show(value)}") from None
    return value


def _filter_ids(ids: object) -> tuple[int, ...]:
    values = _sequence("ids", ids, "(12, 15)")
    if len(values) > FILTER_IDS_MAX:
        raise InvalidInputError(
            f"ids holds {len(values)} ids, the limit is {FILTER_IDS_MAX}")
    out = []
    for value in values:
        if isinstance(value, str):       # the caller parses command-line text
            raise InvalidInputError(f"invalid event id {show(value)} in ids: expected an integer")
        out.append(_filter_field("ids", value, check_event_id))
    return tuple(dict.fromkeys(out))
