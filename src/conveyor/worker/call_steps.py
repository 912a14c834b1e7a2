"""The steps of the executor's call core that every driver shares.

A handler call is: the ``before`` hooks, the call, the outcomes of what it
returned (or raised: :meth:`~conveyor.worker.executor.Executor._failed`), the
``after`` hooks. The hook steps run every hook that returns nothing and stop
at one that returns something to await, so the inline driver can refuse to
wait (:func:`before_inline`, :func:`after_inline`) and the task driver awaits
(:func:`before_awaited`, :func:`after_awaited`), each over the same steps,
and a call whose hooks await nothing pays for no coroutine. Apart from the
:class:`~conveyor.worker.executor.Executor` because they need none of its
state: a call's route, events and hooks are all they read.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from conveyor.middleware import HandlerResult, Middleware
from conveyor.outcomes import reason_text
from conveyor.retry import RetryPolicy
from conveyor.router import Route
from conveyor.types import Event
from conveyor.worker.classify import (
    HOOK_ERRORS,
    Outcome,
    batch_failed,
    batch_outcomes,
    handler_result,
    stored_success,
    success,
    traceback_text,
    with_article,
)
from conveyor.worker.handler_call import stopped_from_outside

log = logging.getLogger("conveyor.worker.executor")


# A call without middleware enters no hook: shared, never appended to.
NO_HOOKS: list[Middleware] = []
# A one-event call's results by id: none (shared, never written to).
NO_RESULTS: dict[int, HandlerResult] = {}
ASYNC_HOOK_INLINE = "an async hook needs a task; handlers ran inline"


def hook_failed(hook: Middleware, event: Event) -> None:
    # The outcome is decided; a hook's error must not change it.
    log.exception("middleware %r failed after event %d", hook, event.id,
                  extra={"action": "middleware_failed", "event_id": event.id})


def returned(route: Route, events: list[Event], value: object,
              default_backoff: RetryPolicy) -> list[Outcome]:
    """The call core's outcomes of a call that returned ``value``."""
    if route.batch:
        backoff = route.backoff or default_backoff
        try:
            return batch_outcomes(route, events, value, backoff)
        except BaseException as exc:  # noqa: BLE001 - the handler's objects ran in there
            return batch_failed(route, events, f"returned {with_article(value)} that could "
                                f"not be read: {reason_text(exc)}", traceback_text(), backoff)
    event = events[0]
    if not route.store_result:
        return [success(event)]
    outcome = stored_success(event, route, value)
    outcome.watched = True
    return [outcome]


def quiet_context(quiets: tuple[Callable[[Event], bool], ...], event: Event
                  ) -> contextvars.Context | None:
    """The context an attempt every hook lets through runs in, without its hooks;
    None when one of them wants to see it (then what the others set is dropped).

    Each ``quiet`` runs in the copy the handler would get, so the context
    variables it sets (the producer's trace context, say) are the handler's.
    """
    context = contextvars.copy_context()
    try:
        for quiet in quiets:
            if not context.run(quiet, event):
                return None
    except Exception:   # raised here, it would end the fetch loop: the hooks decide
        log.exception("middleware quiet() failed for event %d; its hooks run", event.id,
                      extra={"action": "middleware_failed", "event_id": event.id})
        return None
    return context


def stamp(outcomes: list[Outcome], started: float) -> None:
    """The start (``time.monotonic()``) and duration of the call that decided ``outcomes``."""
    duration = time.monotonic() - started
    for outcome in outcomes:
        outcome.started = started
        outcome.duration = duration


def enters_all(hooks: Sequence[Middleware]) -> bool:
    """Whether no hook has a ``before`` of its own: every hook is entered, nothing to call."""
    return all(getattr(hook.before, "__func__", None) is Middleware.before for hook in hooks)


def quiet_hooks(hooks: Sequence[Middleware]) -> tuple[Callable[[Event], bool], ...] | None:
    """Every hook's ``quiet`` when each has one of its own, else None: one hook that
    sees every attempt makes every attempt run the hooks."""
    quiets = [getattr(hook, "quiet", None) for hook in hooks]   # optional: see check_middleware
    if not hooks or any(quiet is None or getattr(quiet, "__func__", None) is Middleware.quiet
                        for quiet in quiets):
        return None
    return tuple(quiets)  # type: ignore[arg-type]


