"""Rows are read by name: each decoder's column list against its query's real columns.

A query's column names come from ``cursor.description`` on a real database,
so reordering, renaming or adding a column in a SELECT (or a RETURNING) fails
here instead of silently shifting fields.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from conveyor.db import rows
from conveyor.db.named_queries import queries_for
from conveyor.worker import claims

Q = queries_for("conveyor")

# Parameters that make each decoded query run (and match nothing).
PARAMS: dict[str, dict[str, Any]] = {
    "event_claim": {"all_topics": True, "topics": [], "prefixes": [], "all_tenants": True,
                    "tenants": [], "limit": 0, "owner": str(uuid.uuid4()), "lease_ttl": 1.0},
    "event_get": {"id": 0},
    "event_claim_crashed": {"ids": [], "crashes": [], "owner": str(uuid.uuid4()), "window_no": 0,
                            "lease_ttl": 1.0},
    "event_find": {"topic": None, "by_tenant": False, "tenant": None, "state": None},
    "worker_list_alive": {"within": 30.0},
    "event_result": {"id": 0},
    "cron_list": {},
    "history_list": {},
}

PARAMS["event_claim_held"] = PARAMS["event_claim"]


def test_every_decoded_query_has_parameters_here() -> None:
    assert sorted(rows.DECODED) == sorted(PARAMS)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_query_columns_equal_the_decoders_fields(conn: psycopg.Connection[Any], name: str) -> None:
    cur = conn.cursor()
    cur.execute(Q[name], PARAMS[name])
    assert cur.description is not None
    assert tuple(c.name for c in cur.description) == rows.DECODED[name]


def test_claim_decoder_unpacks_the_columns_in_their_order() -> None:
    event = rows.event_from_claim_row(tuple(rows.CLAIM_COLUMNS))
    slots = {"payload": "_payload_text", "attempts": "attempt"}
    for column in rows.CLAIM_COLUMNS:
        assert getattr(event, slots.get(column, column)) == column


def test_worker_sorts_a_batch_by_the_claim_priority_column() -> None:
    assert claims._PRIORITY(rows.CLAIM_COLUMNS) == "priority"


def test_record_decoder_reads_every_event_get_column_by_name() -> None:
    row = [f"v-{c}" for c in rows.EVENT_GET_COLUMNS]
    row[rows.EVENT_GET_COLUMNS.index("state")] = "failed"
    row[rows.EVENT_GET_COLUMNS.index("errors")] = []
    record = rows.record_from_event_get_row(row)
    for column in rows.EVENT_GET_COLUMNS:
        if column not in ("state", "errors"):
            assert getattr(record, column) == f"v-{column}"


def test_record_decoder_refuses_a_row_of_another_width() -> None:
    with pytest.raises(ValueError):
        rows.record_from_event_get_row(("too", "short"))


def test_a_claimed_event_carries_its_trace_context(conn: psycopg.Connection[Any]) -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    conn.execute("INSERT INTO conveyor.events (topic, payload, traceparent, tracestate, priority)"
                 " VALUES ('rows.traced', '{}', %s, 'k=v', 32000), ('rows.plain', '{}', NULL, NULL,"
                 " 32000)", (traceparent,))
    params = {**PARAMS["event_claim"], "all_topics": False, "topics": ["rows.traced", "rows.plain"],
              "limit": 2}
    claimed = {e.topic: e for e in map(rows.event_from_claim_row,
                                       conn.execute(Q["event_claim"], params).fetchall())}
    assert (claimed["rows.traced"].traceparent, claimed["rows.traced"].tracestate) == (
        traceparent, "k=v")
    assert (claimed["rows.plain"].traceparent, claimed["rows.plain"].tracestate) == (None, None)
