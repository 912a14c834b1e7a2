"""Opening connections, with driver errors turned into Conveyor's own."""

from __future__ import annotations

from typing import Any

import psycopg

from conveyor.errors import DatabaseUnavailableError

# TCP keepalives make a half-open connection (host gone, no FIN) fail in about
# 20 s instead of the kernel's two hours. They do not apply to Unix sockets.
KEEPALIVE_KWARGS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


def _kwargs(conninfo: str, extra: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"connect_timeout": 10}
    kwargs.update(KEEPALIVE_KWARGS)
    kwargs.update(extra)
    return kwargs


def describe(conninfo: str) -> str:
    """The conninfo without its password, for messages."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return "<unparseable database url>"
    params.pop("password", None)
    host = params.get("host") or "local socket"
    return f"{params.get('dbname', '')}@{host}" + (f":{params['port']}" if "port" in params else "")


def _unavailable(conninfo: str, exc: Exception) -> DatabaseUnavailableError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DatabaseUnavailableError(f"cannot connect to database {describe(conninfo)}: {first}")


def connect(conninfo: str, **extra: Any) -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(conninfo, **_kwargs(conninfo, extra))
    except psycopg.OperationalError as exc:
        raise _unavailable(conninfo, exc) from exc
    except psycopg.ProgrammingError as exc:
        raise DatabaseUnavailableError(f"invalid database url: {exc}") from exc


async def connect_async(conninfo: str, **extra: Any) -> psycopg.AsyncConnection[Any]:
    try:
        return await psycopg.AsyncConnection.connect(conninfo, **_kwargs(conninfo, extra))
    except psycopg.OperationalError as exc:
        raise _unavailable(conninfo, exc) from exc
    except psycopg.ProgrammingError as exc:
        raise DatabaseUnavailableError(f"invalid database url: {exc}") from exc


_BACKEND_PID = "SELECT pg_backend_pid()"


def behind_pooler(conn: psycopg.Connection[Any]) -> bool:
    """Whether a pooler (PgBouncer and the like) stands between ``conn`` and PostgreSQL.

    A pooler makes up the backend pid it announces to its clients (it has to
    route their cancel requests), so it differs from the server's own.
    """
    row = conn.execute(_BACKEND_PID).fetchone()
    return row is not None and row[0] != conn.info.backend_pid


async def behind_pooler_async(conn: psycopg.AsyncConnection[Any]) -> bool:
    """The async mirror of :func:`behind_pooler`."""
    cur = await conn.execute(_BACKEND_PID)
    row = await cur.fetchone()
    return row is not None and row[0] != conn.info.backend_pid


def connect_for_statements(conninfo: str, **extra: Any) -> psycopg.Connection[Any]:
    """A connection for Conveyor's own statements: no prepared statements behind a pooler.

    In transaction pooling a prepared statement stays on whichever server
    connection ran it, and the next transaction may land elsewhere.
    """
    conn = connect(conninfo, **extra)
    if behind_pooler(conn):
        conn.prepare_threshold = None
    return conn


async def connect_for_statements_async(conninfo: str, **extra: Any) -> psycopg.AsyncConnection[Any]:
    """The async mirror of :func:`connect_for_statements`."""
    conn = await connect_async(conninfo, **extra)
    if await behind_pooler_async(conn):
        conn.prepare_threshold = None
    return conn
