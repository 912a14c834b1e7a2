"""The I/O-free half of ``assert_enqueued``: filters, matching, the failure message.

Shared by :mod:`conveyor.testing.assertions_async` and its generated sync twin.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Any

from conveyor.types import EventRecord, EventState


class _Unset(Enum):
    UNSET = "UNSET"


UNSET = _Unset.UNSET
"""Marks a filter that was not given (``None`` is a real value: "no tenant")."""

TOLERANCE_DEFAULT = 1.0
SHOWN_CANDIDATES = 10

@dataclass(frozen=True, slots=True)
class _Filters:
    topic: str | None
    payload: Any
    tenant: Any
    idempotency_key: Any
    priority: Any
    max_attempts: Any
    state: str | None
    delay: float | None
    run_at: datetime | None
    tolerance: float
    exact_payload: bool

    def describe(self) -> str:
        parts = []
        if self.topic is not None:
            parts.append(f"topic={self.topic!r}")
        if self.payload is not UNSET:
            parts.append(("payload==" if self.exact_payload else "payload ⊇ ")
                         + repr(self.payload))
        for name in ("tenant", "idempotency_key", "priority", "max_attempts"):
            value = getattr(self, name)
            if value is not UNSET:
                parts.append(f"{name}={value!r}")
        if self.state is not None:
            parts.append(f"state={self.state!r}")
        if self.delay is not None:
            parts.append(f"delay≈{self.delay:g}s (±{self.tolerance:g})")
        if self.run_at is not None:
            parts.append(f"run_at≈{self.run_at.isoformat()} (±{self.tolerance:g}s)")
        return ", ".join(parts) or "any event"


def payload_matches(expected: Any, actual: Any, *, exact: bool = False) -> bool:
    """Whether ``actual`` matches ``expected``.

    By default a dict matches when every key of ``expected`` is present in
    ``actual`` with a matching value (recursively: nested dicts are subsets
    too); lists and scalars must be equal. With ``exact=True`` the payloads
    must be equal.

    >>> payload_matches({"to": "a@x"}, {"to": "a@x", "cc": []})
    True
    >>> payload_matches({"to": "a@x"}, {"to": "a@x", "cc": []}, exact=True)
    False
    """
    if exact:
        return bool(expected == actual)
    if isinstance(expected, Mapping):
        return isinstance(actual, Mapping) and all(
            key in actual and payload_matches(value, actual[key])
            for key, value in expected.items())
    return bool(expected == actual)


def _find_params(f: _Filters) -> dict[str, Any]:
    """``event_find``'s parameters: an unset filter binds the value that folds away."""
    return {"topic": f.topic, "by_tenant": f.tenant is not UNSET,
            "tenant": None if f.tenant is UNSET else f.tenant, "state": f.state}


# event_find's rows, decoded: each event and its seconds until run_at.
Found = list[tuple[EventRecord, float]]


def _matches(record: EventRecord, due_in: float, f: _Filters) -> bool:
    if f.payload is not UNSET and not payload_matches(f.payload, record.payload,
                                                      exact=f.exact_payload):
        return False
    for name in ("idempotency_key", "priority", "max_attempts"):
        expected = getattr(f, name)
        if expected is not UNSET and getattr(record, name) != expected:
            return False
    if f.delay is not None and abs(due_in - f.delay) > f.tolerance:
        return False
    return f.run_at is None or abs((record.run_at - f.run_at).total_seconds()) <= f.tolerance


def _show(found: Found) -> str:
    shown = [f"  #{r.id} topic={r.topic!r} tenant={r.tenant!r} state={r.state.value}"
             f" payload={r.payload!r:.200} due_in={due_in:.1f}s"
             for r, due_in in found[-SHOWN_CANDIDATES:]]
    more = len(found) - len(shown)
    return "\n".join(([f"  ... and {more} earlier"] if more > 0 else []) + shown) or "  (none)"


def _check_found(found: Found, f: _Filters, count: int | None) -> list[EventRecord]:
    matched = [(r, due_in) for r, due_in in found if _matches(r, due_in, f)]
    if (count is None and matched) or (count is not None and len(matched) == count):
        return [r for r, _ in matched]
    wanted = "at least one event" if count is None else f"exactly {count} event(s)"
    raise AssertionError(
        f"expected {wanted} matching {f.describe()}; found {len(matched)}.\n"
        f"Events with that topic, tenant and state in the table:\n{_show(found)}")


def _check_absent(found: Found, f: _Filters) -> list[EventRecord]:
    matched = [(r, due_in) for r, due_in in found if _matches(r, due_in, f)]
    if matched:
        raise AssertionError(
            f"expected no event matching {f.describe()}; found {len(matched)}:\n{_show(matched)}")
    return []


def _filters(topic: str | None, payload: Any, tenant: Any, idempotency_key: Any, priority: Any,
             max_attempts: Any, state: EventState | str | None, delay: float | None,
             run_at: datetime | None, tolerance: float, exact_payload: bool) -> _Filters:
    return _Filters(topic, payload, tenant, idempotency_key, priority, max_attempts,
                    None if state is None else EventState(state).value, delay, run_at,
                    tolerance, exact_payload)
