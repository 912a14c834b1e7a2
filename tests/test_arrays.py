"""Array literals for hot statements: what PostgreSQL parses back is what went in."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from conveyor.db.arrays import int_array, text_array

AWKWARD = ["plain", "", "NULL", "null", "with space", "comma,inside", "{braces}", 'quote"d',
           "back\\slash", "trailing\\", "billing\\_x.%", "ünïcødé", "tab\there", "new\nline"]


@pytest.mark.parametrize("values", [[], ["one"], AWKWARD], ids=["empty", "one", "awkward"])
def test_text_array_round_trips(conn: psycopg.Connection[Any], values: list[str]) -> None:
    row = conn.execute("SELECT %s::text[]", (text_array(values),)).fetchone()
    assert row is not None and row[0] == values


def test_text_array_matches_like_patterns_as_psycopg_lists_do(conn: psycopg.Connection[Any]) -> None:
    # The claim's prefix filter: escaped LIKE patterns keep their meaning.
    patterns = ["billing\\_x.%", "a.%"]
    query = "SELECT t FROM unnest(%s::text[]) AS t WHERE t LIKE ANY(%s::text[]) ORDER BY t"
    topics = ["billing_x.paid", "billingYx.paid", "a.b", "b.a"]
    as_list = conn.execute(query, (topics, patterns)).fetchall()
    as_literal = conn.execute(query, (topics, text_array(patterns))).fetchall()
    assert as_literal == as_list == [("a.b",), ("billing_x.paid",)]


def test_int_array_round_trips(conn: psycopg.Connection[Any]) -> None:
    values = [1, 0, -5, 2**62]
    row = conn.execute("SELECT %s::bigint[], %s::bigint[]", (int_array(values), int_array([]))
                       ).fetchone()
    assert row == (values, [])
