"""Loads the named queries in ``queries/*.sql`` and binds them to a schema.

A file holds blocks that start with ``-- name: <query_name>``; the SQL until
the next such line belongs to that name. The schema enters only as
``psycopg.sql.Identifier`` after validation, in place of ``{schema}``, and
the schema's NOTIFY channel as a ``psycopg.sql.Literal`` in place of
``{channel}``.

A block whose name starts with ``_`` is a fragment, never run by itself: a
line ``-- include: _fragment`` in a query is replaced by the fragment's SQL
(its comment lines left out); a fragment may include another. So a clause
is written once, and each query that uses it names it.

A fragment may take parameters, declared on its name line and written in its
body in braces, as ``{schema}`` is: ``-- name: _topic_in(topic, prefix=)``;
``-- include: _topic_in(front.topic, limit_)`` fills them in order (commas
inside parentheses or quotes belong to the argument), and a parameter with a
default (after ``=``, possibly empty) may be left out. The include may also
end a line of SQL (``AND NOT -- include: _topic_in(topic, fifo_)``): the
fragment then continues that line, its later lines indented as that line is.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql

from conveyor.notify import events_channel, results_channel
from conveyor.validation import check_schema_name

_NAME_RE = re.compile(r"^-- name: ([a-z_]+(?:\([^)\n]*\))?)[ \t]*$", re.MULTILINE)
_INCLUDE_RE = re.compile(r"^(?P<lead>(?:(?!--).)*?)-- include: (?P<call>.*?)[ \t]*$", re.MULTILINE)
_CALL_RE = re.compile(r"(?P<name>_[a-z_]+)(?:\((?P<args>.*)\))?")
_SIGNATURE_RE = re.compile(r"(?P<name>_[a-z_]+)(?:\((?P<params>[^)]*)\))?")
_PARAM_RE = re.compile(r"([a-z_]+)(?:=(.*))?")
_BRACED_RE = re.compile(r"\{([a-z_]+)\}")
# Filled in when a query is bound to a schema (Queries), not at an include.
_BOUND_LATER = frozenset({"schema", "channel"})


def parse_named_queries(text: str) -> dict[str, str]:
    """Split one .sql file into ``{name: sql}``; comment lines are kept in the SQL.

    A fragment with parameters keeps them in its name (``_topic_in(topic, prefix=)``).
    """
    parts = _NAME_RE.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = body.strip()
    return queries


def _split_arguments(text: str) -> list[str]:
    """``a, f(b, c), 'd, e'`` -> ``['a', 'f(b, c)', "'d, e'"]``: commas at depth 0 split."""
    args: list[str] = []
    depth, quoted, current = 0, False, ""
    for char in text:
        if char == "'":
            quoted = not quoted
        elif not quoted and char in "()":
            depth += 1 if char == "(" else -1
            if depth < 0:
                raise ValueError(f"unbalanced arguments ({text})")
        elif not quoted and depth == 0 and char == ",":
            args.append(current.strip())
            current = ""
            continue
        current += char
    if depth or quoted:
        raise ValueError(f"unbalanced arguments ({text})")
    return [*args, current.strip()]


class _Fragment:
    """A fragment's body and its parameters, in order, with their defaults (None: required)."""

    def __init__(self, signature: str, body: str) -> None:
        match = _SIGNATURE_RE.fullmatch(signature)
        if match is None:
            raise ValueError(f"bad fragment name {signature!r}")
        self.name, self.body = match["name"], body
        self.params: dict[str, str | None] = {}
        for param in filter(None, (p.strip() for p in (match["params"] or "").split(","))):
            found = _PARAM_RE.fullmatch(param)
            if found is None or found[1] in self.params or found[1] in _BOUND_LATER:
                raise ValueError(f"bad parameter {param!r} of fragment {self.name!r}")
            self.params[found[1]] = found[2]
        unknown = set(_BRACED_RE.findall(body)) - set(self.params) - _BOUND_LATER
        if unknown:
            raise ValueError(f"fragment {self.name!r} has no parameter {sorted(unknown)[0]!r}")

    def bound(self, args: list[str]) -> str:
        """The body with ``{param}`` replaced by the arguments, given in order."""
        if len(args) > len(self.params):
            raise ValueError(f"fragment {self.name!r} takes {len(self.params)} arguments,"
                             f" got {len(args)}")
        values = dict(zip(self.params, args, strict=False))
        for param, default in self.params.items():
            if param not in values:
                if default is None:
                    raise ValueError(f"fragment {self.name!r} needs an argument for {param!r}")
                values[param] = default
        return _BRACED_RE.sub(lambda m: values.get(m[1], m[0]), self.body)


