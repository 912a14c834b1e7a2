# Generated from src/conveyor/testing/assertions_async.py by scripts/unasync.py; DO NOT EDIT.
"""``assert_enqueued`` / ``refute_enqueued``: what did my code put in the outbox?

They read the events table on the connection you pass, so they see the events
of your test's own (uncommitted) transaction, through the ``event_find`` named
query. Matching and the failure message are the I/O-free
:mod:`conveyor.testing.assertions_core`.

``conveyor/testing/assertions_async.py`` is the source people edit;
``conveyor/testing/assertions.py`` is its sync twin, generated from it by
``scripts/unasync.py``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from conveyor.db.execute import run
from conveyor.db.named_queries import queries_for
from conveyor.db.rows import found_from_event_find_row
from conveyor.testing.assertions_async import assert_enqueued_async as assert_enqueued_async
from conveyor.testing.assertions_async import refute_enqueued_async as refute_enqueued_async
from conveyor.testing.assertions_core import TOLERANCE_DEFAULT as TOLERANCE_DEFAULT
from conveyor.testing.assertions_core import UNSET as UNSET
from conveyor.testing.assertions_core import (
    Found,
    _check_absent,
    _check_found,
    _Filters,
    _filters,
    _find_params,
)
from conveyor.testing.assertions_core import payload_matches as payload_matches
from conveyor.types import EventRecord, EventState


def _found(conn: psycopg.Connection[Any], schema: str, f: _Filters) -> Found:
    cur = run(conn, queries_for(schema)["event_find"], _find_params(f))
    return [found_from_event_find_row(r) for r in cur.fetchall()]


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
            signup(conn, "ada@example.com")       # calls producer.enqueue(conn, ...)
            [event] = assert_enqueued(
                conn, "email.send", payload={"to": "ada@example.com"}, tenant="acme", count=1)
            assert event.max_attempts == 5
    """
    f = _filters(topic, payload, tenant, idempotency_key, priority, max_attempts, state, delay,
                 run_at, tolerance, exact_payload)
    return _check_found(_found(conn, schema, f), f, count)


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
    return _check_absent(_found(conn, schema, f), f)
