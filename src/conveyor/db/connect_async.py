"""Opening connections, with driver errors turned into Conveyor's own.

``conveyor/db/connect_async.py`` is the source people edit;
``conveyor/db/connect.py`` is its sync twin, generated from it by
``scripts/unasync.py``. Reading the connection string (what a message may
show of it, and its errors) is the I/O-free :mod:`conveyor.db.conninfo`.
"""

from __future__ import annotations

import traceback
from typing import Any

import psycopg

# unasync: from conveyor.db.connect_async import behind_pooler_async as behind_pooler_async
# unasync: from conveyor.db.connect_async import connect_async as connect_async
# unasync: from conveyor.db.connect_async import (
# unasync:     connect_for_statements_async as connect_for_statements_async,
# unasync: )
from conveyor.db.conninfo import KEEPALIVE_KWARGS as KEEPALIVE_KWARGS
from conveyor.db.conninfo import UNPARSEABLE as UNPARSEABLE
from conveyor.db.conninfo import check_conninfo, connect_kwargs, unavailable
from conveyor.db.conninfo import describe as describe
from conveyor.db.conninfo import invalid_url as invalid_url

_BACKEND_PID = "SELECT pg_backend_pid()"


async def connect_async(conninfo: str, **extra: Any) -> psycopg.AsyncConnection[Any]:
    """A connection to ``conninfo``, with keepalives; Conveyor's errors, never the password."""
    check_conninfo(conninfo)
    try:
        return await psycopg.AsyncConnection.connect(conninfo, **connect_kwargs(conninfo, extra))
    except psycopg.OperationalError as exc:
        raise unavailable(conninfo, exc) from exc
    except psycopg.ProgrammingError:
        # Not "from exc": the driver's message, in the traceback, quotes the password.
        raise invalid_url(conninfo) from None
    except BaseException as exc:
        if not isinstance(exc, Exception):
            # Cancelled (or interrupted) midway, psycopg leaves the connection it
            # was making to its generator, which the traceback's frames hold: kept
            # with the error (a stopped worker's, a test's), it stayed open. Freed
            # with those frames, it closes at once.
            traceback.clear_frames(exc.__traceback__)
        raise


async def behind_pooler_async(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether a pooler (PgBouncer and the like) stands between ``conn`` and PostgreSQL.

    A pooler makes up the backend pid it announces to its clients (it has to
    route their cancel requests), so it differs from the server's own.
    """
    cur = await conn.execute(_BACKEND_PID)
    row = await cur.fetchone()
    return row is not None and row[0] != conn.info.backend_pid


async def connect_for_statements_async(conninfo: str, **extra: Any) -> psycopg.AsyncConnection[Any]:
    """A connection for Conveyor's own statements: no prepared statements behind a pooler.

    In transaction pooling a prepared statement stays on whichever server
    connection ran it, and the next transaction may land elsewhere.
    """
    conn = await connect_async(conninfo, **extra)
    if await behind_pooler_async(conn):
        conn.prepare_threshold = None
    return conn
