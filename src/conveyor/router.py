"""Routes topics to handlers: exact topics, ``prefix.*`` patterns, or ``*``.

Rules are tried in the order they were added; the first match wins. A worker
claims only topics its router matches, so single-purpose workers can share one
events table without ever claiming an event they cannot handle.

Example::

    router = Router()

    @router.route("email.send", timeout=30)
    async def send_email(event):
        ...

    router.add("billing.*", handle_billing)

    @router.task("report.build")          # a typed task: report.enqueue(conn, 2026, 11)
    async def report(year: int, month: int) -> None:
        ...
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypedDict, TypeVar, Unpack, cast

from conveyor.cron import CATCH_UP_DEFAULT, Schedule
from conveyor.errors import ConfigError, InvalidInputError
from conveyor.flow import FlowLimit
from conveyor.patterns import TopicPattern, check_topic_pattern, sql_params
from conveyor.retry import RetryPolicy
from conveyor.types import Event

if TYPE_CHECKING:
    from conveyor.tasks import Task

Handler = Callable[[Event], Any] | Callable[[Event], Awaitable[Any]]
# A batch route's handler (Router.add(..., batch=True)): the events of one claim.
BatchHandler = Callable[[list[Event]], Awaitable[Any]]
P = ParamSpec("P")
R = TypeVar("R")

class RouteOptions(TypedDict, total=False):
    """The keyword options of :meth:`Router.add`, for the decorators that pass them on."""

    timeout: float | None
    blocking: bool
    backoff: RetryPolicy | None
    store_result: bool
    result_limit: int
    max_running: int | None
    rate: str | None
    fair_by: str | None
    fifo_by: str | None
    batch: bool


# Bytes of JSON text a stored result may take: by default, and at most (the
# column's domain refuses more, migration 0010).
RESULT_LIMIT_DEFAULT = 64 * 1024
RESULT_LIMIT_MAX = 1024 * 1024
# Nesting a stored result may have, as an enqueued payload by default.
RESULT_MAX_DEPTH = 64


@dataclass(frozen=True, slots=True)
class Route:
    """One routing rule.

    Attributes:
        pattern: ``"topic"``, ``"prefix.*"`` or ``"*"``.
        handler: a plain or ``async`` callable taking the :class:`Event`.
        timeout: seconds one call may run; ``None`` uses the worker's
            ``handler_timeout``.
        is_async: whether ``handler`` is a coroutine function.
        blocking: for plain callables, whether to run them in a thread (the
            default) rather than inline on the event loop.
        backoff: delays between this route's failed attempts; ``None`` uses the
            worker's ``backoff``.
        store_result: whether the handler's return value is stored with its
            event as JSON (:meth:`conveyor.Admin.result`, :meth:`conveyor.Admin.wait`).
        result_limit: the most bytes of JSON text a stored result may take.
        flow: the route's flow control (max_running, rate, fair_by, fifo_by), None
            without any (see :mod:`conveyor.flow`).
        batch: whether ``handler`` takes a list of events (the route's events of
            one claim) and returns one result per event (docs/batches.md).
    """

    pattern: str
    handler: Handler
    timeout: float | None
    is_async: bool
    blocking: bool
    backoff: RetryPolicy | None = None
    store_result: bool = False
    result_limit: int = RESULT_LIMIT_DEFAULT
    flow: FlowLimit | None = None
    batch: bool = False

    def matches(self, topic: str) -> bool:
        return TopicPattern(self.pattern).matches(topic)


class Router:
    """An ordered list of routes from topic patterns to handlers."""

    def __init__(self) -> None:
        self._routes: list[Route] = []
        self._cache: dict[str, Route | None] = {}
        self._schedules: list[Schedule] = []

    @property
    def routes(self) -> tuple[Route, ...]:
        return tuple(self._routes)

    @property
    def schedules(self) -> tuple[Schedule, ...]:
        """The cron schedules declared with :meth:`cron`, in order."""
        return tuple(self._schedules)

    def cron(self, expression: str, topic: str, payload: Any = None, *, name: str | None = None,
             tz: str = "UTC", catch_up: float = CATCH_UP_DEFAULT, tenant: str | None = None,
             priority: int = 0, max_attempts: int = 5) -> Schedule:
        """Enqueue an event on ``topic`` at every slot of ``expression``; returns the schedule.

        ``expression``: five cron fields (minute hour day month weekday), or
        six with seconds first; read in ``tz``, an IANA zone (default UTC),
        with Debian cron's rules across daylight saving changes.
        ``catch_up``: seconds a slot may be late and still fire (default 300);
        older ones are skipped and counted. ``name`` keys the schedule in the
        database (default ``"<topic> <expression>"``, plus the zone when not
        UTC). Every worker running this router fires it, each slot once in
        all; the workers need not route ``topic`` themselves. Needs the
        ``cron`` extra (cronsim). See docs/cron.md.
        """
        schedule = Schedule.define(expression, topic, payload, name=name, tz=tz,
                                   catch_up=catch_up, tenant=tenant, priority=priority,
                                   max_attempts=max_attempts)
        if any(s.name == schedule.name for s in self._schedules):
            raise ConfigError(f"cron schedule {schedule.name!r} is already declared; "
                              f"give the second one a name=")
        self._schedules.append(schedule)
        return schedule

    def add(
        self,
        pattern: str,
        handler: Handler | BatchHandler,
        *,
        timeout: float | None = None,
        blocking: bool = True,
        backoff: RetryPolicy | None = None,
        store_result: bool = False,
        result_limit: int = RESULT_LIMIT_DEFAULT,
        max_running: int | None = None,
        rate: str | None = None,
        fair_by: str | None = None,
        fifo_by: str | None = None,
        batch: bool = False,
    ) -> Route:
        """Add a rule; ``blocking=False`` runs a plain callable inline on the loop.

        ``store_result=True`` keeps what the handler returns (JSON, at most
        ``result_limit`` bytes, 64 KiB by default, 1 MiB at most) with the
        event; see docs/results.md.

        Flow control, enforced in the claim across all workers (docs/flow-control.md):
        ``max_running`` events of the pattern at once; ``rate`` starts at
        most (``"10/s"``, ``"600/m"``, ``"5/10s"``); ``fair_by="tenant"``
        takes each tenant's events in turn; ``fifo_by="tenant"`` (or
        ``"payload.<key>"``) runs the events of one key one at a time, in order.

        ``batch=True``: ``handler`` is an ``async def`` taking the list of this
        route's events from one claim and returning None (all succeeded) or one
        result per event, in order: None for a success, an exception for what
        raising it would have meant (``RetryAfter``, ``Snooze``, ``Cancel``,
        ``PermanentFailure`` or any error, a failed attempt); one call for the
        whole batch, under the route's timeout (docs/batches.md).
        """
        try:
            pattern = check_topic_pattern(pattern)
        except InvalidInputError as exc:
            raise ConfigError(str(exc)) from None
        if not callable(handler):
            raise ConfigError(f"handler for {pattern!r} is not callable: {handler!r:.60}")
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"expected timeout for {pattern!r} to be > 0, got {timeout!r}")
        if isinstance(result_limit, bool) or not isinstance(result_limit, int) \
                or not 1 <= result_limit <= RESULT_LIMIT_MAX:
            raise ConfigError(f"expected result_limit for {pattern!r} to be an int from 1 to "
                              f"{RESULT_LIMIT_MAX}, got {result_limit!r}")
        flow = FlowLimit.define(pattern, max_running, rate, fair_by, fifo_by)
        if any(r.pattern == pattern for r in self._routes):
            raise ConfigError(f"topic pattern {pattern!r} is already routed")
        is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004 - async callable objects
        )
        if batch and not is_async:
            raise ConfigError(f"batch handler for {pattern!r} must be an async def taking a "
                              f"list of events, got {handler!r:.60}")
        if batch and store_result:
            raise ConfigError(f"route {pattern!r}: a batch handler's results are not stored "
                              "(store_result=True needs one call per event)")
        # A batch handler is stored as a Handler: only the executor's batch path
        # calls it, with the list.
        route = Route(pattern, cast(Handler, handler), timeout, is_async, blocking, backoff,
                      bool(store_result), result_limit, flow, bool(batch))
        self._routes.append(route)
        self._cache.clear()
        return route

    def route(self, pattern: str, **options: Unpack[RouteOptions]) -> Callable[[Handler], Handler]:
        """Decorator form of :meth:`add`, with the same options."""

        def register(handler: Handler) -> Handler:
            self.add(pattern, handler, **options)
            return handler

        return register

    def task(self, topic: str, **options: Unpack[RouteOptions]
             ) -> Callable[[Callable[P, R]], Task[P, R]]:
        """Decorator: route ``topic`` to the function and return it as a typed :class:`Task`
        (``task.enqueue(conn, *args, **kwargs)``; see :mod:`conveyor.tasks`); the options
        are :meth:`add`'s."""
        from conveyor.tasks import Task

        def register(fn: Callable[P, R]) -> Task[P, R]:
            task = Task(fn, topic)
            self.add(topic, task.handler(), **options)
            return task

        return register

    def include(self, other: Router) -> None:
        """Add every route and cron schedule of ``other`` after this router's own.

        The same pattern or schedule name in both raises ConfigError.
        """
        for r in other.routes:
            if any(mine.pattern == r.pattern for mine in self._routes):
                raise ConfigError(f"topic pattern {r.pattern!r} is already routed")
            self._routes.append(r)
            self._cache.clear()
        for schedule in other.schedules:
            if any(s.name == schedule.name for s in self._schedules):
                raise ConfigError(f"cron schedule {schedule.name!r} is already declared")
            self._schedules.append(schedule)

    def result_limit(self, topic: str) -> int | None:
        """The stored-result limit of ``topic``'s route; None when no route takes it."""
        route = self.resolve(topic)
        return None if route is None else route.result_limit

    def resolve(self, topic: str) -> Route | None:
        """The first route matching ``topic``, or ``None``."""
        try:
            return self._cache[topic]
        except KeyError:
            pass
        found = next((r for r in self._routes if r.matches(topic)), None)
        if len(self._cache) < 10_000:
            self._cache[topic] = found
        return found

    def handles(self, topic: str) -> bool:
        return self.resolve(topic) is not None

    @property
    def patterns(self) -> list[str]:
        return [r.pattern for r in self._routes]

    def claim_filter(self) -> dict[str, Any]:
        """Parameters for the claim query: which topics this router may claim."""
        return sql_params([r.pattern for r in self._routes])
