"""The steps of the executor's call core that every driver shares.

A handler call is: the ``before`` hooks, the call, the outcomes of what it
returned (or raised: :meth:`~conveyor.worker.executor.Executor._failed`), the
``after`` hooks. The hooks are generators that yield what is to be awaited, so
the inline driver can refuse to wait (:func:`hooks_inline`) and the task driver
awaits (:func:`hooks_awaited`), each over the same steps. Apart from the
:class:`~conveyor.worker.executor.Executor` because they need none of its
state: a call's route, events and hooks are all they read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Generator, Sequence
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
NO_HOOKS: list[tuple[Event, Middleware]] = []
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


def enters_all(hooks: Sequence[Middleware]) -> bool:
    """Whether no hook has a ``before`` of its own: every hook is entered, nothing to call."""
    return all(getattr(hook.before, "__func__", None) is Middleware.before for hook in hooks)


def before_hooks(hooks: Sequence[Middleware], events: list[Event],
            entered: list[tuple[Event, Middleware]]) -> Generator[Any, Any, None]:
    """The call core's ``before`` hooks, event by event; yields what a hook returns to await."""
    for event in events:
        for hook in hooks:
            done = hook.before(event)
            if done is not None:
                yield done
            entered.append((event, hook))   # its after() runs, whatever comes next


def after_hooks(entered: list[tuple[Event, Middleware]], outcomes: list[Outcome],
           raised: BaseException | None, started: float, *,
           stoppable: bool) -> Generator[Any, Any, None]:
    """The call core's ``after`` hooks, in reverse; each sees its event's outcome."""
    one = handler_result(outcomes[0], raised, started) if len(outcomes) == 1 else None
    by_id = {o.event_id: o for o in outcomes} if one is None else {}
    results: dict[int, HandlerResult] = {}
    for event, hook in reversed(entered):
        result = one or results.get(event.id)
        if result is None:
            result = results[event.id] = handler_result(by_id[event.id], raised, started)
        try:
            done = hook.after(event, result)
            if done is not None:
                yield done
        except HOOK_ERRORS:  # logged with its traceback by hook_failed
            hook_failed(hook, event)
        except asyncio.CancelledError:
            if stoppable and stopped_from_outside():
                raise
            hook_failed(hook, event)   # raised by the hook itself


def hooks_inline(steps: Generator[Any, Any, None]) -> None:
    """Run hook steps here: nothing can be awaited inline (see Executor._async_hooks)."""
    try:
        next(steps)
        while True:
            steps.throw(TypeError(ASYNC_HOOK_INLINE))
    except StopIteration:
        pass


async def hooks_awaited(steps: Generator[Any, Any, None]) -> None:
    """Run hook steps in a task, awaiting what they yield and throwing back its error."""
    try:
        step = next(steps)
        while True:
            try:
                await step
            except BaseException as exc:  # noqa: BLE001 - thrown in: the step decides
                step = steps.throw(exc)
            else:
                step = steps.send(None)
    except StopIteration:
        pass
