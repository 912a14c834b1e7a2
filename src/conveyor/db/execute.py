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

from typing import Any, TypeVar

import psycopg
from psycopg.rows import tuple_row

from conveyor.db.execute_async import (
    execute_past_moves_async as execute_past_moves_async,
)
from conveyor.db.execute_async import run_async as run_async
from conveyor.db.execute_async import run_past_moves_async as run_past_moves_async

Params = dict[str, Any] | None
Row = TypeVar("Row")


def run(
    conn: psycopg.Connection[Any], query: str | bytes, params: Params = None,
) -> psycopg.Cursor[tuple[Any, ...]]:
    """Run ``query`` on a fresh tuple-row cursor of ``conn``; returns that cursor."""
    cur = conn.cursor(row_factory=tuple_row)
    cur.execute(query, params)
    return cur


def run_past_moves(
    conn: psycopg.Connection[Any], query: str | bytes, params: Params = None,
) -> psycopg.Cursor[tuple[Any, ...]]:
    """:func:`run`, once more if a row it waited for was moved meanwhile
    (:func:`execute_past_moves`)."""
    return execute_past_moves(conn, conn.cursor(row_factory=tuple_row), query,
                                          params)


def execute_past_moves(
    conn: psycopg.Connection[Any], cur: psycopg.Cursor[Row], query: str | bytes,
    params: Params = None, *, prepare: bool | None = None,
) -> psycopg.Cursor[Row]:
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
        with conn.transaction():
            return cur.execute(query, params, prepare=prepare)
    except psycopg.errors.SerializationFailure:
        return cur.execute(query, params, prepare=prepare)
