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
and a POST whose ``Origin`` names another host is refused before that.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import inspect
import secrets
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request

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


def same_origin(request: Request) -> bool:
    """False when the request says it comes from a page of another host."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        # Old browsers send no Origin on same-origin POSTs; the token still holds.
        return origin is None
    return urlsplit(origin).netloc == request.headers.get("host", "")


def csrf_ok(request: Request, submitted: str | None) -> bool:
    """Whether a POST's form token matches its cookie (and its origin is this host)."""
    cookie = request.cookies.get(CSRF_COOKIE)
    if not cookie or not submitted or not same_origin(request):
        return False
    return hmac.compare_digest(cookie.encode(), submitted.encode())
