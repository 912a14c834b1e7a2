"""Migrations 0006 and 0007: the events table holds a W3C trace context, sized and validated
(by domains since 0007, refused with the domain rule's name)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _insert(conn: psycopg.Connection[Any], traceparent: str | None, tracestate: str | None) -> None:
    conn.execute("INSERT INTO conveyor.events (topic, payload, traceparent, tracestate)"
                 " VALUES ('t.x', '{}', %s, %s)", (traceparent, tracestate))


def test_an_event_may_carry_no_trace_context(conn: psycopg.Connection[Any]) -> None:
    _insert(conn, None, None)


def test_a_w3c_traceparent_and_tracestate_are_stored(conn: psycopg.Connection[Any]) -> None:
    _insert(conn, GOOD, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    found = conn.execute("SELECT traceparent, tracestate FROM conveyor.events"
                         " WHERE traceparent IS NOT NULL").fetchall()
    assert found == [(GOOD, "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")]


@pytest.mark.parametrize("bad", [
    "",
    GOOD + "0",                                                   # too long
    GOOD[:-1],                                                    # too short
    GOOD.upper(),                                                 # uppercase hex
    "01" + GOOD[2:],                                              # another version
    "00-4bf92f3577b34da6a3ce929d0e0e47366-0f067aa0ba902b7-01",    # field widths moved
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bz-01",    # not hex
    "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",    # separator
])
def test_a_malformed_traceparent_is_refused(conn: psycopg.Connection[Any], bad: str) -> None:
    with pytest.raises(psycopg.errors.CheckViolation, match="traceparent_check"):
        _insert(conn, bad, None)


def test_a_tracestate_longer_than_512_characters_is_refused(conn: psycopg.Connection[Any]) -> None:
    _insert(conn, GOOD, "k=" + "v" * 510)
    with pytest.raises(psycopg.errors.CheckViolation, match="tracestate_check"):
        _insert(conn, GOOD, "k=" + "v" * 511)
