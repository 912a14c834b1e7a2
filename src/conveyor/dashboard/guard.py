"""The guard every dashboard handler runs under: who may, which POSTs pass, what failed.

One wrapper puts each handler behind the authorization of its action, the
``Origin`` and CSRF checks on POSTs, and one mapping from what can go wrong
(a refused value, a cut query, an unreachable database) to a status code and
a page that says so. Kept apart from the pages so no handler carries its own
checks, and a new page cannot be routed without them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import psycopg
from starlette.requests import Request
from starlette.responses import Response

from conveyor.dashboard.config import DashboardConfig
from conveyor.dashboard.inputs import notice_number
from conveyor.dashboard.render import Renderer
from conveyor.dashboard.security import (
    CSRF_FIELD,
    Action,
    Authorize,
    Unauthenticated,
    allowed,
    origin_problem,
    token_ok,
)
from conveyor.errors import (
    ConveyorError,
    EventNotFoundError,
    InvalidInputError,
    ScheduleNotFoundError,
)

Handler = Callable[[Request], Awaitable[Response]]


class Guard:
    """Wraps handlers; one instance per app."""

    def __init__(self, config: DashboardConfig, authorize: Authorize, render: Renderer) -> None:
        self.config = config
        self.authorize = authorize
        self.render = render

    def __call__(self, action: Action | None, handler: Handler) -> Handler:
        """``handler`` behind authorization (``action``; None: decided by the handler),
        the CSRF check on POSTs, and one way of showing what went wrong."""
        problem = self.render.problem

        async def endpoint(request: Request) -> Response:
            try:
                if not await allowed(self.authorize, request, Action.VIEW):
                    return await problem(request, 403, "Not allowed",
                                         "You may not view this dashboard.")
                if action is not None and not await allowed(self.authorize, request, action):
                    return await problem(request, 403, "Not allowed",
                                         f"This dashboard does not allow {action.value} "
                                         "for you (it is read-only unless configured).")
                notice_number(request)      # 400 before the page, for a crafted link
                if request.method == "POST":
                    refused = await self._refuse_post(request)
                    if refused is not None:
                        return refused
                return await handler(request)
            except Unauthenticated:
                return Response("Authentication required.\n", status_code=401,
                                headers={"WWW-Authenticate": 'Basic realm="conveyor", charset="UTF-8"'})
            except psycopg.errors.QueryCanceled:
                return await problem(
                    request, 503, "A query was cut",
                    f"The database stopped a query of this page after the dashboard's "
                    f"{self.config.statement_timeout:g} s statement timeout. Narrow the filter "
                    "(a topic, a state, a time range) and try again.")
            except (EventNotFoundError, ScheduleNotFoundError) as exc:
                return await problem(request, 404, "Not found", str(exc))
            except psycopg.errors.DataError as exc:
                # A value only the database can judge (a payload filter's regular
                # expression, a number out of range): the request's fault, not ours.
                return await problem(request, 400, "Cannot do that",
                                     f"the database refused a value of this request: "
                                     f"{exc.diag.message_primary or exc}")
            except (InvalidInputError, ConveyorError) as exc:
                return await problem(request, 400, "Cannot do that", str(exc))
            except psycopg.OperationalError as exc:
                return await problem(request, 503, "Database unavailable",
                                     f"The database could not be reached: {exc}")
        return endpoint

    async def _refuse_post(self, request: Request) -> Response | None:
        """The 403 for a POST from another origin or without its CSRF token, else None."""
        problem = origin_problem(request, self.config.public_origin)
        if problem is not None:
            return await self.render.problem(request, 403, "Stale or foreign form", problem)
        form = await request.form()
        field = form.get(CSRF_FIELD)
        if not token_ok(request, field if isinstance(field, str) else None):
            return await self.render.problem(
                request, 403, "Stale or foreign form",
                "The form's security token does not match the browser's conveyor_csrf cookie "
                "(the cookie is missing or the form came from elsewhere): reload the page and "
                "try again.")
        return None
