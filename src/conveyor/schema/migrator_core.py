"""The I/O-free core of the migrator: the numbered migrations, their steps, the plan.

:class:`~conveyor.schema.migrator.Migrator` and its async twin run what
:func:`_plan` decides; :mod:`conveyor.schema.migrator_script` writes the same
migrations as SQL for teams' own tools; nothing here touches a connection.

A migration file is one step, run in one transaction with the migrations
around it, unless it holds step markers, lines of their own::

    -- conveyor:step
    -- conveyor:step no-transaction

Each marker starts a step; SQL above the first marker is a first step of its
own (comments alone there are the file's header). The migrator runs each step
of such a *stepped* migration in a transaction of its own, or outside any
transaction block for ``no-transaction`` (``CREATE INDEX CONCURRENTLY``), and
records each step as it commits, so a migrator stopped between steps resumes
at the next one. A ``no-transaction`` step holds one statement, and must be
harmless when run again, even after its migration completed: it can be cut off
between its statement and the record of it, and a script cannot guard it (see
``migration_script``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

from psycopg import sql

from conveyor.errors import MigrationError
from conveyor.validation import check_schema_name

_FILE_RE = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")
_MARKER_RE = re.compile(r"-- conveyor:step( no-transaction)?")
# Any comment line meant as a directive: a misspelt marker is an error, not a comment.
_DIRECTIVE_RE = re.compile(r"--\s*conveyor:", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a migration: its SQL, and whether it runs in a transaction."""

    body: str
    transaction: bool = True

    def render(self, schema: str) -> str:
        return _render(self.body, schema)


def _render(body: str, schema: str) -> str:
    """``body`` with its ``{schema}`` placeholders naming ``schema``."""
    ident = sql.Identifier(check_schema_name(schema))
    return sql.SQL(body).format(schema=ident).as_string()


@dataclass(frozen=True, slots=True)
class Migration:
    """A numbered migration; ``steps`` and ``stepped`` are read from its body's markers."""

    version: int
    name: str
    body: str
    steps: tuple[Step, ...] = field(init=False, repr=False, compare=False)
    stepped: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        steps = _split_steps(self.version, self.body)
        # A file without markers is one step whose SQL is the whole file, byte for byte.
        object.__setattr__(self, "stepped", steps is not None)
        object.__setattr__(self, "steps", steps or (Step(self.body),))

    def render(self, schema: str) -> str:
        return _render(self.body, schema)


def _code_lines(text: str) -> list[str]:
    """The lines of ``text`` that are neither blank nor comments alone."""
    return [line.rstrip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("--")]


def _holds_sql(text: str) -> bool:
    return bool(_code_lines(text))


def _split_steps(version: int, body: str) -> tuple[Step, ...] | None:
    """The steps the markers of ``body`` cut it into; None when it has no marker."""
    chunks: list[tuple[bool, list[str]]] = [(True, [])]
    for line in body.splitlines(keepends=True):
        if _DIRECTIVE_RE.match(line.strip()):
            marker = _MARKER_RE.fullmatch(line.strip())
            if marker is None:
                raise MigrationError(f"migration {version} has an unknown directive "
                                     f"{line.strip()!r}; expected '-- conveyor:step' or "
                                     "'-- conveyor:step no-transaction'")
            chunks.append((marker[1] is None, []))
        else:
            chunks[-1][1].append(line)
    if len(chunks) == 1:
        return None
    head, *rest = [(transaction, "".join(lines)) for transaction, lines in chunks]
    steps = [Step(text, transaction) for transaction, text in ([head] if _holds_sql(head[1])
                                                             else []) + rest]
    for number, step in enumerate(steps, 1):
        if not _holds_sql(step.body):
            raise MigrationError(f"migration {version} step {number} holds no SQL")
        if not step.transaction and not _ends_statement(step.body):
            # In a script the next part's statements would join this one.
            raise MigrationError(f"migration {version} step {number} (no-transaction) must "
                                 "end its statement with ';'")
    return tuple(steps)


def _ends_statement(text: str) -> bool:
    code = _code_lines(text)
    return bool(code) and code[-1].endswith(";")


def _checked(found: Sequence[Migration]) -> tuple[Migration, ...]:
    ordered = sorted(found, key=lambda m: m.version)
    versions = [m.version for m in ordered]
    if versions != list(range(1, len(ordered) + 1)):
        raise MigrationError(f"migration numbers must run 1..n without gaps, got {versions}")
    return tuple(ordered)


@cache
def load_migrations() -> tuple[Migration, ...]:
    folder = resources.files("conveyor.schema") / "migrations"
    found: list[Migration] = []
    for entry in folder.iterdir():
        match = _FILE_RE.fullmatch(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    return _checked(found)


def known_migrations(migrations: Sequence[Migration] | None = None) -> tuple[Migration, ...]:
    """``migrations`` checked and in order, or the package's own when None.

    The seam through which tests give a migrator migrations of their own.
    """
    # load_migrations is looked up here, at the call: a test may replace it.
    return load_migrations() if migrations is None else _checked(migrations)


def latest_version(migrations: Sequence[Migration] | None = None) -> int:
    return known_migrations(migrations)[-1].version


def _too_new(schema: str, applied: list[int],
             migrations: tuple[Migration, ...]) -> MigrationError | None:
    unknown = sorted(set(applied) - {m.version for m in migrations})
    if not unknown:
        return None
    return MigrationError(
        f"schema {schema!r} is at migration {unknown[-1]}, newer than this Conveyor knows "
        f"({migrations[-1].version}); upgrade Conveyor")


def check_current(schema: str, applied: list[int], partial: Mapping[int, int] | None = None,
                  migrations: Sequence[Migration] | None = None) -> None:
    """Refuse a schema that is missing, newer, partly through a migration, or older.

    ``partial`` maps a stepped migration begun but not finished to its steps
    applied; such a migration is not applied, and gets a message of its own.
    """
    known = known_migrations(migrations)
    partial = partial or {}
    too_new = _too_new(schema, applied, known)
    if too_new is not None:
        raise too_new
    steps = {m.version: len(m.steps) for m in known}
    for version, done in sorted(partial.items()):
        if version in steps and version not in applied:
            raise MigrationError(
                f"schema {schema!r} is partly through migration {version} ({done} of "
                f"{steps[version]} steps applied); run 'conveyor migrate' to finish it")
    if not applied:
        raise MigrationError(f"schema {schema!r} is not migrated; run 'conveyor migrate' first")
    if max(applied) < known[-1].version:
        raise MigrationError(
            f"schema {schema!r} is at migration {max(applied)}, this Conveyor needs "
            f"{known[-1].version}; run 'conveyor migrate'")


def _plan(schema: str, applied: list[int],
          migrations: Sequence[Migration] | None = None) -> list[Migration]:
    known = known_migrations(migrations)
    too_new = _too_new(schema, applied, known)
    if too_new is not None:
        raise too_new
    return [m for m in known if m.version not in set(applied)]


def _plain_prefix(todo: list[Migration]) -> tuple[list[Migration], Migration | None]:
    """The migrations applied together before the first stepped one, and that one."""
    for index, m in enumerate(todo):
        if m.stepped:
            return todo[:index], m
    return todo, None
