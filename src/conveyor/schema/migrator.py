# Generated from src/conveyor/schema/migrator_async.py by scripts/unasync.py; DO NOT EDIT.
"""Applies the numbered migrations in ``migrations/`` exactly once.

Every migrator takes a transaction-scoped advisory lock keyed on the schema
before reading the version table, so any number of processes may start at the
same moment: the first applies what is missing, the others wait for its
commit, then find nothing left to do.

``schema/migrator_async.py`` (:class:`Migrator`) is the source people
edit; ``schema/migrator.py`` (``Migrator``) is its sync twin, generated from it
by ``scripts/unasync.py``. The migrations and the plan are the I/O-free core
in :mod:`conveyor.schema.migrator_core`.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from conveyor.db.execute import run
from conveyor.db.named_queries import queries_for
from conveyor.errors import MigrationError
from conveyor.schema.migrator_async import AsyncMigrator as AsyncMigrator
from conveyor.schema.migrator_core import (
    Migration,
    _plan,
    check_current,
    latest_version,
    load_migrations,
    migration_script,
)
from conveyor.validation import check_schema_name

# The core's public names, re-exported: this module is where they are imported from.
__all__ = [
    "Migration",
    "latest_version",
    "load_migrations",
    "migration_script",
]


class Migrator:
    """Brings a schema up to date on the connection you pass.

    Example::

        with psycopg.connect(dsn) as conn:
            applied = Migrator("conveyor").apply(conn)
    """

    def __init__(self, schema: str = "conveyor") -> None:
        self.schema = check_schema_name(schema)
        self._q = queries_for(self.schema)

    def apply(self, conn: psycopg.Connection[Any]) -> list[Migration]:
        """Apply missing migrations in one transaction; returns what was applied."""
        q = self._q
        try:
            with conn.transaction():
                run(conn, q["migration_lock"], {"schema": self.schema})
                run(conn, q["migration_create_schema"])
                run(conn, q["migration_create_table"])
                cur = run(conn, q["migration_applied"])
                todo = _plan(self.schema, [r[0] for r in cur.fetchall()])
                for m in todo:
                    run(conn, m.render(self.schema).encode())
                    run(conn, q["migration_record"],
                                    {"version": m.version, "name": m.name})
        except psycopg.Error as exc:
            raise MigrationError(f"migrating schema {self.schema!r} failed: {exc}") from exc
        return todo

    def pending(self, conn: psycopg.Connection[Any]) -> list[Migration]:
        """The migrations not applied yet, oldest first."""
        return _plan(self.schema, self.applied_versions(conn))

    def require_current(self, conn: psycopg.Connection[Any]) -> None:
        """Raise MigrationError unless the schema is exactly at this Conveyor's migration.

        What workers and one-off commands check before touching the tables: a
        schema that is missing or older says to run ``conveyor migrate``, a
        newer one says to upgrade Conveyor.
        """
        check_current(self.schema, self.applied_versions(conn))

    def applied_versions(self, conn: psycopg.Connection[Any]) -> list[int]:
        """The versions recorded in the schema's version table; [] before the first migration."""
        q = self._q
        table = sql.Identifier(self.schema, "migrations").as_string()
        cur = run(conn, q["migration_table_exists"], {"table": table})
        exists = cur.fetchone()
        if not exists or not exists[0]:
            return []
        cur = run(conn, q["migration_applied"])
        return [r[0] for r in cur.fetchall()]
