"""``assert_enqueued`` / ``refute_enqueued``: what did my code put in the outbox?

They read the events table on the connection you pass, so they see the events
of your test's own (uncommitted) transaction. The I/O-free parts (building the
query, matching payloads, formatting the failure) are shared by the sync and
async variants.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from conveyor.admin import record_from_row
from conveyor.types import EventRecord, EventState
from conveyor.validation import check_schema_name


class _Unset(Enum):
    UNSET = "UNSET"


UNSET = _Unset.UNSET
"""Marks a filter that was not given (``None`` is a real value: "no tenant")."""

TOLERANCE_DEFAULT = 1.0
SHOWN_CANDIDATES = 10

_COLUMNS = sql.SQL(
    "id, tenant, topic, payload, state, attempts, max_attempts, priority, run_at, "
    "lease_owner::text, lease_expires_at, last_error, errors, idempotency_key, "
    "created_at, updated_at, attempted_at, finished_at, "
    "extract(epoch FROM run_at - now())::float8"
)


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


def _where(schema: str, f: _Filters) -> tuple[sql.Composed, dict[str, Any]]:
    conditions: list[sql.Composable] = []
    params: dict[str, Any] = {}
    if f.topic is not None:
        conditions.append(sql.SQL("topic = %(topic)s"))
        params["topic"] = f.topic
    if f.tenant is not UNSET:
        conditions.append(sql.SQL("tenant IS NOT DISTINCT FROM %(tenant)s"))
        params["tenant"] = f.tenant
    if f.state is not None:
        conditions.append(sql.SQL("state = %(state)s"))
        params["state"] = EventState(f.state).value
    where = sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("true")
    query = sql.SQL("SELECT {} FROM {}.events WHERE {} ORDER BY id").format(
        _COLUMNS, sql.Identifier(check_schema_name(schema)), where)
    return query, params


def record_query(schema: str) -> sql.Composed:
    """One event by ``%(id)s``, in the column order :func:`event_record` reads."""
    return sql.SQL("SELECT {} FROM {}.events WHERE id = %(id)s").format(
        _COLUMNS, sql.Identifier(check_schema_name(schema)))


# Tuple cursors whatever the connection's row_factory (dict_row is common in apps).
def _rows(conn: psycopg.Connection[Any], query: sql.Composed,
          params: dict[str, Any]) -> list[tuple[Any, ...]]:
    return conn.cursor(row_factory=tuple_row).execute(query, params).fetchall()


async def _rows_async(conn: psycopg.AsyncConnection[Any], query: sql.Composed,
                      params: dict[str, Any]) -> list[tuple[Any, ...]]:
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(query, params)
    return await cur.fetchall()


def event_record(row: Sequence[Any]) -> EventRecord:
    """An :class:`EventRecord` from a row selected with :func:`record_query`'s columns."""
    return record_from_row(row)


def _row_matches(row: Sequence[Any], f: _Filters) -> bool:
    record = event_record(row)
    if f.payload is not UNSET and not payload_matches(f.payload, record.payload,
                                                      exact=f.exact_payload):
        return False
    for name in ("idempotency_key", "priority", "max_attempts"):
        expected = getattr(f, name)
        if expected is not UNSET and getattr(record, name) != expected:
            return False
    if f.delay is not None and abs(row[18] - f.delay) > f.tolerance:
        return False
    return f.run_at is None or abs((record.run_at - f.run_at).total_seconds()) <= f.tolerance


def _show(rows: Sequence[Sequence[Any]]) -> str:
    shown = [f"  #{r[0]} topic={r[2]!r} tenant={r[1]!r} state={r[4]} payload={r[3]!r:.200}"
             f" due_in={r[18]:.1f}s" for r in rows[-SHOWN_CANDIDATES:]]
    more = len(rows) - len(shown)
    return "\n".join(([f"  ... and {more} earlier"] if more > 0 else []) + shown) or "  (none)"


def _check_found(rows: Sequence[Sequence[Any]], f: _Filters, count: int | None,
                 ) -> list[EventRecord]:
    matched = [r for r in rows if _row_matches(r, f)]
    if (count is None and matched) or (count is not None and len(matched) == count):
        return [event_record(r) for r in matched]
    wanted = "at least one event" if count is None else f"exactly {count} event(s)"
    raise AssertionError(
        f"expected {wanted} matching {f.describe()}; found {len(matched)}.\n"
        f"Events with that topic, tenant and state in the table:\n{_show(rows)}")


def _check_absent(rows: Sequence[Sequence[Any]], f: _Filters) -> list[EventRecord]:
    matched = [r for r in rows if _row_matches(r, f)]
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


