"""Loads the named queries in ``queries/*.sql`` and binds them to a schema.

A file holds blocks that start with ``-- name: <query_name>``; the SQL until
the next such line belongs to that name. The schema enters only as
``psycopg.sql.Identifier`` after validation, in place of ``{schema}``, and
the schema's NOTIFY channel as a ``psycopg.sql.Literal`` in place of
``{channel}``.

A block whose name starts with ``_`` is a fragment, never run by itself: a
line ``-- include: _fragment`` in a query is replaced by the fragment's SQL
(its comment lines left out); a fragment may include another. The claim's
variants share their clauses so (events.sql, flow.sql): one text to change,
not six.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql

from conveyor.notify import events_channel, results_channel
from conveyor.validation import check_schema_name

_NAME_RE = re.compile(r"^-- name: ([a-z_]+)\s*$", re.MULTILINE)
_INCLUDE_RE = re.compile(r"^[ \t]*-- include: (_[a-z_]+)[ \t]*$", re.MULTILINE)


def parse_named_queries(text: str) -> dict[str, str]:
    """Split one .sql file into ``{name: sql}``; comment lines are kept in the SQL."""
    parts = _NAME_RE.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = body.strip()
    return queries


def expand_includes(queries: dict[str, str]) -> dict[str, str]:
    """The queries with every ``-- include: _fragment`` line replaced, fragments left out.

    A fragment may include others (the flow claims' shared tail includes the
    claim's write); a fragment that includes itself, directly or not, is refused.
    """
    raw = {name: body for name, body in queries.items() if name.startswith("_")}

    def expand(body: str, seen: tuple[str, ...]) -> str:
        def fragment(match: re.Match[str]) -> str:
            name = match[1]
            if name not in raw:
                raise ValueError(f"no fragment {name!r} to include")
            if name in seen:
                raise ValueError(f"fragment {name!r} includes itself")
            text = expand(raw[name], (*seen, name))
            return "\n".join(line for line in text.splitlines()
                             if not line.lstrip().startswith("--"))
        return _INCLUDE_RE.sub(fragment, body)

    return {name: expand(body, ()) for name, body in queries.items()
            if not name.startswith("_")}


@cache
def raw_queries() -> dict[str, str]:
    """Every named query, unbound, from all files in the package (fragments included)."""
    folder = resources.files("conveyor.db") / "queries"
    merged: dict[str, str] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        for name, body in parse_named_queries(entry.read_text("utf-8")).items():
            if name in merged:
                raise ValueError(f"query {name!r} is defined in two files")
            merged[name] = body
    return expand_includes(merged)


class Queries:
    """The named queries with ``{schema}`` bound, rendered once and cached."""

    def __init__(self, schema: str) -> None:
        self.schema = check_schema_name(schema)
        self._rendered: dict[str, str] = {}

    def __getitem__(self, name: str) -> str:
        try:
            return self._rendered[name]
        except KeyError:
            pass
        body = raw_queries()[name]
        text = sql.SQL(body).format(schema=sql.Identifier(self.schema),
                                    channel=sql.Literal(self.channel)).as_string()
        self._rendered[name] = text
        return text

    @property
    def channel(self) -> str:
        """The NOTIFY channel of this schema's wake-ups (:func:`conveyor.notify.events_channel`)."""
        return events_channel(self.schema)

    @property
    def results_channel(self) -> str:
        """The NOTIFY channel on which finished events of store_result routes are announced
        (:func:`conveyor.notify.results_channel`)."""
        return results_channel(self.schema)

    @property
    def events_table(self) -> str:
        """The events table's qualified name as a regclass literal."""
        return sql.Identifier(self.schema, "events").as_string()


@cache
def queries_for(schema: str) -> Queries:
    return Queries(schema)
