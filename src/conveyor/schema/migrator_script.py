"""Conveyor's migrations as SQL, for teams that run their own migration tool.

``conveyor migrate --sql`` prints :func:`migration_script`; Django's contrib
builds its operations from :func:`migration_script_parts`. Each migration, and
each step of a stepped one, runs only while it is not recorded in the version
tables, so a script may be applied again, or to a schema ``conveyor migrate``
brought part of the way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psycopg import sql

from conveyor.db.named_queries import queries_for
from conveyor.errors import InvalidInputError, MigrationError
from conveyor.schema.migrator_core import Migration, known_migrations

# A line of its own between two parts of a script: end the transaction there.
COMMIT_MARKER = "-- conveyor:commit"
# The first line of a part that must run outside any transaction block.
NO_TRANSACTION_MARKER = "-- conveyor:no-transaction"


@dataclass(frozen=True, slots=True)
class ScriptPart:
    """SQL to run in one transaction of its own, or outside any (``transaction`` False)."""

    sql: str
    transaction: bool = True


def _chosen(first: int, last: int | None,
            migrations: Sequence[Migration] | None) -> list[Migration]:
    known = known_migrations(migrations)
    latest = known[-1].version
    last = latest if last is None else last
    for name, value in (("first", first), ("last", last)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= latest:
            raise InvalidInputError(f"expected {name} migration to be 1-{latest}, got {value!r}")
    if first > last:
        raise InvalidInputError(f"expected the first migration ({first}) to be at most the last "
                                f"({last})")
    return [m for m in known if first <= m.version <= last]


def migration_script(schema: str, first: int = 1, last: int | None = None, *,
                     migrations: Sequence[Migration] | None = None) -> str:
    """The migrations ``first`` to ``last`` (default: the latest) as one SQL script,
    for teams that run their own tool (one Alembic revision per Conveyor release).

    Without a stepped migration in the range, the script is meant to run in
    one transaction (``psql --single-transaction``, or the one a migration
    tool opens). With one, it is in parts separated by ``-- conveyor:commit``
    lines, each to be committed before the next starts; a part starting
    ``-- conveyor:no-transaction`` must run outside any transaction block,
    which a single-transaction run cannot do. The header says which applies.
    ``migrations`` replaces the package's migrations (tests). Defaults to all
    migrations, 1 to the latest.
    """
    chosen = _chosen(first, last, migrations)
    parts = _Parts(schema, chosen).build()
    header = [f"-- Conveyor schema {schema!r}, migrations {first}..{chosen[-1].version}."]
    stepped = [m for m in chosen if m.stepped]
    if not stepped:
        header += [
            "-- Run it inside one transaction (migration tools do; with psql use "
            "--single-transaction).",
            "-- The advisory lock below is released when that transaction ends.",
        ]
    else:
        header += _stepped_header(stepped)
    return "\n".join(header) + "\n" + f"\n{COMMIT_MARKER}\n".join(p.sql for p in parts) + "\n"


def _stepped_header(stepped: list[Migration]) -> list[str]:
    names = ", ".join(f"{m.version:04d}" for m in stepped)
    lines = [
        f"-- Migration {names} runs in steps, so this script is in parts, each ending",
        f"-- at a line {COMMIT_MARKER!r}: run each part in a transaction of its own,",
        "-- committed before the next part starts (psql without --single-transaction",
        "-- does: each statement commits on its own; so does a tool run part by part).",
    ]
    if any(not s.transaction for m in stepped for s in m.steps):
        lines += [
            f"-- A part starting {NO_TRANSACTION_MARKER!r} must run outside any transaction",
            "-- block: psql --single-transaction, or a tool that runs the whole script in",
            "-- one transaction, CANNOT apply this script. Its statement is not guarded by",
            "-- the version tables; Conveyor writes it so that running it again is harmless.",
        ]
    return [*lines, "-- Each part takes the advisory lock below, released when its transaction ends."]


def migration_script_parts(schema: str, first: int = 1, last: int | None = None, *,
                           migrations: Sequence[Migration] | None = None) -> list[ScriptPart]:
    """:func:`migration_script` as its parts, each one transaction (or none), in order.

    One part when the range holds no stepped migration.
    """
    return _Parts(schema, _chosen(first, last, migrations)).build()


class _Parts:
    """Cuts the script into parts: a stepped migration's steps each end one."""

    def __init__(self, schema: str, chosen: list[Migration]) -> None:
        q = queries_for(schema)
        self.schema, self.chosen = schema, chosen
        self.ident = sql.Identifier(schema)
        self.lock = q["migration_lock"].replace("%(schema)s", sql.Literal(schema).as_string()) + ";"
        self.parts: list[ScriptPart] = []
        self.lines = [self.lock, q["migration_create_schema"] + ";",
                      q["migration_create_table"] + ";"]
        if any(m.stepped for m in chosen):
            self.lines.append(q["migration_create_steps_table"] + ";")

    def build(self) -> list[ScriptPart]:
        for m in self.chosen:
            if m.stepped:
                self._stepped(m)
            else:
                self.lines += [f"-- migration {m.version:04d}_{m.name}", self._plain_block(m)]
        self._close()
        return self.parts

    def _close(self) -> None:
        if self.lines != [self.lock]:
            self.parts.append(ScriptPart("\n".join(self.lines)))
        self.lines = [self.lock]

    def _stepped(self, m: Migration) -> None:
        self._close()   # the migrations before commit first, as the migrator does
        count = len(m.steps)
        for number, step in enumerate(m.steps, 1):
            title = f"-- migration {m.version:04d}_{m.name}, step {number} of {count}"
            body = step.render(self.schema).strip()
            if step.transaction:
                self.lines += [title, self._step_block(m, number, body)]
            else:
                self.parts.append(ScriptPart(
                    f"{NO_TRANSACTION_MARKER}: run the statement below alone, outside any "
                    f"transaction block\n{title}\n{body}", transaction=False))
                self.lines += [f"{title}: record it", self._step_block(m, number, None)]
            self._close()

    def _literal(self, template: str, *values: object) -> str:
        """A statement as a string literal, for EXECUTE in a DO block."""
        statement = sql.SQL(template).format(self.ident, *map(sql.Literal, values)).as_string()
        return f"EXECUTE {sql.Literal(statement).as_string()};"

    def _not_recorded(self, m: Migration) -> str:
        return sql.SQL("NOT EXISTS (SELECT 1 FROM {}.migrations WHERE version = {})").format(
            self.ident, sql.Literal(m.version)).as_string()

    def _record(self, m: Migration) -> str:
        return self._literal("INSERT INTO {}.migrations (version, name) VALUES ({}, {});",
                             m.version, m.name)

    @staticmethod
    def _execute(m: Migration, body: str) -> str:
        """``body`` run by EXECUTE in a DO block, dollar-quoted with a tag of the migration's."""
        tag = f"$conveyor_{m.version:04d}$"
        if tag in body:
            raise MigrationError(f"migration {m.version} contains its own quoting tag {tag}")
        return f"EXECUTE {tag}\n{body}\n{tag};"

    def _plain_block(self, m: Migration) -> str:
        # Runs only if its version is not recorded yet, so the script can be
        # applied again (or to a partly migrated database) safely.
        body = self._execute(m, m.render(self.schema).rstrip())
        return (f"DO $conveyor_migrate$ BEGIN\nIF {self._not_recorded(m)} THEN\n"
                f"{body}\n{self._record(m)}\nEND IF;\nEND $conveyor_migrate$;")

    def _step_block(self, m: Migration, number: int, body: str | None) -> str:
        """Step ``number`` (its ``body``, None for a no-transaction one already run) and its record."""

        def step_done(step: int) -> str:
            return sql.SQL("EXISTS (SELECT 1 FROM {}.migration_steps WHERE version = {} AND "
                           "step = {})").format(self.ident, sql.Literal(m.version),
                                                sql.Literal(step)).as_string()

        lines = [f"IF {self._not_recorded(m)} AND NOT {step_done(number)} THEN"]
        if number > 1:
            # A run that went on past a failed part must not apply a step out of order.
            lines += [f"IF NOT {step_done(number - 1)} THEN",
                      f"RAISE EXCEPTION 'conveyor migration {m.version}: step {number - 1} is "
                      "not applied; apply the parts in order';", "END IF;"]
        if body is not None:
            lines.append(self._execute(m, body))
        lines.append(self._literal("INSERT INTO {}.migration_steps (version, step) "
                                   "VALUES ({}, {});", m.version, number))
        if number == len(m.steps):
            lines.append(self._record(m))
        return "DO $conveyor_migrate$ BEGIN\n" + "\n".join(lines) + "\nEND IF;\nEND $conveyor_migrate$;"
