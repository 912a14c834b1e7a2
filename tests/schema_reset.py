"""Empty a migrated database between tests, every table the schema has.

The tables are read from the catalog, not listed here: a table a migration
adds is emptied too, with no fixture to update. The migrator's version table
(``<schema>.migrations``) is kept, or the database would read as unmigrated.
TRUNCATE rather than DELETE: no dead rows pile up in a database a module's
tests share, and ``RESTART IDENTITY`` gives every test ids from 1.

Only the tables that need it are truncated: those holding a row, or whose
identity sequence has handed out an id since its last restart (a rolled-back
insert spends one too). The others are already as TRUNCATE ... RESTART
IDENTITY would leave them. A TRUNCATE costs a new file per table and index
(measured 2026-12-03 on the loaded 2-core box: 235 ms for the nine tables in
a rolled-back transaction, the median of 15; most tests leave most tables
empty), the check a few index probes.
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

# The tables of the schema owning a sequence (identity or serial) that has
# handed out a value since it was created or restarted.
_USED_SEQUENCES = """
SELECT t.relname
FROM pg_sequences q
JOIN pg_namespace n ON n.nspname = q.schemaname
JOIN pg_class s ON s.relnamespace = n.oid AND s.relname = q.sequencename
JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = s.oid
                AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')
JOIN pg_class t ON t.oid = d.refobjid
WHERE q.schemaname = %s AND q.last_value IS NOT NULL
"""


def _with_rows(schema: str, tables: list[str]) -> sql.Composed:
    """One statement naming the tables of ``tables`` that hold a row."""
    return sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {} WHERE EXISTS (SELECT FROM {})").format(
            sql.Literal(name), sql.Identifier(schema, name))
        for name in tables)


def _truncate(schema: str, tables: list[str]) -> sql.Composed:
    names = sql.SQL(", ").join(sql.Identifier(schema, name) for name in tables)
    return sql.SQL("TRUNCATE {} RESTART IDENTITY").format(names)


def _to_truncate(tables: list[str], with_rows: list[tuple[Any, ...]],
                 used: list[tuple[Any, ...]]) -> list[str]:
    dirty = {name for (name,) in with_rows} | {name for (name,) in used}
    return [name for name in tables if name in dirty]


def empty_schema(conn: psycopg.Connection[Any], schema: str = SCHEMA) -> None:
    """Empty every table of ``schema`` but the version table, in ``conn``'s transaction if any."""
    # tuple rows whatever the connection's row factory (some tests use dict_row)
    cursor = conn.cursor(row_factory=tuple_row)
    tables = [name for (name,) in cursor.execute(_TABLES, (schema, VERSION_TABLE)).fetchall()]
    if not tables:
        return
    with_rows = cursor.execute(_with_rows(schema, tables)).fetchall()
    used = cursor.execute(_USED_SEQUENCES, (schema,)).fetchall()
    if dirty := _to_truncate(tables, with_rows, used):
        conn.execute(_truncate(schema, dirty))


async def empty_schema_async(conn: psycopg.AsyncConnection[Any], schema: str = SCHEMA) -> None:
    """Async twin of ``empty_schema``."""
    cursor = conn.cursor(row_factory=tuple_row)
    await cursor.execute(_TABLES, (schema, VERSION_TABLE))
    tables = [name for (name,) in await cursor.fetchall()]
    if not tables:
        return
    await cursor.execute(_with_rows(schema, tables))
    with_rows = await cursor.fetchall()
    await cursor.execute(_USED_SEQUENCES, (schema,))
    used = await cursor.fetchall()
    if dirty := _to_truncate(tables, with_rows, used):
        await conn.execute(_truncate(schema, dirty))


def reset_database(url: str, schema: str = SCHEMA) -> None:
    """Empty the schema of the database at ``url`` (committed; waits at most 5 s for locks).

    A lock still held after 5 s means a previous test left a session behind:
    fail then rather than at the suite's timeout.
    """
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '5s'")
        empty_schema(conn, schema)
