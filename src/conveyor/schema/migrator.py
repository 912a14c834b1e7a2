# Generated from src/conveyor/schema/migrator_async.py by scripts/unasync.py; DO NOT EDIT.
"""Applies the numbered migrations in ``migrations/`` exactly once.

Every migrator takes a transaction-scoped advisory lock keyed on the schema
before reading the version table, so any number of processes may start at the
same moment: the first applies what is missing, the others wait for its
commit, then find nothing left to do.

A stepped migration (see :mod:`conveyor.schema.migrator_core`) cannot run in
that one transaction: the migrations before it are applied and committed
first, then each of its steps commits on its own, recorded in
``<schema>.migration_steps``, so a migrator stopped between steps resumes at
the next one. Across its steps the migrator holds a session-level advisory
lock of its own key, released at the end, error or not (a lost connection
takes it along); the others try it every quarter second, holding no snapshot
between tries, which a ``CREATE INDEX CONCURRENTLY`` step would wait for. A
session lock needs the session to stay on one server connection, which a
pooler in transaction mode (PgBouncer) does not promise: the lock would stay
on a server connection handed to other clients while the steps ran on
others. So the migrator refuses to run steps through a pooler; migrate on a
direct connection. Migrations without steps keep the transaction lock alone,
safe through any pooler.

``schema/migrator_async.py`` (:class:`Migrator`) is the source people
edit; ``schema/migrator.py`` (``Migrator``) is its sync twin, generated from it
by ``scripts/unasync.py``. The migrations and the plan are the I/O-free core
in :mod:`conveyor.schema.migrator_core`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from conveyor.db.execute import run
from conveyor.db.named_queries import queries_for
from conveyor.errors import MigrationError
from conveyor.schema.migrator_async import AsyncMigrator as AsyncMigrator
from conveyor.schema.migrator_core import (
    Migration,
    Step,
    _plain_prefix,
    _plan,
    check_current,
    known_migrations,
    latest_version,
    load_migrations,
)
from conveyor.schema.migrator_script import migration_script, migration_script_parts
from conveyor.validation import check_schema_name

# The core's public names, re-exported: this module is where they are imported from.
__all__ = [
    "Migration",
    "Step",
    "latest_version",
    "load_migrations",
    "migration_script",
    "migration_script_parts",
]

logger = logging.getLogger(__name__)

# The next stepped migration to run, and its steps already recorded.
_Resume = tuple[Migration, set[int]]

# How long a migrator waits between two tries of the steps lock, in seconds.
_STEPS_LOCK_PAUSE = 0.25


def _needs_session_lock(m: Migration) -> bool:
    """Whether ``m`` has a step that runs outside a transaction.

    Steps in transactions exclude each other by the transaction lock, each
    checking its record first: safe through a pooler. A ``no-transaction``
    step cannot take that lock, so the migrator running it holds the steps
    lock for the session.
    """
    return any(not step.transaction for step in m.steps)


class Migrator:
    """Brings a schema up to date on the connection you pass.

    ``migrations`` replaces the package's numbered migrations (for tests);
    defaults to the package's.

    Example::

        with psycopg.connect(dsn) as conn:
            applied = Migrator("conveyor").apply(conn)
    """

    def __init__(self, schema: str = "conveyor", *,
                 migrations: Sequence[Migration] | None = None) -> None:
        self.schema = check_schema_name(schema)
        self._q = queries_for(self.schema)
        self._migrations = None if migrations is None else known_migrations(migrations)

    def apply(self, conn: psycopg.Connection[Any]) -> list[Migration]:
        """Apply missing migrations; returns what was applied.

        Migrations without steps are applied together in one transaction, as
        far as the first stepped one; each step of that one then commits on
        its own (so a stepped migration needs a connection with no
        transaction open), then the next ones follow the same way.
        """
        outer = conn.info.transaction_status != TransactionStatus.IDLE
        try:
            applied, resume = self._apply_plain(conn, outer=outer)
            locked = False
            try:
                while resume is not None:
                    if _needs_session_lock(resume[0]) and not locked:
                        self._lock_session(conn)
                        locked = True
                        # Read again under the steps lock: another migrator may
                        # have run steps, or whole migrations, while this one waited.
                        more, resume = self._apply_plain(conn, outer=outer)
                        applied += more
                        continue
                    if self._apply_steps(conn, *resume):
                        applied.append(resume[0])
                    more, resume = self._apply_plain(conn, outer=outer)
                    applied += more
            finally:
                if locked and not conn.closed:   # a lost session took its lock with it
                    self._unlock_session(conn)
        except psycopg.Error as exc:
            raise MigrationError(f"migrating schema {self.schema!r} failed: {exc}") from exc
        return applied

    def _apply_plain(self, conn: psycopg.Connection[Any], *,
                           outer: bool) -> tuple[list[Migration], _Resume | None]:
        """Apply, in one transaction, the migrations due before the next stepped one."""
        q = self._q
        with conn.transaction():
            run(conn, q["migration_lock"], {"schema": self.schema})
            run(conn, q["migration_create_schema"])
            run(conn, q["migration_create_table"])
            cur = run(conn, q["migration_applied"])
            todo = _plan(self.schema, [r[0] for r in cur.fetchall()], self._migrations)
            plain, stepped = _plain_prefix(todo)
            if stepped is not None:
                self._check_steps_possible(conn, stepped, outer)
            for m in plain:
                run(conn, m.render(self.schema).encode())
                run(conn, q["migration_record"], {"version": m.version, "name": m.name})
            if stepped is None:
                return plain, None
            run(conn, q["migration_create_steps_table"])
            done = (self._steps_done(conn)).get(stepped.version, set())
            return plain, (stepped, done)

    def _check_steps_possible(self, conn: psycopg.Connection[Any],
                                    m: Migration, outer: bool) -> None:
        """Refuse, before anything is applied, to run steps where they cannot commit alone."""
        if outer:
            raise MigrationError(
                f"migration {m.version} runs in steps, each committed on its own; apply it on "
                "a connection with no transaction open")
        if not _needs_session_lock(m):
            return
        cur = run(conn, self._q["migration_backend_pid"])
        row = cur.fetchone()
        if row is not None and row[0] != conn.info.backend_pid:
            raise MigrationError(
                f"migration {m.version} runs in steps under a session lock, which a pooler "
                "(PgBouncer) may hand to another client; migrate on a direct connection")

    def _apply_steps(self, conn: psycopg.Connection[Any], m: Migration,
                           done: set[int]) -> bool:
        """Run the steps of ``m`` not recorded yet, each committed with its record.

        Returns whether this migrator ran the last one (so completed ``m``).
        """
        completed = False
        for number, step in enumerate(m.steps, 1):
            if number in done:
                continue
            try:
                if step.transaction:
                    with conn.transaction():
                        # Excludes a script's parts, which take this lock alone,
                        # and the other migrators' steps when no session lock
                        # is held: one of them may have run this step meanwhile.
                        run(conn, self._q["migration_lock"], {"schema": self.schema})
                        if self._step_recorded(conn, m, number):
                            continue
                        run(conn, step.render(self.schema).encode())
                        self._record_step(conn, m, number)
                        completed = number == len(m.steps)
                else:
                    # Cut off here, the statement ran and is not recorded: it
                    # runs again on resume, which is why it must be harmless.
                    self._run_outside_transaction(conn, step)
                    with conn.transaction():
                        run(conn, self._q["migration_lock"], {"schema": self.schema})
                        self._record_step(conn, m, number)
                    completed = number == len(m.steps)
            except psycopg.Error as exc:
                raise MigrationError(
                    f"migrating schema {self.schema!r} failed at step {number} of "
                    f"{len(m.steps)} of migration {m.version:04d}_{m.name}: {exc}") from exc
            logger.info("applied step %s of %s of migration %04d_%s", number, len(m.steps),
                        m.version, m.name, extra={"action": "migration_step_applied",
                                                  "version": m.version, "step": number})
        return completed

    def _run_outside_transaction(self, conn: psycopg.Connection[Any],
                                       step: Step) -> None:
        autocommit = conn.autocommit
        if not autocommit:
            conn.set_autocommit(True)
        try:
            run(conn, step.render(self.schema).encode())
        finally:
            if not autocommit and not conn.closed:
                conn.set_autocommit(False)

    def _step_recorded(self, conn: psycopg.Connection[Any], m: Migration,
                             number: int) -> bool:
        cur = run(conn, self._q["migration_step_recorded"],
                              {"version": m.version, "step": number})
        row = cur.fetchone()
        return bool(row and row[0])

    def _record_step(self, conn: psycopg.Connection[Any], m: Migration,
                           number: int) -> None:
        q = self._q
        run(conn, q["migration_step_record"], {"version": m.version, "step": number})
        if number == len(m.steps):
            run(conn, q["migration_record"], {"version": m.version, "name": m.name})

    def _lock_session(self, conn: psycopg.Connection[Any]) -> None:
        """Take the steps lock, trying until it is free: never waiting inside a statement."""
        q, params = self._q, {"schema": self.schema}
        while True:
            # Each in a transaction of its own, committed at once, so that no
            # snapshot is held between tries; a session lock outlives it.
            with conn.transaction():
                cur = run(conn, q["migration_steps_try_lock"], params)
                row = cur.fetchone()
            if row is not None and row[0]:
                return
            with conn.transaction():
                run(conn, q["migration_steps_wait"], {"seconds": _STEPS_LOCK_PAUSE})

    def _unlock_session(self, conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            run(conn, self._q["migration_steps_unlock"], {"schema": self.schema})

    def pending(self, conn: psycopg.Connection[Any]) -> list[Migration]:
        """The migrations not applied yet (a stepped one partly applied among them), oldest first."""
        return _plan(self.schema, self.applied_versions(conn), self._migrations)

    def require_current(self, conn: psycopg.Connection[Any]) -> None:
        """Raise MigrationError unless the schema is exactly at this Conveyor's migration.

        What workers and one-off commands check before touching the tables: a
        schema that is missing or older says to run ``conveyor migrate``, a
        newer one says to upgrade Conveyor, one partly through a stepped
        migration says which and how far.
        """
        applied = self.applied_versions(conn)
        partial = {version: len(steps) for version, steps in (self._steps_done(conn)).items()}
        check_current(self.schema, applied, partial, self._migrations)

    def applied_versions(self, conn: psycopg.Connection[Any]) -> list[int]:
        """The versions recorded complete in the schema's version table; [] before the first.

        A stepped migration partly applied is not among them.
        """
        if not self._exists(conn, "migrations"):
            return []
        cur = run(conn, self._q["migration_applied"])
        return [r[0] for r in cur.fetchall()]

    def _steps_done(self, conn: psycopg.Connection[Any]) -> dict[int, set[int]]:
        """The recorded steps of each migration begun and not complete."""
        if not self._exists(conn, "migration_steps"):
            return {}
        cur = run(conn, self._q["migration_steps_done"])
        done: dict[int, set[int]] = {}
        for version, step in cur.fetchall():
            done.setdefault(version, set()).add(step)
        return done

    def _exists(self, conn: psycopg.Connection[Any], table: str) -> bool:
        name = sql.Identifier(self.schema, table).as_string()
        cur = run(conn, self._q["migration_table_exists"], {"table": name})
        row = cur.fetchone()
        return bool(row and row[0])
