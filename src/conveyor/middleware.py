"""Hooks around every handler call: the seam for metrics, tracing and your own code.

A :class:`Middleware` sees each attempt twice: :meth:`~Middleware.before` right
before the handler runs, and :meth:`~Middleware.after` once the attempt's
outcome is decided (before it is written). Install them on the worker, and on
:func:`conveyor.testing.work_event` in tests::

    class Timing(Middleware):
        def after(self, event, result):
            log.info("%s took %.3fs: %s", event.topic, result.duration, result.state)

    Worker(dsn, router, middleware=[Timing(), SentryMiddleware()])

Either hook may be ``async def``. A worker with no middleware runs none of
this: the hooks cost nothing until one is installed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import NamedTuple

from conveyor.errors import ConfigError
from conveyor.types import Event, EventState


# A NamedTuple, not a frozen dataclass: one is made per handled event while any
# middleware is installed, and a frozen dataclass's __init__ pays an
# object.__setattr__ per field (hot path, measured: see docs/benchmarks.md).
class HandlerResult(NamedTuple):
    """How one attempt ended, as :meth:`Middleware.after` sees it.

    Attributes:
        state: what the event becomes: ``succeeded``; ``pending`` (a retry, or
            a snooze when ``attempt_spent`` is false); ``failed`` (parked);
            ``cancelled``.
        error: the recorded error text, None on success.
        exception: what the handler (or a ``before`` hook) raised, None on success.
        duration: seconds from just before the handler was called to its end.
        retry_in: seconds until the event is due again, when it is pending.
        attempt_spent: False only for a :class:`~conveyor.Snooze`.
    """

    state: EventState
    error: str | None
    exception: BaseException | None
    duration: float
    retry_in: float | None
    attempt_spent: bool


class Middleware:
    """Base class of handler middleware; override the hooks you need.

    Hooks run in the handler's own context: a context variable set in
    ``before`` (a tracing span, a logging context) is seen by the handler, in
    its thread too for a plain handler. ``before`` hooks run in the order the
    middleware was installed, ``after`` hooks in the reverse order.

    ``before`` may end the attempt: whatever it raises counts as if the
    handler had raised it (``RetryAfter`` from a rate limiter, say); the
    handler and the remaining ``before`` hooks are not called, the ``after``
    hooks of the middleware whose ``before`` ran are. An exception from
    ``after`` is logged and ignored: the outcome is decided.

    A call cut short by the worker's shutdown or by a lost lease has no
    outcome (the event is handed back, or is another worker's now), so
    ``after`` is not called for it.
    """

    def before(self, event: Event) -> Awaitable[None] | None:
        """Called right before the handler; returns nothing (or is a coroutine)."""
        return None

    def after(self, event: Event, result: HandlerResult) -> Awaitable[None] | None:
        """Called once the attempt's outcome is decided; returns nothing (or is a coroutine)."""
        return None

    def quiet(self, event: Event) -> bool:
        """Whether this attempt may run without the hooks; a fast path, optional.

        Called in the handler's context before anything else, and only when
        every installed middleware overrides it: when each returns True, no
        ``before`` or ``after`` runs for the attempt, and the handler sees the
        context variables ``quiet`` set (a tracing middleware makes an
        unsampled trace's context current this way, and records nothing).
        When one returns False, every hook runs as usual, in a context where
        what the others set is gone. Never called for a batch handler's events.
        """
        return False


def check_middleware(middleware: Sequence[object]) -> tuple[Middleware, ...]:
    """The middleware as a tuple, each one checked to have the hooks."""
    checked = []
    for number, item in enumerate(middleware):
        if not (callable(getattr(item, "before", None)) and callable(getattr(item, "after", None))):
            raise ConfigError(f"expected middleware[{number}] to have before() and after() "
                              f"methods (subclass conveyor.Middleware), got {item!r:.80}")
        checked.append(item)
    return tuple(checked)  # type: ignore[arg-type]
