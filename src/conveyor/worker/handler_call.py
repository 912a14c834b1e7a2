"""Calling one handler the way its kind needs: awaited, in a pool thread, or inline.

A plain handler runs in a thread with its event as the logging context; a
thread whose call was cancelled (a timeout) cannot be stopped, so whoever
owns the pool is told it is still busy.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import Executor as ThreadExecutor
from concurrent.futures import Future
from typing import Any

from conveyor.log_context import CURRENT_EVENT
from conveyor.outcomes import reason_text
from conveyor.router import Route
from conveyor.types import Event


def _call_plain(handler: Callable[[Event], Any], event: Event) -> Any:
    """Run a plain handler in a pool thread, with its event as the logging context.

    A StopIteration (``next()`` on an exhausted iterator) cannot be set on an
    asyncio future: it would be logged from a callback and the call would never
    complete, holding the slot until the handler timeout with the error lost.
    """
    token = CURRENT_EVENT.set(event)
    try:
        return handler(event)
    except StopIteration as exc:
        raise RuntimeError(f"handler raised StopIteration: {reason_text(exc)}") from exc
    finally:
        CURRENT_EVENT.reset(token)


async def _in_thread(route: Route, event: Event, pool: ThreadExecutor,
                     on_abandoned: Callable[[Future[Any]], None] | None,
                     context: contextvars.Context | None = None) -> Any:
    if context is None:
        future = pool.submit(_call_plain, route.handler, event)
    else:
        # Middleware may have set context variables (a tracing span) for the handler.
        future = pool.submit(context.run, _call_plain, route.handler, event)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        # A queued call is cancelled with its wrapper; a running one cannot be
        # stopped, and whoever owns the pool must know its thread is still busy.
        if not future.done() and on_abandoned is not None:
            on_abandoned(future)
        raise


async def call_handler(route: Route, event: Event, thread_pool: ThreadExecutor | None,
                       on_abandoned: Callable[[Future[Any]], None] | None,
                       context: contextvars.Context | None = None) -> Any:
    """Call the handler the way its kind needs: awaited, in a thread, or inline;
    return what it returned.

    ``context``: the context a plain handler's thread runs in (default: none copied).
    """
    if route.is_async:
        return await route.handler(event)
    if route.blocking:
        if thread_pool is None:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, _call_plain, route.handler, event)
        return await _in_thread(route, event, thread_pool, on_abandoned, context)
    return route.handler(event)


def stopped_from_outside() -> bool:
    """Whether the current task is being cancelled from outside (a stop, a lost lease)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
