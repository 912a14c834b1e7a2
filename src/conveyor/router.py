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
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from conveyor.errors import ConfigError, InvalidInputError
from conveyor.retry import RetryPolicy
from conveyor.types import Event
from conveyor.validation import check_topic_pattern

if TYPE_CHECKING:
    from conveyor.tasks import Task

Handler = Callable[[Event], Any] | Callable[[Event], Awaitable[Any]]
P = ParamSpec("P")
R = TypeVar("R")


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
    """

    pattern: str
    handler: Handler
    timeout: float | None
    is_async: bool
    blocking: bool
    backoff: RetryPolicy | None = None

    def matches(self, topic: str) -> bool:
        if self.pattern == "*":
            return True
        if self.pattern.endswith(".*"):
            return topic.startswith(self.pattern[:-1])
        return topic == self.pattern


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class Router:
    """An ordered list of routes from topic patterns to handlers."""

    def __init__(self) -> None:
        self._routes: list[Route] = []
        self._cache: dict[str, Route | None] = {}

    @property
    def routes(self) -> tuple[Route, ...]:
        return tuple(self._routes)

    def add(
        self,
        pattern: str,
        handler: Handler,
        *,
        timeout: float | None = None,
        blocking: bool = True,
        backoff: RetryPolicy | None = None,
    ) -> Route:
        """Add a rule; ``blocking=False`` runs a plain callable inline on the loop."""
        try:
            pattern = check_topic_pattern(pattern)
        except InvalidInputError as exc:
            raise ConfigError(str(exc)) from None
        if not callable(handler):
            raise ConfigError(f"handler for {pattern!r} is not callable: {handler!r:.60}")
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"expected timeout for {pattern!r} to be > 0, got {timeout!r}")
        if any(r.pattern == pattern for r in self._routes):
            raise ConfigError(f"topic pattern {pattern!r} is already routed")
        is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004 - async callable objects
        )
        route = Route(pattern, handler, timeout, is_async, blocking, backoff)
        self._routes.append(route)
        self._cache.clear()
        return route

    def route(
        self, pattern: str, *, timeout: float | None = None, blocking: bool = True,
        backoff: RetryPolicy | None = None,
    ) -> Callable[[Handler], Handler]:
        """Decorator form of :meth:`add`."""

        def register(handler: Handler) -> Handler:
            self.add(pattern, handler, timeout=timeout, blocking=blocking, backoff=backoff)
            return handler

        return register

    def task(
        self, topic: str, *, timeout: float | None = None, blocking: bool = True,
        backoff: RetryPolicy | None = None,
    ) -> Callable[[Callable[P, R]], Task[P, R]]:
        """Decorator: route ``topic`` to the function and return it as a typed :class:`Task`
        (``task.enqueue(conn, *args, **kwargs)``; see :mod:`conveyor.tasks`)."""
        from conveyor.tasks import Task

        def register(fn: Callable[P, R]) -> Task[P, R]:
            task = Task(fn, topic)
            self.add(topic, task.handler(), timeout=timeout, blocking=blocking, backoff=backoff)
            return task

        return register

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
        if any(r.pattern == "*" for r in self._routes):
            return {"all_topics": True, "topics": [], "prefixes": []}
        exact = [r.pattern for r in self._routes if not r.pattern.endswith(".*")]
        prefixes = [_like_escape(r.pattern[:-1]) + "%" for r in self._routes
                    if r.pattern.endswith(".*")]
        return {"all_topics": False, "topics": exact, "prefixes": prefixes}


def patterns_match(patterns: list[str], topic: str) -> bool:
    """Whether any of ``patterns`` (as stored in the worker registry) matches ``topic``."""
    for pattern in patterns:
        if pattern == "*" or pattern == topic:
            return True
        if pattern.endswith(".*") and topic.startswith(pattern[:-1]):
            return True
    return False
