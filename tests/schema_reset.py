"""Empty a migrated database between tests, every table the schema has.

The tables are read from the catalog, not listed here: a table a migration
adds is emptied too, with no fixture to update. The migrator's version table
(``<schema>.migrations``) is kept, or the database would read as unmigrated.
TRUNCATE rather than DELETE: no dead rows pile up in a database a module's
tests share, and ``RESTART IDENTITY`` gives every test ids from 1.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

SCHEMA = "conveyor"
VERSION_TABLE = "migrations"

# Partitions go with their parent; the schema's sequences restart with their tables.
_TABLES = """
SELECT c.relname
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relkind IN ('r', 'p') AND NOT c.relispartition AND c.relname <> %s
ORDER BY c.relname
"""


def _truncate(schema: str, tables: list[tuple[Any, ...]]) -> sql.Composed:
    names = sql.SQL(", ").join(sql.Identifier(schema, name) for (name,) in tables)
    return sql.SQL("TRUNCATE {} RESTART IDENTITY").format(names)


def empty_schema(conn: psycopg.Connection[Any], schema: str = SCHEMA) -> None:
    """Empty every table of ``schema`` but the version table, in ``conn``'s transaction if any."""
    # tuple rows whatever the connection's row factory (some tests use dict_row)
    tables = conn.cursor(row_factory=tuple_row).execute(_TABLES, (schema, VERSION_TABLE)).fetchall()
    if tables:
        conn.execute(_truncate(schema, tables))


async def empty_schema_async(conn: psycopg.AsyncConnection[Any], schema: str = SCHEMA) -> None:
    """Async twin of ``empty_schema``."""
    cursor = await conn.cursor(row_factory=tuple_row).execute(_TABLES, (schema, VERSION_TABLE))
    tables = await cursor.fetchall()
    if tables:
        await conn.execute(_truncate(schema, tables))


def reset_database(url: str, schema: str = SCHEMA) -> None:
    """Empty the schema of the database at ``url`` (committed; waits at most 5 s for locks).

    A lock still held after 5 s means a previous test left a session behind:
    fail then rather than at the suite's timeout.
    """
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '5s'")
        empty_schema(conn, schema)
