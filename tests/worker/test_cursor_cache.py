"""CursorCache: one cursor per component, remade when its connection is replaced."""

from __future__ import annotations

import psycopg

from conveyor.worker.connection import CursorCache


async def test_one_cursor_serves_statements_in_turn_until_the_connection_changes(
        shared_db_url: str) -> None:
    cache = CursorCache(binary=True)
    first = await psycopg.AsyncConnection.connect(shared_db_url, autocommit=True)
    second = await psycopg.AsyncConnection.connect(shared_db_url, autocommit=True)
    try:
        cur = cache.get(first)
        assert cache.get(first) is cur
        for n in (1, 2, 3):
            await cur.execute("SELECT %s::int, 'x' || %s::text", (n, n))
            assert await cur.fetchall() == [(n, f"x{n}")]
        await first.close()                       # replaced, as after a lost connection
        replacement = cache.get(second)
        assert replacement is not cur and replacement.connection is second
        await replacement.execute("SELECT 42")
        assert await replacement.fetchall() == [(42,)]
        assert cache.get(second) is replacement
    finally:
        await first.close()
        await second.close()


async def test_a_failed_statement_leaves_the_cursor_usable(shared_db_url: str) -> None:
    cache = CursorCache()
    conn = await psycopg.AsyncConnection.connect(shared_db_url, autocommit=True)
    try:
        cur = cache.get(conn)
        try:
            await cur.execute("SELECT 1/0")
        except psycopg.errors.DivisionByZero:
            pass
        else:
            raise AssertionError("the division by zero was not reported")
        await cache.get(conn).execute("SELECT 'ok'")
        assert await cache.get(conn).fetchall() == [("ok",)]
    finally:
        await conn.close()
