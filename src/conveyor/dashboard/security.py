"""Who may do what on the dashboard, and the CSRF check every action passes.

Access is decided per request and per action by one callable,
``authorize(request, action)``. The dashboard ships three: read-only (the
default when mounted: every page, no action), HTTP basic auth (one user,
every action) and open (``--insecure-local``: every action, only bound to the
loopback interface). An application that mounts the dashboard passes its own,
usually reading the user its own authentication middleware put on the request.

Every action is a POST carrying a token that must equal the one in the
browser's ``conveyor_csrf`` cookie (a double-submit token: another site can
make the browser send the cookie, but cannot read it to put it in the form),
and a POST whose ``Origin`` is not the dashboard's is refused before that.
Every request's ``Host`` is checked too (``HostGuard``), so a page that
rebinds its own name to a loopback address cannot talk to the dashboard as
if it were same-origin.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import inspect
import ipaddress
import secrets
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from conveyor.errors import ConfigError


class Action(StrEnum):
    """What a request asks to do; ``authorize`` is asked about each."""

    VIEW = "view"
    RETRY = "retry"
    CANCEL = "cancel"
    BULK_RETRY = "bulk_retry"
    BULK_CANCEL = "bulk_cancel"
    PAUSE = "pause"
    RESUME = "resume"
    LIMIT = "limit"          # set or clear a flow limit's override
    SCHEDULE = "schedule"    # change, disable or enable a cron schedule


Authorize = Callable[[Request, Action], "bool | Awaitable[bool]"]

CSRF_COOKIE = "conveyor_csrf"
CSRF_FIELD = "csrf_token"


def read_only(request: Request, action: Action) -> bool:
    """Every page, no action: the default of a mounted dashboard."""
    return action is Action.VIEW


def allow_all(request: Request, action: Action) -> bool:
    """Everything, to anyone who reaches the port (``--insecure-local`` only)."""
    return True


def basic_auth(credentials: str, *, actions: bool = True) -> Authorize:
    """One user and password (``"user:password"``) for every page and, unless
    ``actions`` is False, every action. Compared in constant time."""
    user, sep, password = credentials.partition(":")
    if not sep or not user or not password:
        raise ConfigError("expected --basic-auth as USER:PASSWORD with both parts non-empty, "
                          f"got {'an empty value' if not credentials else 'no colon or an empty part'}")
    expected = f"{user}:{password}".encode()

    def authorize(request: Request, action: Action) -> bool:
        given = _basic_credentials(request.headers.get("authorization", ""))
        if given is None or not hmac.compare_digest(given, expected):
            raise Unauthenticated()
        return actions or action is Action.VIEW

    return authorize


class Unauthenticated(Exception):
    """Raised by an ``authorize`` callable to ask the browser for credentials (401)."""


def _basic_credentials(header: str) -> bytes | None:
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        return base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None


# Who the audit log names for a change made on the dashboard when nobody is
# known (open or read-only access, an application that sets no user).
ACTOR_UNKNOWN = "dashboard"


def actor(request: Request) -> str:
    """Who makes a change, for the audit log: the user the host application's
    authentication put on the request (Starlette's ``request.user``, or any
    object with a ``username`` or ``display_name``), else the basic-auth user,
    else ``"dashboard"``; prefixed ``dashboard:`` so the log tells where."""
    user = request.scope.get("user")
    name = None
    if user is not None and getattr(user, "is_authenticated", True):
        name = getattr(user, "username", None) or getattr(user, "display_name", None) \
            or (user if isinstance(user, str) else None)
    if not name:
        given = _basic_credentials(request.headers.get("authorization", ""))
        if given is not None:
            name = given.partition(b":")[0].decode("utf-8", "replace")
    if not name:
        return ACTOR_UNKNOWN
    printable = "".join(c for c in str(name) if c.isprintable())[:180]
    return f"dashboard:{printable}" if printable else ACTOR_UNKNOWN


async def allowed(authorize: Authorize, request: Request, action: Action) -> bool:
    """``authorize``'s answer, awaited when it is a coroutine."""
    answer: Any = authorize(request, action)
    if inspect.isawaitable(answer):
        answer = await answer
    return bool(answer)


