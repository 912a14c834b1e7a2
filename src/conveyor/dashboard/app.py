"""The dashboard's Starlette app: overview, events, one event, and the actions on them.

Every page is rendered on the server from :class:`~conveyor.admin.AsyncAdmin`
calls (the operator API the CLI uses, with its keyset pagination, its
estimates for finished rows and its batched bulk actions), on connections of
a small pool, each statement under ``statement_timeout``. Actions are POSTs
answered with a redirect, so a reload never repeats one.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode, urlsplit

import psycopg
from jinja2 import Environment, PackageLoader, select_autoescape
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.datastructures import FormData, QueryParams
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

import conveyor.dashboard.charts as charts
from conveyor.admin_async import AsyncAdmin
from conveyor.dashboard.security import (
    CSRF_COOKIE,
    CSRF_FIELD,
    Action,
    Authorize,
    HostGuard,
    Unauthenticated,
    allowed,
    csrf_token,
    origin_of,
    origin_problem,
    read_only,
    token_ok,
)
from conveyor.db.named_queries import queries_for
from conveyor.errors import ConfigError, ConveyorError, EventNotFoundError, InvalidInputError
from conveyor.types import EventFilter, EventRecord, EventState, TopicCount
from conveyor.validation import check_schema_name

STATEMENT_TIMEOUT_DEFAULT = 5.0
PAGE_SIZE_DEFAULT = 50
POOL_SIZE_DEFAULT = 4
SEARCH_ROWS_DEFAULT = 100_000
# The overview lists this many topics (those with the most open events); the
# rest are one "other" row, so a producer that makes topics from data cannot
# make the page grow without bound.
TOPICS_SHOWN = 50
OPEN_COLUMNS = ("pending", "scheduled", "running", "failed")
# Topics the "no live worker claims" warning names; it counts the rest.
UNHANDLED_SHOWN = 20
# An event id as a URL may carry it: 1 to 19 ASCII digits, within bigint.
EVENT_ID_MAX = 2**63 - 1
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
        search_rows: an error-text or payload search of the events list looks
            at the newest this many events only (by id), so a search that
            matches nothing never reads the whole table; the page says so.
            Defaults to 100,000.
        public_url: the address browsers use, when it is not the one the
            dashboard is served on (behind a reverse proxy), e.g.
            ``"https://ops.example.com/queue"``. A POST's ``Origin`` must be
            its origin; ``https`` marks the CSRF cookie ``Secure``; its path
            prefixes every link. Defaults to None (the request's own ``Host``).
        allowed_hosts: the host names (``name`` or ``name:port``; ``"*"``: any)
            the dashboard answers besides IP addresses, ``localhost`` and the
            public URL's host; any other ``Host`` is answered 400 (a page that
            rebinds its DNS name to this address sends its own name). Defaults
            to None: no check, the host application's (Django's
            ``ALLOWED_HOSTS``, Starlette's ``TrustedHostMiddleware``);
            ``conveyor dashboard`` always checks.
    """

    schema: str = "conveyor"
    statement_timeout: float = STATEMENT_TIMEOUT_DEFAULT
    hide_payloads: bool = False
    page_size: int = PAGE_SIZE_DEFAULT
    pool_size: int = POOL_SIZE_DEFAULT
    search_rows: int = SEARCH_ROWS_DEFAULT
    public_url: str | None = None
    allowed_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        try:
            check_schema_name(self.schema)
        except InvalidInputError as exc:
            raise ConfigError(str(exc)) from None
        timeout = self.statement_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
                or not math.isfinite(timeout) or not 0.01 <= timeout <= 3600:
            raise ConfigError(f"expected statement_timeout to be 0.01-3600 seconds, got {timeout!r}")
        for name, low, high in (("page_size", 1, 500), ("pool_size", 1, 100),
                                ("search_rows", 1, 100_000_000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"expected {name} to be an integer {low}-{high}, got {value!r}")
        if self.public_url is not None:
            _check_public_url(self.public_url)
        if self.allowed_hosts is not None:
            if isinstance(self.allowed_hosts, str):
                raise ConfigError(f"expected allowed_hosts to be a tuple of host names, "
                                  f"got the string {self.allowed_hosts!r}")
            object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
            for host in self.allowed_hosts:
                if not isinstance(host, str) or not ALLOWED_HOST.fullmatch(host):
                    raise ConfigError(f"expected each allowed host to be a name or name:port "
                                      f"(or *), got {host!r}")

    @property
    def public_origin(self) -> str | None:
        """``scheme://host[:port]`` of ``public_url``, or None."""
        return origin_of(self.public_url) if self.public_url else None

    @property
    def public_path(self) -> str:
        """The path ``public_url`` puts before every link, without its last slash."""
        return urlsplit(self.public_url).path.rstrip("/") if self.public_url else ""


ALLOWED_HOST = re.compile(r"\*|[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?(:[0-9]{1,5})?")


def _check_public_url(url: object) -> None:
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname \
            or parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(f"expected public_url to be an http(s) address such as "
                          f"https://ops.example.com or https://example.com/queue, got {url!r}")


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


def _event_id(text: str, name: str = "event id") -> int:
    """An id from the URL; InvalidInputError (400) for anything but a bigint's digits."""
    if not (1 <= len(text) <= 19 and text.isascii() and text.isdigit()) \
            or int(text) > EVENT_ID_MAX:
        shown = text if len(text) <= 24 else text[:21] + "..."
        raise InvalidInputError(f"invalid {name} {shown!r}: expected a positive integer "
                                f"below 2**63")
    return int(text)


def _notice_number(request: Request) -> int | None:
    """The ``n`` of a notice link; InvalidInputError when it is not an integer."""
    n = request.query_params.get("n")
    return None if n is None or "done" not in request.query_params else _event_id(n, "n")


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


def _topic_table(counts: Sequence[TopicCount], shown: int
                 ) -> tuple[list[tuple[str, dict[str, int]]], dict[str, int] | None]:
    """The overview's topic rows: the ``shown`` topics with the most open events
    (pending, scheduled, running, failed), by name, and one row totalling the
    rest (None when every topic is shown, else with ``topics``: how many)."""
    table: dict[str, dict[str, int]] = {}
    for count in counts:
        row = table.setdefault(count.topic, {})
        row[count.state.value] = row.get(count.state.value, 0) + count.count
        if count.scheduled:
            row["scheduled"] = row.get("scheduled", 0) + count.scheduled
    if len(table) <= shown:
        return sorted(table.items()), None

    def open_events(item: tuple[str, dict[str, int]]) -> tuple[int, str]:
        row = item[1]
        return -sum(row.get(k, 0) for k in OPEN_COLUMNS), item[0]

    ranked = heapq.nsmallest(shown, table.items(), key=open_events)
    kept = {topic for topic, _ in ranked}
    other: dict[str, int] = {"topics": len(table) - len(kept)}
    for topic, row in table.items():
        if topic not in kept:
            for key, value in row.items():
                other[key] = other.get(key, 0) + value
    return sorted(ranked), other


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
        # Rendered in a thread: a big page must not stall every other request.
        body = await asyncio.to_thread(
            self.env.get_template(template).render,
            request=request, csrf_field=CSRF_FIELD, csrf_token=token, can=can,
            notice=self._notice(request), now=datetime.now(UTC), ago=_ago, config=self.config,
            states=[s.value for s in EventState], within_choices=list(WITHIN),
            url=lambda name, **p: self._path(request, name, **p), **context)
        response = HTMLResponse(body, status_code=http_status)
        response.headers["Cache-Control"] = "no-store"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; style-src 'self'; script-src 'self'; img-src 'self' data:; "
            "frame-ancestors 'none'; form-action 'self'")
        response.headers["Referrer-Policy"] = "same-origin"
        if new:
            path = (self.config.public_path + request.scope.get("root_path", "")) or "/"
            secure = (self.config.public_origin or str(request.url)).startswith("https:")
            response.set_cookie(CSRF_COOKIE, token, httponly=True, samesite="strict", path=path,
                                secure=secure)
        return response

    def _path(self, request: Request, name: str, **params: Any) -> str:
        """A link to a page: a path, never built from ``Host`` (a proxy may not pass it on)."""
        return self.config.public_path + request.url_for(name, **params).path

    @staticmethod
    def _notice(request: Request) -> str | None:
        """The notice ``done=CODE&n=NUMBER`` asks for (the guard has refused a bad ``n``)."""
        code = request.query_params.get("done")
        if code not in NOTICES:
            return None
        try:
            n = _notice_number(request)
        except InvalidInputError:
            return None
        return NOTICES[code].format(n=_number(n) if n is not None else "")

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
                _notice_number(request)      # 400 before the page, for a crafted link
                if request.method == "POST":
                    refused = await self._refuse_post(request)
                    if refused is not None:
                        return refused
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
            except psycopg.errors.DataError as exc:
                # A value only the database can judge (a payload filter's regular
                # expression, a number out of range): the request's fault, not ours.
                return await self._problem(request, 400, "Cannot do that",
                                           f"the database refused a value of this request: "
                                           f"{exc.diag.message_primary or exc}")
            except (InvalidInputError, ConveyorError) as exc:
                return await self._problem(request, 400, "Cannot do that", str(exc))
            except psycopg.OperationalError as exc:
                return await self._problem(request, 503, "Database unavailable",
                                           f"The database could not be reached: {exc}")
        return endpoint

    async def _refuse_post(self, request: Request) -> Response | None:
        """The 403 for a POST from another origin or without its CSRF token, else None."""
        problem = origin_problem(request, self.config.public_origin)
        if problem is not None:
            return await self._problem(request, 403, "Stale or foreign form", problem)
        form = await request.form()
        field = form.get(CSRF_FIELD)
        if not token_ok(request, field if isinstance(field, str) else None):
            return await self._problem(
                request, 403, "Stale or foreign form",
                "The form's security token does not match the browser's conveyor_csrf cookie "
                "(the cookie is missing or the form came from elsewhere): reload the page and "
                "try again.")
        return None

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
        topics, other = await asyncio.to_thread(_topic_table, status.by_topic, TOPICS_SHOWN)
        unhandled = status.unhandled_topics
        return await self._render(request, "overview.html", status=status, pauses=pauses,
                                  topics=topics, other=other, chart=chart, spans=list(charts.SPANS),
                                  estimated=set(status.estimated_states),
                                  unhandled=unhandled[:UNHANDLED_SHOWN],
                                  unhandled_more=max(0, len(unhandled) - UNHANDLED_SHOWN))

    async def events(self, request: Request) -> Response:
        filter, shown = _filter_from(request.query_params, hide_payloads=self.config.hide_payloads)
        after_text = request.query_params.get("after") or None
        after = _event_id(after_text, "after") if after_text else None
        async with self.db.connection() as conn:
            page = await self.admin.events(conn, filter, after=after, limit=self.config.page_size,
                                           newest=self._newest(filter))
        return await self._render(
            request, "events.html", page=page, shown=shown, filtered=not filter.is_empty(),
            next_query=_query(shown, after=page.next_after) if page.next_after else None,
            first_query=_query(shown) if after else None, filter_query=_query(shown),
            searched=self._newest(filter))

    def _newest(self, filter: EventFilter) -> int | None:
        """How many of the newest events a search may read: bounded for the filters no
        index serves (error text, payload), so one that matches nothing stays cheap."""
        return self.config.search_rows if filter.error or filter.payload else None

    async def event(self, request: Request) -> Response:
        event_id = _event_id(request.path_params["event_id"])
        async with self.db.connection() as conn:
            record = await self.admin.show(conn, event_id)
        payload = json.dumps(record.payload, indent=2, ensure_ascii=False, sort_keys=True)
        return await self._render(request, "event.html", event=record, payload=payload,
                                  payload_bytes=len(payload.encode()), timeline=_timeline(record))

    # -- actions ---------------------------------------------------------------

    def _back(self, request: Request, name: str, query: str = "", **params: Any) -> Response:
        # A path: the browser resolves it against the address it used.
        target = self._path(request, name, **params)
        return RedirectResponse(f"{target}?{query}" if query else target, status_code=303)

    async def retry(self, request: Request) -> Response:
        event_id = _event_id(request.path_params["event_id"])
        async with self.db.connection() as conn:
            await self.admin.retry(conn, event_id)
        return self._back(request, "event", urlencode({"done": "retried", "n": event_id}),
                          event_id=event_id)

    async def cancel(self, request: Request) -> Response:
        event_id = _event_id(request.path_params["event_id"])
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
        return self._back(request, "overview", urlencode({"done": "paused"}))

    async def resume(self, request: Request) -> Response:
        form = await request.form()
        pattern = str(form.get("pattern") or "").strip()
        tenant = str(form.get("tenant") or "").strip() or None
        async with self.db.connection() as conn:
            existed = await self.admin.resume(conn, pattern, tenant=tenant)
        return self._back(request, "overview",
                          urlencode({"done": "resumed" if existed else "not_paused"}))


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
        # Ids are checked by the page (400 naming the value), not by Starlette's
        # int convertor, which answers 500 to 5,000 digits.
        Route("/events/{event_id}", g(None, pages.event), name="event"),
        Route("/events/{event_id}/retry", g(Action.RETRY, pages.retry), methods=["POST"],
              name="retry"),
        Route("/events/{event_id}/cancel", g(Action.CANCEL, pages.cancel), methods=["POST"],
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
    config = pages.config
    middleware = [] if config.allowed_hosts is None else [
        Middleware(HostGuard, allowed=config.allowed_hosts,
                   public_host=urlsplit(config.public_url).hostname if config.public_url else None)]
    app = Starlette(routes=routes, middleware=middleware)
    app.state.conveyor_dashboard = pages.db
    return app
