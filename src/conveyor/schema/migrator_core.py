"""The I/O-free core of the migrator: the numbered migrations, the plan, the script.

:class:`~conveyor.schema.migrator.Migrator` and its async twin run what
:func:`_plan` decides; nothing here touches a connection.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from psycopg import sql

from conveyor.db.named_queries import queries_for
from conveyor.errors import InvalidInputError, MigrationError
from conveyor.validation import check_schema_name

_FILE_RE = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    body: str

    def render(self, schema: str) -> str:
        ident = sql.Identifier(check_schema_name(schema))
        return sql.SQL(self.body).format(schema=ident).as_string()


@cache
def load_migrations() -> tuple[Migration, ...]:
    folder = resources.files("conveyor.schema") / "migrations"
    found: list[Migration] = []
    for entry in folder.iterdir():
        match = _FILE_RE.fullmatch(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"migration numbers must run 1..n without gaps, got {versions}")
    return tuple(found)


def latest_version() -> int:
    return load_migrations()[-1].version


def migration_script(schema: str, first: int = 1, last: int | None = None) -> str:
    """The migrations ``first`` to ``last`` (default: the latest) as one SQL script,
    for teams that run their own tool (one Alembic revision per Conveyor release)."""
    latest = latest_version()
    last = latest if last is None else last
    for name, value in (("first", first), ("last", last)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= latest:
            raise InvalidInputError(f"expected {name} migration to be 1-{latest}, got {value!r}")
    if first > last:
        raise InvalidInputError(f"expected the first migration ({first}) to be at most the last "
                                f"({last})")
    q = queries_for(schema)
    lock = q["migration_lock"].replace("%(schema)s", sql.Literal(schema).as_string())
    parts = [
        f"-- Conveyor schema {schema!r}, migrations {first}..{last}.",
        "-- Run it inside one transaction (migration tools do; with psql use --single-transaction).",
        "-- The advisory lock below is released when that transaction ends.",
        lock + ";",
        q["migration_create_schema"] + ";",
        q["migration_create_table"] + ";",
    ]
    for m in load_migrations():
        if not first <= m.version <= last:
            continue
        # Each migration runs only if its version is not recorded yet, so the
        # script can be applied again (or to a partly migrated database) safely.
        tag = f"$conveyor_{m.version:04d}$"
        body = m.render(schema).rstrip()
        if tag in body:
            raise MigrationError(f"migration {m.version} contains its own quoting tag {tag}")
        guard = sql.SQL(
            "IF NOT EXISTS (SELECT 1 FROM {}.migrations WHERE version = {}) THEN"
        ).format(sql.Identifier(schema), sql.Literal(m.version)).as_string()
        record = sql.SQL(
            "INSERT INTO {}.migrations (version, name) VALUES ({}, {});"
        ).format(sql.Identifier(schema), sql.Literal(m.version), sql.Literal(m.name)).as_string()
        parts.append(f"-- migration {m.version:04d}_{m.name}")
        parts.append(f"DO $conveyor_migrate$ BEGIN\n{guard}\nEXECUTE {tag}\n{body}\n{tag};\n"
                     f"EXECUTE {sql.Literal(record).as_string()};\nEND IF;\nEND $conveyor_migrate$;")
    return "\n".join(parts) + "\n"


def _too_new(schema: str, applied: list[int]) -> MigrationError | None:
    unknown = sorted(set(applied) - {m.version for m in load_migrations()})
    if not unknown:
        return None
    return MigrationError(
        f"schema {schema!r} is at migration {unknown[-1]}, newer than this Conveyor knows "
        f"({latest_version()}); upgrade Conveyor")


def check_current(schema: str, applied: list[int]) -> None:
    """Refuse a schema that is missing, older or newer than this Conveyor (one message each)."""
    if not applied:
        raise MigrationError(f"schema {schema!r} is not migrated; run 'conveyor migrate' first")
    too_new = _too_new(schema, applied)
    if too_new is not None:
        raise too_new
    if max(applied) < latest_version():
        raise MigrationError(
            f"schema {schema!r} is at migration {max(applied)}, this Conveyor needs "
            f"{latest_version()}; run 'conveyor migrate'")


def _plan(schema: str, applied: list[int]) -> list[Migration]:
    too_new = _too_new(schema, applied)
    if too_new is not None:
        raise too_new
    return [m for m in load_migrations() if m.version not in set(applied)]