def before_hooks(hooks: Sequence[Middleware], events: list[Event],
                 entered: list[Middleware]) -> Awaitable[Any] | None:
    """The call core's ``before`` hooks, event by event, from the first not yet in
    ``entered``; stops at the first that returns something to await and returns it
    (its hook is entered once that is awaited: :func:`before_awaited`).

    ``entered`` grows as a prefix of every hook for every event, in order: its
    n-th hook is ``hooks[n % len(hooks)]``, run for ``events[n // len(hooks)]``.
    A plain function, not a generator the drivers step through: a generator and
    the coroutine driving it were a third of what a hook cost a call (hot path,
    measured: see docs/benchmarks.md).
    """
    count = len(hooks)
    for number in range(len(entered), len(events) * count):
        hook = hooks[number % count]
        done = hook.before(events[number // count])
        if done is not None:
            return done
        entered.append(hook)   # its after() runs, whatever comes next
    return None


def before_inline(hooks: Sequence[Middleware], events: list[Event],
                  entered: list[Middleware]) -> None:
    """The ``before`` hooks run here: nothing can be awaited inline (see Executor._async_hooks)."""
    if before_hooks(hooks, events, entered) is not None:
        raise TypeError(ASYNC_HOOK_INLINE)


async def before_awaited(hooks: Sequence[Middleware], events: list[Event],
                         entered: list[Middleware], done: Awaitable[Any]) -> None:
    """The rest of the ``before`` hooks once one returned ``done``: awaited in the task.
    What it raises is the attempt's error, and that hook is not entered."""
    pending: Awaitable[Any] | None = done
    while pending is not None:
        await pending
        entered.append(hooks[len(entered) % len(hooks)])
        pending = before_hooks(hooks, events, entered)


def hook_results(outcomes: list[Outcome], raised: BaseException | None, started: float
                 ) -> tuple[HandlerResult | None, dict[int, HandlerResult]]:
    """What the ``after`` hooks see: the one result of a one-event call, else each
    event's by id."""
    if len(outcomes) == 1:
        return handler_result(outcomes[0], raised, started), NO_RESULTS
    return None, {o.event_id: handler_result(o, raised, started) for o in outcomes}


def after_hooks(hooks: Sequence[Middleware], events: list[Event], entered: list[Middleware],
                results: tuple[HandlerResult | None, dict[int, HandlerResult]], last: int, *,
                stoppable: bool) -> tuple[Awaitable[Any], int] | None:
    """The call core's ``after`` hooks in reverse, from ``entered[last]`` down; each sees
    its event's result. Stops at the first that returns something to await and
    returns it with that hook's position (the drivers go on from the one below)."""
    one, by_id = results
    for number in range(last, -1, -1):
        hook = entered[number]
        event = events[0] if one is not None else events[number // len(hooks)]
        try:
            done = hook.after(event, by_id[event.id] if one is None else one)
        except BaseException as exc:  # noqa: BLE001 - sorted by after_raised
            after_raised(exc, hook, event, stoppable=stoppable)
        else:
            if done is not None:
                return done, number
    return None


def after_raised(exc: BaseException, hook: Middleware, event: Event, *, stoppable: bool) -> None:
    """An ``after`` hook raised ``exc``: logged and ignored, for the outcome is decided;
    a stop from outside, and what no handler may catch either, are raised again."""
    if isinstance(exc, asyncio.CancelledError):
        if stoppable and stopped_from_outside():
            raise exc
    elif not isinstance(exc, HOOK_ERRORS):
        raise exc
    hook_failed(hook, event)   # logged with its traceback


def after_inline(hooks: Sequence[Middleware], events: list[Event], entered: list[Middleware],
                 results: tuple[HandlerResult | None, dict[int, HandlerResult]]) -> None:
    """The ``after`` hooks run here: one that returns something to await has failed."""
    last = len(entered) - 1
    while (pending := after_hooks(hooks, events, entered, results, last,
                                  stoppable=False)) is not None:
        last = pending[1]
        try:
            raise TypeError(ASYNC_HOOK_INLINE)
        except TypeError as exc:
            after_raised(exc, entered[last], events[last // len(hooks)], stoppable=False)
        last -= 1


async def after_awaited(hooks: Sequence[Middleware], events: list[Event],
                        entered: list[Middleware],
                        results: tuple[HandlerResult | None, dict[int, HandlerResult]],
                        pending: tuple[Awaitable[Any], int] | None) -> None:
    """The rest of the ``after`` hooks once one returned something to await, in the task."""
    while pending is not None:
        done, last = pending
        try:
            await done
        except BaseException as exc:  # noqa: BLE001 - sorted by after_raised
            after_raised(exc, entered[last], events[last // len(hooks)], stoppable=True)
        pending = after_hooks(hooks, events, entered, results, last - 1, stoppable=True)
