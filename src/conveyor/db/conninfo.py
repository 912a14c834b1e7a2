"""Reading a connection string without I/O: what a message may show of it, and its errors.

A database URL carries a password, so nothing here quotes one: a message
shows ``dbname@host[:port]`` only when that cannot hold a piece of it.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg

from conveyor.errors import DatabaseUnavailableError, InvalidDatabaseUrlError

# TCP keepalives make a half-open connection (host gone, no FIN) fail in about
# 20 s instead of the kernel's two hours. They do not apply to Unix sockets.
KEEPALIVE_KWARGS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


def connect_kwargs(conninfo: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of every connect: a timeout, keepalives, then ``extra``."""
    kwargs: dict[str, Any] = {"connect_timeout": 10}
    kwargs.update(KEEPALIVE_KWARGS)
    kwargs.update(extra)
    return kwargs


UNPARSEABLE = "<unparseable database url>"
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_HOST_RE = re.compile(r"[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]")
_PORT_RE = re.compile(r"[0-9]{1,5}")
_DBNAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,63}")


def _split_url(conninfo: str) -> tuple[str, str] | None:
    """(authority, rest) of a URL, or ``None`` for a keyword conninfo."""
    scheme = _URL_RE.match(conninfo)
    if scheme is None:
        return None
    tail = conninfo[scheme.end():]
    cut = min((i for i in (tail.find("/"), tail.find("?")) if i >= 0), default=len(tail))
    return tail[:cut], tail[cut:]


def _misplit(conninfo: str) -> bool:
    """Whether a URL's password holds an unencoded '/', which ends the authority early.

    libpq then parses ``postgresql://app:pass/word@host/db`` as host ``app``,
    port ``pass`` and database ``word@host/db``: it "parses", and every part it
    shows would be a piece of the password.
    """
    parts = _split_url(conninfo)
    if parts is None:
        return False
    authority, rest = parts
    return "@" not in authority and "@" in rest.partition("?")[0]


def describe(conninfo: str) -> str:
    """The conninfo without its password, for messages: ``dbname@host[:port]``.

    Only what parses cleanly is shown; an unparseable or ambiguous URL is
    ``"<unparseable database url>"``, because its "parts" may be pieces of the password.
    """
    if _misplit(conninfo):
        return UNPARSEABLE
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.Error:
        return UNPARSEABLE
    params.pop("password", None)
    host = params.get("host") or "local socket"
    return f"{params.get('dbname', '')}@{host}" + (f":{params['port']}" if "port" in params else "")


def _guess(conninfo: str) -> str | None:
    """``dbname@host[:port]`` of a URL that does not parse, when that cannot hold the password.

    Everything up to the authority's last '@' may be password. What follows it
    is shown only when no '@' comes later (else the password may run past the
    authority) and each part is a plain host, port and database name.
    """
    parts = _split_url(conninfo)
    if parts is None:
        return None
    authority, rest = parts
    if "@" not in authority or "@" in rest:
        return None
    hostport = authority.rpartition("@")[2]
    host, _, port = hostport.rpartition(":") if not hostport.endswith("]") else (hostport, "", "")
    if not host:
        host, port = port, ""
    dbname = rest.partition("?")[0].removeprefix("/")
    if not _HOST_RE.fullmatch(host) or (port and not _PORT_RE.fullmatch(port)) \
            or not _DBNAME_RE.fullmatch(dbname):
        return None
    return f"{dbname}@{host}" + (f":{port}" if port else "")


def invalid_url(conninfo: str) -> InvalidDatabaseUrlError:
    """The error for a database URL that does not parse: it never quotes the URL.

    psycopg's own parse messages quote the offending token, and that token is
    usually the password (``invalid percent-encoded token: "s3cr%t"``).
    """
    guess = _guess(conninfo)
    where = f" for {guess}" if guess else ""
    return InvalidDatabaseUrlError(
        f"invalid database url{where} (could not parse it; check quoting and percent-encoding)")


def unavailable(conninfo: str, exc: Exception) -> DatabaseUnavailableError:
    """The error for a connect that failed: the server named, the password never."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    try:
        password = psycopg.conninfo.conninfo_to_dict(conninfo).get("password")
    except psycopg.Error:
        password = None
    if password:    # libpq does not echo it today; a message that did would stay clean
        first = first.replace(str(password), "***")
    return DatabaseUnavailableError(f"cannot connect to database {describe(conninfo)}: {first}")


def check_conninfo(conninfo: str) -> None:
    """Refuse, before libpq misreads it, a URL whose password holds an unencoded '/'."""
    if _misplit(conninfo):
        raise invalid_url(conninfo)
