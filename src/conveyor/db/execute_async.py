"""Running a named query on a connection the caller owns.

A caller's connection may use any row factory (``dict_row`` is common), so
queries run on a cursor of their own with plain tuple rows: Conveyor's code
reads columns by position, whatever the caller configured.

``conveyor/db/execute_async.py`` is the source people edit;
``conveyor/db/execute.py`` is its sync twin, generated from it by
``scripts/unasync.py``.
"""

from __future__ import annotations

from typing import Any, TypeVar

import psycopg
from psycopg.rows import tuple_row

# unasync: from conveyor.db.execute_async import (
# unasync:     execute_past_moves_async as execute_past_moves_async,
# unasync: )
# unasync: from conveyor.db.execute_async import run_async as run_async
# unasync: from conveyor.db.execute_async import run_past_moves_async as run_past_moves_async

Params = dict[str, Any] | None
Row = TypeVar("Row")


async def run_async(
    conn: psycopg.AsyncConnection[Any], query: str | bytes, params: Params = None,
) -> psycopg.AsyncCursor[tuple[Any, ...]]:
    """Run ``query`` on a fresh tuple-row cursor of ``conn``; returns that cursor."""
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(query, params)
    return cur


async def run_past_moves_async(
    conn: psycopg.AsyncConnection[Any], query: str | bytes, params: Params = None,
) -> psycopg.AsyncCursor[tuple[Any, ...]]:
    """:func:`run_async`, once more if a row it waited for was moved meanwhile
    (:func:`execute_past_moves_async`)."""
    return await execute_past_moves_async(conn, conn.cursor(row_factory=tuple_row), query,
                                          params)


async def execute_past_moves_async(
    conn: psycopg.AsyncConnection[Any], cur: psycopg.AsyncCursor[Row], query: str | bytes,
    params: Params = None, *, prepare: bool | None = None,
) -> psycopg.AsyncCursor[Row]:
    """Execute ``query`` on ``cur``, once more if a row it waited for was moved meanwhile.

    Since migration 0025 an acknowledgement moves a finished event into the
    history's partition, and a statement that waited for that row's lock
    fails with SQLSTATE 40001 ("tuple to be locked was already moved to
    another partition due to concurrent update"). Run again, it finds the
    row where it went, as it now is. The first run is in a savepoint (its own
    transaction on an idle connection), so the caller's transaction outlives
    its failure. For an operator's statements: the worker's never wait for a
    running event's lock.
    """
    try:
        async with conn.transaction():
            return await cur.execute(query, params, prepare=prepare)
    except psycopg.errors.SerializationFailure:
        return await cur.execute(query, params, prepare=prepare)