def expand_includes(queries: dict[str, str]) -> dict[str, str]:
    """The queries with every ``-- include: _fragment`` replaced, fragments left out.

    A fragment may include others (the flow claims' shared tail includes the
    claim's write); a fragment that includes itself, directly or not, is refused,
    and so is an include that names no fragment or passes it the wrong arguments.
    """
    fragments: dict[str, _Fragment] = {}
    for signature, body in queries.items():
        if signature.startswith("_"):
            fragment = _Fragment(signature, body)
            if fragment.name in fragments:
                raise ValueError(f"fragment {fragment.name!r} is defined twice")
            fragments[fragment.name] = fragment
        elif "(" in signature:
            raise ValueError(f"query {signature!r} takes no parameters: only fragments do")

    def expand(body: str, seen: tuple[str, ...]) -> str:
        def include(match: re.Match[str]) -> str:
            call = _CALL_RE.fullmatch(match["call"])
            if call is None:
                raise ValueError(f"bad include {match[0].strip()!r}")
            name = call["name"]
            if name not in fragments:
                raise ValueError(f"no fragment {name!r} to include")
            if name in seen:
                raise ValueError(f"fragment {name!r} includes itself")
            args = [] if call["args"] is None else _split_arguments(call["args"])
            if args == [""]:
                args = []
            text = expand(fragments[name].bound(args), (*seen, name))
            lines = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
            lead = match["lead"]
            if not lead.strip():
                return "\n".join(lines)
            indent = lead[:len(lead) - len(lead.lstrip())]
            return "\n".join([lead + lines[0], *(indent + line for line in lines[1:])])
        return _INCLUDE_RE.sub(include, body)

    return {name: expand(body, ()) for name, body in queries.items()
            if not name.startswith("_")}


@cache
def _package_blocks() -> dict[str, str]:
    """Every block of the package's queries/*.sql, fragments too, unexpanded."""
    folder = resources.files("conveyor.db") / "queries"
    merged: dict[str, str] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        for name, body in parse_named_queries(entry.read_text("utf-8")).items():
            if name in merged:
                raise ValueError(f"query {name!r} is defined in two files")
            merged[name] = body
    return merged


@cache
def raw_queries() -> dict[str, str]:
    """Every named query, unbound, from all files in the package (fragments included)."""
    return expand_includes(_package_blocks())


def with_package_fragments(queries: dict[str, str]) -> dict[str, str]:
    """Another file's queries (``parse_named_queries``) expanded with queries/*.sql's fragments."""
    fragments = {name: body for name, body in _package_blocks().items() if name.startswith("_")}
    return expand_includes({**fragments, **queries})


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
        """The events table's qualified name as a regclass literal.

        The parent of its partitions (0025): what reads name, and the owner
        of the id sequence.
        """
        return sql.Identifier(self.schema, "events").as_string()

    @property
    def live_table(self) -> str:
        """The partition of the events not finished for good (0025), qualified.

        Where new events are written (a COPY into it skips the parent's
        routing) and whose statistics describe the queue: a partitioned
        parent has no storage, so no dead rows or vacuum of its own.
        """
        return sql.Identifier(self.schema, "events_live").as_string()

    @property
    def history_table(self) -> str:
        """The partition of finished events, itself partitioned by day (0025), qualified."""
        return sql.Identifier(self.schema, "events_done").as_string()


@cache
def queries_for(schema: str) -> Queries:
    return Queries(schema)
