"""The dashboard's Starlette app: overview, events, one event, flow limits, cron
schedules, the audit log, and the actions on them.

Every page is rendered on the server from :class:`~conveyor.admin.AsyncAdmin`
calls (the operator API the CLI uses, with its keyset pagination, its
estimates for finished rows and its batched bulk actions), on connections of
a small pool, each statement under ``statement_timeout``. Actions are POSTs
answered with a redirect, so a reload never repeats one.

This module holds the route table and puts the pieces together: the
configuration (:mod:`~conveyor.dashboard.config`), the reads
(:mod:`~conveyor.dashboard.data`), the pages (:mod:`~conveyor.dashboard.pages`),
the guard around each (:mod:`~conveyor.dashboard.guard`) and the rendering
(:mod:`~conveyor.dashboard.render`).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from conveyor.dashboard.config import DashboardConfig
from conveyor.dashboard.data import TOPICS_SHOWN, Database
from conveyor.dashboard.guard import Guard
from conveyor.dashboard.pages import Pages
from conveyor.dashboard.render import Renderer
from conveyor.dashboard.security import Action, Authorize, HostGuard, read_only

__all__ = ["TOPICS_SHOWN", "DashboardConfig", "dashboard_app"]


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
    config = config or DashboardConfig()
    render = Renderer(config, authorize)
    db = Database(conninfo, config)
    pages = Pages(config, db, render)
    g = Guard(config, authorize, render)
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
        Route("/limits", g(None, pages.limits), name="limits"),
        Route("/limits/set", g(Action.LIMIT, pages.set_limit), methods=["POST"], name="set_limit"),
        Route("/limits/clear", g(Action.LIMIT, pages.clear_limit), methods=["POST"],
              name="clear_limit"),
        Route("/cron", g(None, pages.schedules), name="schedules"),
        Route("/cron/{action}", g(Action.SCHEDULE, pages.change_schedule), methods=["POST"],
              name="change_schedule"),
        Route("/audit", g(None, pages.audit), name="audit"),
        Mount("/static", StaticFiles(packages=[("conveyor.dashboard", "static")]), name="static"),
    ]
    middleware = [] if config.allowed_hosts is None else [
        Middleware(HostGuard, allowed=config.allowed_hosts,
                   public_host=urlsplit(config.public_url).hostname if config.public_url else None)]
    app = Starlette(routes=routes, middleware=middleware)
    app.state.conveyor_dashboard = db
    return app