def csrf_token(request: Request) -> tuple[str, bool]:
    """The browser's CSRF token, and whether it is new (then the response must set it)."""
    token = request.cookies.get(CSRF_COOKIE, "")
    if len(token) == 43 and token.replace("-", "").replace("_", "").isalnum():
        return token, False
    return secrets.token_urlsafe(32), True


def origin_of(url: str) -> str:
    """``scheme://host[:port]`` of ``url``, lowercased, without a default port."""
    parts = urlsplit(url.strip())
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    default = {"http": 80, "https": 443}.get(scheme)
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != default else "")


def origin_problem(request: Request, public_origin: str | None) -> str | None:
    """Why a POST's ``Origin`` shows it comes from another site, or None when it does not.

    With a public origin (the address browsers use, behind a proxy) the
    ``Origin`` must be exactly it; without one, its host must be the request's
    own ``Host`` (which the host check has already vetted).
    """
    origin = request.headers.get("origin")
    if origin is None:
        # Old browsers send no Origin on same-origin POSTs; the token still holds.
        return None
    if public_origin is not None:
        if origin != "null" and origin_of(origin) == public_origin:
            return None
        expected = public_origin
    else:
        host = request.headers.get("host", "")
        if origin != "null" and urlsplit(origin).netloc.lower() == host.lower():
            return None
        expected = f"{request.url.scheme}://{host}"
    return (f"Origin {_shown(origin)} does not match the dashboard's origin {_shown(expected)}: "
            "behind a proxy, set --public-url (DashboardConfig.public_url) to the address "
            "browsers use")


def token_ok(request: Request, submitted: str | None) -> bool:
    """Whether a POST's form token matches the browser's CSRF cookie."""
    cookie = request.cookies.get(CSRF_COOKIE)
    if not cookie or not submitted:
        return False
    return hmac.compare_digest(cookie.encode(), submitted.encode())


def _shown(text: str, limit: int = 80) -> str:
    """Header text as a message may quote it: printable, and not too long."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def host_allowed(host: str, allowed: tuple[str, ...], public_host: str | None) -> bool:
    """Whether a request's ``Host`` names this dashboard.

    A page that rebinds its own name to the dashboard's address sends that
    name as ``Host``; so any IP address and ``localhost`` pass (no other site
    can serve a page under them), as do the public URL's host and the
    ``allowed`` names (``name`` for any port, ``name:port`` for one; ``*``:
    every host).
    """
    name, port = _split_host(host)
    if name is None:
        return False
    if name == "localhost" or _is_ip(name) or name == public_host or "*" in allowed:
        return True
    return name in allowed or (port is not None and f"{name}:{port}" in allowed)


def _split_host(host: str) -> tuple[str | None, str | None]:
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return None, None
        name, rest = host[1:end], host[end + 1:]
        port = rest[1:] if rest.startswith(":") else None
        return (name, port) if rest in ("", f":{port}") else (None, None)
    name, sep, port = host.partition(":")
    return (name or None), (port if sep else None)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostGuard:
    """ASGI middleware answering 400 to a request whose ``Host`` is not the dashboard's."""

    def __init__(self, app: ASGIApp, *, allowed: tuple[str, ...], public_host: str | None) -> None:
        self.app = app
        self.allowed = tuple(a.lower() for a in allowed)
        self.public_host = public_host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = Headers(scope=scope).get("host")
            # A request without Host (HTTP/1.0) cannot come from a rebound page.
            if host is not None and not host_allowed(host, self.allowed, self.public_host):
                response = PlainTextResponse(
                    f"Host {_shown(host)!r} is not an address of this dashboard: add it with "
                    "--allowed-host (DashboardConfig.allowed_hosts)\n", status_code=400)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
