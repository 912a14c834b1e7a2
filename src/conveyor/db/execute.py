# Generated from src/conveyor/db/execute_async.py by scripts/unasync.py; DO NOT EDIT.
"""Running a named query on a connection the caller owns.

A caller's connection may use any row factory (``dict_row`` is common), so
queries run on a cursor of their own with plain tuple rows: Conveyor's code
reads columns by position, whatever the caller configured.

``conveyor/db/execute_async.py`` is the source people edit;
``conveyor/db/execute.py`` is its sync twin, generated from it by
``scripts/unasync.py``.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import tuple_row

from conveyor.db.execute_async import run_async as run_async

Params = dict[str, Any] | None


def run(
    conn: psycopg.Connection[Any], query: str | bytes, params: Params = None,
) -> psycopg.Cursor[tuple[Any, ...]]:
    """Run ``query`` on a fresh tuple-row cursor of ``conn``; returns that cursor."""
    cur = conn.cursor(row_factory=tuple_row)
    cur.execute(query, params)
    return cur
