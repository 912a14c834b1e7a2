"""Running a named query on a connection the caller owns.

A caller's connection may use any row factory (``dict_row`` is common), so
queries run on a cursor of its own with plain tuple rows: Conveyor's code
reads columns by position, whatever the caller configured.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import tuple_row

Params = dict[str, Any] | None


def run(conn: psycopg.Connection[Any], query: str | bytes,
        params: Params = None) -> psycopg.Cursor[tuple[Any, ...]]:
    cur = conn.cursor(row_factory=tuple_row)
    cur.execute(query, params)
    return cur


async def run_async(conn: psycopg.AsyncConnection[Any], query: str | bytes,
                    params: Params = None) -> psycopg.AsyncCursor[tuple[Any, ...]]:
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(query, params)
    return cur
