"""The dashboard's Starlette app: overview, events, one event, and the actions on them.

Every page is rendered on the server from :class:`~conveyor.admin.AsyncAdmin`
calls (the operator API the CLI uses, with its keyset pagination, its
estimates for finished rows and its batched bulk actions), on connections of
a small pool, each statement under ``statement_timeout``. Actions are POSTs
answered with a redirect, so a reload never repeats one.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import psycopg
from jinja2 import Environment, PackageLoader, select_autoescape
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.datastructures import FormData, QueryParams
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from conveyor.admin_async import AsyncAdmin
from conveyor.dashboard import charts
from conveyor.dashboard.security import (
    CSRF_COOKIE,
    CSRF_FIELD,
    Action,
    Authorize,
    Unauthenticated,
    allowed,
    csrf_ok,
    csrf_token,
    read_only,
)
from conveyor.db.named_queries import queries_for
from conveyor.errors import ConfigError, ConveyorError, EventNotFoundError, InvalidInputError
from conveyor.types import EventFilter, EventRecord, EventState
from conveyor.validation import check_schema_name

STATEMENT_TIMEOUT_DEFAULT = 5.0
PAGE_SIZE_DEFAULT = 50
POOL_SIZE_DEFAULT = 4
# The "created within" choices of the events filter, in seconds.
Handler = Callable[[Request], Awaitable[Response]]
WITHIN = {"1h": 3600.0, "24h": 86_400.0, "7d": 7 * 86_400.0, "30d": 30 * 86_400.0}


@dataclass(frozen=True, kw_only=True)
class DashboardConfig:
    """How the dashboard reads and shows the queue.

    Attributes:
        schema: PostgreSQL schema holding Conveyor's tables. Defaults to ``"conveyor"``.
        statement_timeout: seconds any one query of a page may run before the
            database cuts it (the page then says so). Defaults to 5.0.
        hide_payloads: never show an event's payload (it may hold personal
            data); its size is shown instead. Defaults to False.
        page_size: events per page of the list, 1 to 500. Defaults to 50.
        pool_size: most database connections the dashboard holds. Defaults to 4.
    """

    schema: str = "conveyor"
    statement_timeout: float = STATEMENT_TIMEOUT_DEFAULT
    hide_payloads: bool = False
    page_size: int = PAGE_SIZE_DEFAULT
    pool_size: int = POOL_SIZE_DEFAULT

    def __post_init__(self) -> None:
        try:
            check_schema_name(self.schema)
        except InvalidInputError as exc:
            raise ConfigError(str(exc)) from None
        timeout = self.statement_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
                or not math.isfinite(timeout) or not 0.01 <= timeout <= 3600:
            raise ConfigError(f"expected statement_timeout to be 0.01-3600 seconds, got {timeout!r}")
        for name, low, high in (("page_size", 1, 500), ("pool_size", 1, 100)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"expected {name} to be an integer {low}-{high}, got {value!r}")


class _Database:
    """The dashboard's pool, opened at the first request.

    A Starlette app mounted in another one gets no lifespan events of its own,
    so the pool cannot wait for a startup hook; ``close()`` lets the host (or
    the standalone server) release it.
    """

    def __init__(self, conninfo: str, config: DashboardConfig) -> None:
        self._conninfo = conninfo
        self._config = config
        self._pool: AsyncConnectionPool[Any] | None = None
        self._lock = asyncio.Lock()

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        ms = max(1, round(self._config.statement_timeout * 1000))
        await conn.execute(f"SET statement_timeout = {ms}")
        await conn.execute("SET application_name = 'conveyor-dashboard'")

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if self._pool is None:
            async with self._lock:
                if self._pool is None:
                    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                        self._conninfo, min_size=1, max_size=self._config.pool_size, open=False,
                        kwargs={"autocommit": True}, configure=self._configure,
                        name="conveyor-dashboard")
                    await pool.open(wait=True, timeout=10)
                    self._pool = pool
        async with self._pool.connection() as conn:
            yield conn

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


# Messages an action's redirect may ask a page to show (codes, never free text
# from the URL, so a crafted link cannot make the dashboard say anything).
NOTICES = {
    "retried": "Event {n} will run again now.",
    "cancelled": "Event {n} was cancelled.",
    "bulk_retry": "{n} events will run again now.",
    "bulk_cancel": "{n} events were cancelled.",
    "paused": "Paused {what}.",
    "resumed": "Resumed {what}.",
    "not_paused": "{what} was not paused.",
}


def _ago(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    return _duration((now - moment).total_seconds()) + " ago" if moment <= now \
        else "in " + _duration((moment - now).total_seconds())


def _duration(seconds: float | None) -> str:
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


def _utc(moment: datetime | str | None) -> str:
    """A moment in UTC to the second; an ISO string (an error's ``at``) is parsed first."""
    if isinstance(moment, str):
        try:
            parsed: datetime | None = datetime.fromisoformat(moment)
        except ValueError:
            return moment
    else:
        parsed = moment
    return parsed.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if parsed else "-"


def _number(value: int) -> str:
    return f"{value:,}".replace(",", "\u2009")


def _moment(value: datetime | str | None) -> datetime | None:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    return value


def _timeline(event: EventRecord) -> list[tuple[datetime | None, str, bool]]:
    """(when, what, whether it went wrong) for the event page, oldest first."""
    entries: list[tuple[datetime | None, str, bool]] = [(event.created_at, "created", False)]
    if event.attempted_at is not None:
        entries.append((event.attempted_at, f"attempt {event.attempts} started", False))
    for err in event.errors:
        by = f" on {_short(err.worker)}" if err.worker else ""
        entries.append((_moment(err.at), f"attempt {err.attempt} failed{by}", True))
    if event.finished_at is not None:
        entries.append((event.finished_at, event.state.value, event.state is EventState.FAILED))
    elif event.state is EventState.PENDING:
        entries.append((event.run_at, "due", False))
    # Stable: an attempt's failure stays after its start when both share a moment.
    epoch = datetime.min.replace(tzinfo=UTC)
    return sorted(entries, key=lambda entry: entry[0] or epoch)


def _short(worker: str | None) -> str:
    """A worker as a person reads it: a name as it is, a bare UUID by its first part."""
    if worker and len(worker) == 36 and worker.count("-") == 4:
        return worker[:8]
    return worker or "-"


def _environment() -> Environment:
    env = Environment(loader=PackageLoader("conveyor.dashboard", "templates"),
                      autoescape=select_autoescape(default=True, default_for_string=True),
                      trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.do"])
    env.filters.update(duration=_duration, utc=_utc, number=_number, short=_short)
    return env


def _filter_from(params: QueryParams | FormData, *, hide_payloads: bool = False
                 ) -> tuple[EventFilter, dict[str, Any]]:
    """The EventFilter a query string or form names, and the form's values to show again.

    Raises InvalidInputError naming the field and the value that is wrong.
    """
    states = tuple(str(s) for s in params.getlist("state") if s)
    topic = str(params.get("topic") or "").strip() or None
    tenant = str(params.get("tenant") or "").strip() or None
    error = str(params.get("error") or "").strip() or None
    payload = str(params.get("payload") or "").strip() or None
    if payload is not None and hide_payloads:
        raise InvalidInputError("the payload filter is off: this dashboard hides payloads")
    within = str(params.get("within") or "")
    before = str(params.get("before") or "")
    for label, choice in (("created-within", within), ("created-before", before)):
        if choice and choice not in WITHIN:
            raise InvalidInputError(f"invalid {label} choice {choice!r}: expected one of "
                                    f"{', '.join(WITHIN)}")
    shown = {"state": list(states), "topic": topic or "", "tenant": tenant or "",
             "error": error or "", "payload": payload or "", "within": within, "before": before}
    return EventFilter(states=states, topic=topic, tenant=tenant, error=error, payload=payload,
                       newer_than=WITHIN.get(within), older_than=WITHIN.get(before)), shown


def _query(shown: dict[str, Any], **extra: Any) -> str:
    pairs: list[tuple[str, str]] = []
    for key, value in {**shown, **extra}.items():
        for item in value if isinstance(value, list) else [value]:
            if item not in ("", None):
                pairs.append((key, str(item)))
    return urlencode(pairs)


class _Pages:
    """The request handlers; one instance per app, holding its pool and templates."""

    def __init__(self, conninfo: str, config: DashboardConfig, authorize: Authorize) -> None:
        self.config = config
        self.db = _Database(conninfo, config)
        self.admin = AsyncAdmin(config.schema)
        self.queries = queries_for(config.schema)
        self.authorize = authorize
        self.env = _environment()

    # -- rendering ---------------------------------------------------------

    async def _render(self, request: Request, template: str, http_status: int = 200,
                      **context: Any) -> Response:
        token, new = csrf_token(request)
        can = {a.value: await self._may(request, a) for a in Action if a is not Action.VIEW}
        notice = request.query_params.get("done")
        message = None
        if notice in NOTICES:
            n = request.query_params.get("n", "")
            message = NOTICES[notice].format(n=_number(int(n)) if n.isdigit() else n,
                                             what=request.query_params.get("what", ""))
        body = self.env.get_template(template).render(
            request=request, csrf_field=CSRF_FIELD, csrf_token=token, can=can, notice=message,
            now=datetime.now(UTC), ago=_ago, config=self.config, states=[s.value for s in EventState],
            within_choices=list(WITHIN), url=lambda name, **p: str(request.url_for(name, **p)),
            **context)
        response = HTMLResponse(body, status_code=http_status)
        response.headers["Cache-Control"] = "no-store"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; style-src 'self'; script-src 'self'; img-src 'self' data:; "
            "frame-ancestors 'none'; form-action 'self'")
        response.headers["Referrer-Policy"] = "same-origin"
        if new:
            path = request.scope.get("root_path") or "/"
            response.set_cookie(CSRF_COOKIE, token, httponly=True, samesite="strict", path=path,
                                secure=request.url.scheme == "https")
        return response

    async def _may(self, request: Request, action: Action) -> bool:
        try:
            return await allowed(self.authorize, request, action)
        except Unauthenticated:
            return False

    def _problem(self, request: Request, status: int, title: str, detail: str) -> Awaitable[Response]:
        return self._render(request, "problem.html", http_status=status, title=title, detail=detail)

    # -- the guard every handler runs under ---------------------------------

    def guarded(self, action: Action | None, handler: Handler) -> Handler:
        """``handler`` behind authorization (``action``; None: decided by the handler),
        the CSRF check on POSTs, and one way of showing what went wrong."""
        async def endpoint(request: Request) -> Response:
            try:
                if not await allowed(self.authorize, request, Action.VIEW):
                    return await self._problem(request, 403, "Not allowed",
                                               "You may not view this dashboard.")
                if action is not None and not await allowed(self.authorize, request, action):
                    return await self._problem(request, 403, "Not allowed",
                                               f"This dashboard does not allow {action.value} "
                                               "for you (it is read-only unless configured).")
                if request.method == "POST":
                    form = await request.form()
                    field = form.get(CSRF_FIELD)
                    if not csrf_ok(request, field if isinstance(field, str) else None):
                        return await self._problem(
                            request, 403, "Stale or foreign form",
                            "The form's security token did not match: reload the page and "
                            "try again.")
                return await handler(request)
            except Unauthenticated:
                return Response("Authentication required.\n", status_code=401,
                                headers={"WWW-Authenticate": 'Basic realm="conveyor", charset="UTF-8"'})
            except psycopg.errors.QueryCanceled:
                return await self._problem(
                    request, 503, "A query was cut",
                    f"The database stopped a query of this page after the dashboard's "
                    f"{self.config.statement_timeout:g} s statement timeout. Narrow the filter "
                    "(a topic, a state, a time range) and try again.")
            except EventNotFoundError as exc:
                return await self._problem(request, 404, "Not found", str(exc))
            except (InvalidInputError, ConveyorError) as exc:
                return await self._problem(request, 400, "Cannot do that", str(exc))
            except psycopg.OperationalError as exc:
                return await self._problem(request, 503, "Database unavailable",
                                           f"The database could not be reached: {exc}")
        return endpoint

    # -- pages ---------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        span = request.query_params.get("span") or "1h"
        if span not in charts.SPANS:
            raise InvalidInputError(f"invalid chart span {span!r}: expected one of {', '.join(charts.SPANS)}")
        seconds, step, _ = charts.SPANS[span]
        async with self.db.connection() as conn:
            status = await self.admin.status(conn)
            pauses = await self.admin.paused(conn)
            cur = await conn.execute(self.queries["event_counts_series"], {"span": seconds, "step": step})
            series = await cur.fetchall()
            clock = await (await conn.execute(self.queries["clock_now"])).fetchone()
        chart = charts.build(series, span, float(clock[0]) if clock else datetime.now(UTC).timestamp())
        topics: dict[str, dict[str, int]] = {}
        for count in status.by_topic:
            row = topics.setdefault(count.topic, {})
            row[count.state.value] = row.get(count.state.value, 0) + count.count
            if count.scheduled:
                row["scheduled"] = row.get("scheduled", 0) + count.scheduled
        return await self._render(request, "overview.html", status=status, pauses=pauses,
                                  topics=sorted(topics.items()), chart=chart, spans=list(charts.SPANS),
                                  estimated=set(status.estimated_states))

    async def events(self, request: Request) -> Response:
        filter, shown = _filter_from(request.query_params, hide_payloads=self.config.hide_payloads)
        after = request.query_params.get("after") or None
        async with self.db.connection() as conn:
            page = await self.admin.events(conn, filter, after=int(after) if after and after.isdigit()
                                           else None, limit=self.config.page_size)
        return await self._render(
            request, "events.html", page=page, shown=shown, filtered=not filter.is_empty(),
            next_query=_query(shown, after=page.next_after) if page.next_after else None,
            first_query=_query(shown) if after else None, filter_query=_query(shown))

    async def event(self, request: Request) -> Response:
        event_id = request.path_params["event_id"]
        async with self.db.connection() as conn:
            record = await self.admin.show(conn, event_id)
        payload = json.dumps(record.payload, indent=2, ensure_ascii=False, sort_keys=True)
        return await self._render(request, "event.html", event=record, payload=payload,
                                  payload_bytes=len(payload.encode()), timeline=_timeline(record))

    # -- actions ---------------------------------------------------------------

    def _back(self, request: Request, name: str, query: str = "", **params: Any) -> Response:
        target = str(request.url_for(name, **params))
        return RedirectResponse(f"{target}?{query}" if query else target, status_code=303)

    async def retry(self, request: Request) -> Response:
        event_id = request.path_params["event_id"]
        async with self.db.connection() as conn:
            await self.admin.retry(conn, event_id)
        return self._back(request, "event", urlencode({"done": "retried", "n": event_id}),
                          event_id=event_id)

    async def cancel(self, request: Request) -> Response:
        event_id = request.path_params["event_id"]
        async with self.db.connection() as conn:
            await self.admin.cancel(conn, event_id)
        return self._back(request, "event", urlencode({"done": "cancelled", "n": event_id}),
                          event_id=event_id)

    async def bulk_confirm(self, request: Request) -> Response:
        kind = self._bulk_kind(request)
        filter, shown = _filter_from(request.query_params, hide_payloads=self.config.hide_payloads)
        async with self.db.connection() as conn:
            count = await self.admin.count_matching(conn, filter, action=kind)
        return await self._render(request, "confirm.html", kind=kind, count=count, shown=shown,
                                  filter_query=_query(shown))

    def bulk_run(self, kind: str) -> Handler:
        async def run(request: Request) -> Response:
            form = await request.form()
            filter, shown = _filter_from(form, hide_payloads=self.config.hide_payloads)
            async with self.db.connection() as conn:
                ids = await self._bulk(conn, kind, filter)
            return self._back(request, "events", _query(shown, done=f"bulk_{kind}", n=len(ids)))
        return run

    def _bulk_kind(self, request: Request) -> str:
        kind = str(request.path_params["kind"])
        if kind not in ("retry", "cancel"):
            raise InvalidInputError(f"unknown bulk action {kind!r}: expected retry or cancel")
        return kind

    async def _bulk(self, conn: psycopg.AsyncConnection[Any], kind: str, filter: EventFilter
                    ) -> list[int]:
        run = self.admin.retry_matching if kind == "retry" else self.admin.cancel_matching
        return await run(conn, filter)

    async def pause(self, request: Request) -> Response:
        form = await request.form()
        pattern = str(form.get("pattern") or "").strip()
        tenant = str(form.get("tenant") or "").strip() or None
        reason = str(form.get("reason") or "").strip() or None
        async with self.db.connection() as conn:
            await self.admin.pause(conn, pattern, tenant=tenant, reason=reason)
        what = pattern + (f" for tenant {tenant}" if tenant else "")
        return self._back(request, "overview", urlencode({"done": "paused", "what": what}))

    async def resume(self, request: Request) -> Response:
        form = await request.form()
        pattern = str(form.get("pattern") or "").strip()
        tenant = str(form.get("tenant") or "").strip() or None
        async with self.db.connection() as conn:
            existed = await self.admin.resume(conn, pattern, tenant=tenant)
        what = pattern + (f" for tenant {tenant}" if tenant else "")
        return self._back(request, "overview",
                          urlencode({"done": "resumed" if existed else "not_paused", "what": what}))


def dashboard_app(conninfo: str, config: DashboardConfig | None = None, *,
                  authorize: Authorize = read_only) -> Starlette:
    """The dashboard as a Starlette app, to serve or to mount in your ASGI app.

    Example::

        from conveyor.dashboard import dashboard_app

        def authorize(request, action):
            user = request.scope.get("user")          # set by your auth middleware
            return action == "view" or (user is not None and user.is_staff)

        app.mount("/conveyor", dashboard_app(DATABASE_URL, authorize=authorize))

    ``authorize(request, action)``: whether this request may do ``action``
    (an :class:`~conveyor.dashboard.Action`: ``"view"``, ``"retry"``, ...);
    may be async, and may raise :class:`~conveyor.dashboard.Unauthenticated`
    to answer 401 with a basic-auth challenge. Defaults to read-only: every
    page, no action. ``config`` defaults to ``DashboardConfig()``.

    The app opens its connection pool at the first request; ``await
    app.state.conveyor_dashboard.close()`` releases it (the standalone server
    does so at exit).
    """
    pages = _Pages(conninfo, config or DashboardConfig(), authorize)
    g = pages.guarded
    routes = [
        Route("/", g(None, pages.overview), name="overview"),
        Route("/events", g(None, pages.events), name="events"),
        Route("/events/{event_id:int}", g(None, pages.event), name="event"),
        Route("/events/{event_id:int}/retry", g(Action.RETRY, pages.retry), methods=["POST"],
              name="retry"),
        Route("/events/{event_id:int}/cancel", g(Action.CANCEL, pages.cancel), methods=["POST"],
              name="cancel"),
        Route("/bulk/{kind}", g(None, pages.bulk_confirm), name="bulk_confirm"),
        Route("/bulk/retry/run", g(Action.BULK_RETRY, pages.bulk_run("retry")), methods=["POST"],
              name="bulk_retry_run"),
        Route("/bulk/cancel/run", g(Action.BULK_CANCEL, pages.bulk_run("cancel")), methods=["POST"],
              name="bulk_cancel_run"),
        Route("/pauses", g(Action.PAUSE, pages.pause), methods=["POST"], name="pause"),
        Route("/pauses/resume", g(Action.RESUME, pages.resume), methods=["POST"], name="resume"),
        Mount("/static", StaticFiles(packages=[("conveyor.dashboard", "static")]), name="static"),
    ]
    app = Starlette(routes=routes)
    app.state.conveyor_dashboard = pages.db
    return app