def assert_enqueued(
    conn: psycopg.Connection[Any],
    topic: str | None = None,
    *,
    payload: Any = UNSET,
    tenant: Any = UNSET,
    idempotency_key: Any = UNSET,
    priority: Any = UNSET,
    max_attempts: Any = UNSET,
    state: EventState | str | None = None,
    delay: float | None = None,
    run_at: datetime | None = None,
    tolerance: float = TOLERANCE_DEFAULT,
    count: int | None = None,
    exact_payload: bool = False,
    schema: str = "conveyor",
) -> list[EventRecord]:
    """Assert that events matching every given field exist; returns them (oldest first).

    Only the fields you pass are compared. ``payload`` matches as a *subset*
    by default (every key you give must be there with a matching value, nested
    dicts likewise; lists and scalars compare equal); pass
    ``exact_payload=True`` for equality. ``tenant=None`` means "no tenant".
    ``delay`` is the expected number of seconds from the transaction's
    ``now()`` until ``run_at``; ``run_at`` an expected timestamp; both match
    within ``tolerance`` seconds. ``count`` demands exactly that many matches
    instead of at least one. Raises :class:`AssertionError` listing the events
    that were there when nothing matches.

    Defaults: any state, ``tolerance`` 1.0 s, at least one match, schema
    ``"conveyor"``.

    Example::

        def test_signup_sends_welcome_mail(conn):
            signup(conn, "ada@example.com")           # calls producer.enqueue(conn, ...)
            [event] = assert_enqueued(conn, "email.send", payload={"to": "ada@example.com"},
                                      tenant="acme", count=1)
            assert event.max_attempts == 5
    """
    f = _filters(topic, payload, tenant, idempotency_key, priority, max_attempts, state, delay,
                 run_at, tolerance, exact_payload)
    query, params = _where(schema, f)
    return _check_found(_rows(conn, query, params), f, count)


def refute_enqueued(
    conn: psycopg.Connection[Any],
    topic: str | None = None,
    *,
    payload: Any = UNSET,
    tenant: Any = UNSET,
    idempotency_key: Any = UNSET,
    priority: Any = UNSET,
    max_attempts: Any = UNSET,
    state: EventState | str | None = None,
    delay: float | None = None,
    run_at: datetime | None = None,
    tolerance: float = TOLERANCE_DEFAULT,
    exact_payload: bool = False,
    schema: str = "conveyor",
) -> list[EventRecord]:
    """Assert that no event matches the given fields (same matching as :func:`assert_enqueued`).

    Returns the (empty) list of matches; raises :class:`AssertionError`
    listing the offending events otherwise.

    Example::

        def test_failed_signup_sends_nothing(conn):
            with pytest.raises(SignupError):
                signup(conn, "not-an-address")
            refute_enqueued(conn, "email.send")
    """
    f = _filters(topic, payload, tenant, idempotency_key, priority, max_attempts, state, delay,
                 run_at, tolerance, exact_payload)
    query, params = _where(schema, f)
    return _check_absent(_rows(conn, query, params), f)


async def assert_enqueued_async(
    conn: psycopg.AsyncConnection[Any],
    topic: str | None = None,
    *,
    payload: Any = UNSET,
    tenant: Any = UNSET,
    idempotency_key: Any = UNSET,
    priority: Any = UNSET,
    max_attempts: Any = UNSET,
    state: EventState | str | None = None,
    delay: float | None = None,
    run_at: datetime | None = None,
    tolerance: float = TOLERANCE_DEFAULT,
    count: int | None = None,
    exact_payload: bool = False,
    schema: str = "conveyor",
) -> list[EventRecord]:
    """The async twin of :func:`assert_enqueued`.

    Example::

        async def test_signup(aconn):
            await signup(aconn, "ada@example.com")
            await assert_enqueued_async(aconn, "email.send", payload={"to": "ada@example.com"})
    """
    f = _filters(topic, payload, tenant, idempotency_key, priority, max_attempts, state, delay,
                 run_at, tolerance, exact_payload)
    query, params = _where(schema, f)
    return _check_found(await _rows_async(conn, query, params), f, count)


async def refute_enqueued_async(
    conn: psycopg.AsyncConnection[Any],
    topic: str | None = None,
    *,
    payload: Any = UNSET,
    tenant: Any = UNSET,
    idempotency_key: Any = UNSET,
    priority: Any = UNSET,
    max_attempts: Any = UNSET,
    state: EventState | str | None = None,
    delay: float | None = None,
    run_at: datetime | None = None,
    tolerance: float = TOLERANCE_DEFAULT,
    exact_payload: bool = False,
    schema: str = "conveyor",
) -> list[EventRecord]:
    """The async twin of :func:`refute_enqueued`."""
    f = _filters(topic, payload, tenant, idempotency_key, priority, max_attempts, state, delay,
                 run_at, tolerance, exact_payload)
    query, params = _where(schema, f)
    return _check_absent(await _rows_async(conn, query, params), f)
