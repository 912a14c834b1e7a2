"""How a dashboard page is rendered: the templates, their filters, and the response.

Every page, problem pages included, leaves through :meth:`Renderer.render`,
so the headers that harden a response (no caching, no framing, a strict
Content-Security-Policy) and the CSRF cookie are set in one place and no
page can forget them. The text filters (durations, moments, numbers) are
pure functions beside it. Kept apart from the pages, which decide what to
read and which template to fill, and from the guard, which decides whether
a request gets a page at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from conveyor.dashboard.config import DashboardConfig
from conveyor.dashboard.inputs import WITHIN, notice_number
from conveyor.dashboard.security import (
    CSRF_COOKIE,
    CSRF_FIELD,
    Action,
    Authorize,
    Unauthenticated,
    allowed,
    csrf_token,
)
from conveyor.errors import InvalidInputError
from conveyor.filters import FILTER_STATES
from conveyor.records import EventRecord
from conveyor.states import EventState

# Messages an action's redirect may ask a page to show: a code and a number,
# never text from the URL, so a crafted link cannot make the dashboard say
# anything (what was paused is in the Paused table below the notice).
NOTICES = {
    "retried": "Event {n} will run again now.",
    "cancelled": "Event {n} was cancelled.",
    "bulk_retry": "{n} events will run again now.",
    "bulk_cancel": "{n} events were cancelled.",
    "paused": "Paused: the pause is listed under Paused.",
    "resumed": "Resumed: the pause is lifted.",
    "not_paused": "Nothing to resume: that was not paused.",
    "limit_set": "Limit set: the workers hold it from their next claim.",
    "limit_cleared": "Override cleared: the declared limit holds again.",
    "no_override": "Nothing to clear: that pattern has no override.",
    "schedule_set": "Schedule changed: it fires on the new expression from now.",
    "schedule_clear": "Schedule back to its declared expression.",
    "schedule_disable": "Schedule disabled: its slots pass unfired until it is enabled.",
    "schedule_enable": "Schedule enabled: it fires again from now.",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; style-src 'self'; script-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; form-action 'self'")


def ago(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    return duration((now - moment).total_seconds()) + " ago" if moment <= now \
        else "in " + duration((moment - now).total_seconds())


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86_400:.1f} d"


def utc(moment: datetime | str | None) -> str:
    """A moment in UTC to the second; an ISO string (an error's ``at``) is parsed first."""
    if isinstance(moment, str):
        try:
            parsed: datetime | None = datetime.fromisoformat(moment)
        except ValueError:
            return moment
    else:
        parsed = moment
    return parsed.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if parsed else "-"


def number(value: int) -> str:
    return f"{value:,}".replace(",", "\u2009")


def _moment(value: datetime | str | None) -> datetime | None:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    return value


def short(worker: str | None) -> str:
    """A worker as a person reads it: a name as it is, a bare UUID by its first part."""
    if worker and len(worker) == 36 and worker.count("-") == 4:
        return worker[:8]
    return worker or "-"


def timeline(event: EventRecord) -> list[tuple[datetime | None, str, bool]]:
    """(when, what, whether it went wrong) for the event page, oldest first."""
    entries: list[tuple[datetime | None, str, bool]] = [(event.created_at, "created", False)]
    if event.attempted_at is not None:
        entries.append((event.attempted_at, f"attempt {event.attempts} started", False))
    for err in event.errors:
        by = f" on {short(err.worker)}" if err.worker else ""
        entries.append((_moment(err.at), f"attempt {err.attempt} failed{by}", True))
    if event.finished_at is not None:
        entries.append((event.finished_at, event.state.value, event.state is EventState.FAILED))
    elif event.state is EventState.PENDING:
        entries.append((event.run_at, "due", False))
    # Stable: an attempt's failure stays after its start when both share a moment.
    epoch = datetime.min.replace(tzinfo=UTC)
    return sorted(entries, key=lambda entry: entry[0] or epoch)


def environment() -> Environment:
    env = Environment(loader=PackageLoader("conveyor.dashboard", "templates"),
                      autoescape=select_autoescape(default=True, default_for_string=True),
                      trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.do"])
    env.filters.update(duration=duration, utc=utc, number=number, short=short)
    return env


class Renderer:
    """Fills a template for one request and wraps it in a hardened response."""

    def __init__(self, config: DashboardConfig, authorize: Authorize) -> None:
        self.config = config
        self.authorize = authorize
        self.env = environment()

    async def render(self, request: Request, template: str, http_status: int = 200,
                     **context: Any) -> Response:
        token, new = csrf_token(request)
        can = {a.value: await self._may(request, a) for a in Action if a is not Action.VIEW}
        # Rendered in a thread: a big page must not stall every other request.
        body = await asyncio.to_thread(
            self.env.get_template(template).render,
            request=request, csrf_field=CSRF_FIELD, csrf_token=token, can=can,
            notice=self._notice(request), now=datetime.now(UTC), ago=ago, config=self.config,
            states=list(FILTER_STATES), within_choices=list(WITHIN),
            url=lambda name, **p: self.path(request, name, **p), **context)
        response = HTMLResponse(body, status_code=http_status)
        response.headers["Cache-Control"] = "no-store"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        response.headers["Referrer-Policy"] = "same-origin"
        if new:
            path = (self.config.public_path + request.scope.get("root_path", "")) or "/"
            secure = (self.config.public_origin or str(request.url)).startswith("https:")
            response.set_cookie(CSRF_COOKIE, token, httponly=True, samesite="strict", path=path,
                                secure=secure)
        return response

    def problem(self, request: Request, status: int, title: str, detail: str
                ) -> Awaitable[Response]:
        return self.render(request, "problem.html", http_status=status, title=title, detail=detail)

    def path(self, request: Request, name: str, **params: Any) -> str:
        """A link to a page: a path, never built from ``Host`` (a proxy may not pass it on)."""
        return self.config.public_path + request.url_for(name, **params).path

    @staticmethod
    def _notice(request: Request) -> str | None:
        """The notice ``done=CODE&n=NUMBER`` asks for (the guard has refused a bad ``n``)."""
        code = request.query_params.get("done")
        if code not in NOTICES:
            return None
        try:
            n = notice_number(request)
        except InvalidInputError:
            return None
        return NOTICES[code].format(n=number(n) if n is not None else "")

    async def _may(self, request: Request, action: Action) -> bool:
        try:
            return await allowed(self.authorize, request, action)
        except Unauthenticated:
            return False
