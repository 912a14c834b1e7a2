"""Whether autovacuum looks after the events table: the warnings a worker and ``status`` give.

A queue table is where a missing vacuum hurts first: every finished event
leaves a dead row behind, and claims and counts slow down as they pile up
(12x slower status pages on a server with ``autovacuum = off``: newcomer
review M5). The worker logs these once at start; ``conveyor status`` lists
them. One query (``vacuum_health``) and an I/O-free verdict, with a sync and
an async driver.

Example::

    for warning in vacuum_warnings(conn, "conveyor"):
        print(warning.message)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from conveyor.db.named_queries import queries_for

# A never analyzed events table with this many dead rows is worth a line.
NEVER_ANALYZED_DEAD_ROWS = 10_000
# The columns of the vacuum_health query, in order (a test holds them to it).
VACUUM_HEALTH_COLUMNS = ("autovacuum", "reloptions", "dead_rows", "last_analyzed")
_OFF = {"false", "off", "no", "0", "f", "n"}


@dataclass(frozen=True, slots=True)
class VacuumWarning:
    """One finding: ``action`` is the log record's stable name, ``message`` its line."""

    action: str
    message: str


def verdict(row: tuple[Any, ...] | None, table: str) -> list[VacuumWarning]:
    """The warnings a ``vacuum_health`` row calls for (none when it looks after itself)."""
    if row is None:
        return []
    autovacuum, reloptions, dead_rows, last_analyzed = row
    found = []
    if autovacuum != "on":
        found.append(VacuumWarning("autovacuum_off", (
            f"autovacuum is off on this PostgreSQL server: dead rows of finished events pile up "
            f"in {table} and claims slow down; set autovacuum = on")))
    options = dict(option.split("=", 1) for option in reloptions or () if "=" in option)
    if options.get("autovacuum_enabled", "").lower() in _OFF:
        found.append(VacuumWarning("autovacuum_off", (
            f"autovacuum is off for {table} (autovacuum_enabled={options['autovacuum_enabled']}): "
            f"dead rows of finished events pile up and claims slow down; "
            f"ALTER TABLE {table} RESET (autovacuum_enabled)")))
    if last_analyzed is None and (dead_rows or 0) >= NEVER_ANALYZED_DEAD_ROWS:
        found.append(VacuumWarning("never_analyzed", (
            f"{table} was never analyzed and holds {dead_rows:,} dead rows: autovacuum is not "
            f"reaching it; run VACUUM ANALYZE {table} and check autovacuum")))
    return found


def vacuum_warnings(conn: psycopg.Connection[Any], schema: str) -> list[VacuumWarning]:
    """What :func:`verdict` finds for ``schema``'s events table, read on ``conn``."""
    q = queries_for(schema)
    cur = conn.cursor(row_factory=tuple_row)
    cur.execute(q["vacuum_health"], {"table": q.live_table})
    return verdict(cur.fetchone(), f"{schema}.events_live")


async def vacuum_warnings_async(conn: psycopg.AsyncConnection[Any],
                                schema: str) -> list[VacuumWarning]:
    """:func:`vacuum_warnings` on an async connection."""
    q = queries_for(schema)
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(q["vacuum_health"], {"table": q.live_table})
    return verdict(await cur.fetchone(), f"{schema}.events_live")
