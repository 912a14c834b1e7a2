"""A test's LISTEN connection that waits for wake-ups as a worker does.

Producers send a wake-up only while somebody holds the wake gate
(conveyor/db/queries/wakes.sql): a test that expects one holds it first, as
a waiting worker, parked tenant or ordered relay stream would.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from conveyor.db.named_queries import queries_for
from conveyor.db.wake_gate import EVERY_SLOT


def hold_wake_gate(conn: psycopg.Connection[Any], schema: str = "conveyor") -> int:
    """Hold every slot of ``schema``'s wake gate on ``conn`` (autocommit); the slots held."""
    return conn.execute(queries_for(schema)["wake_gate_hold"], {"held": 0}).fetchone()[0]


def listen_for_wakes(conn: psycopg.Connection[Any], schema: str = "conveyor") -> None:
    """LISTEN on ``schema``'s wake-up channel and hold its gate, every slot."""
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(queries_for(schema).channel)))
    assert hold_wake_gate(conn, schema) == EVERY_SLOT
