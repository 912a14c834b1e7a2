"""Runs one handler call and turns what happened into an :class:`Outcome`."""

from __future__ import annotations

import asyncio
import logging
import math
import traceback
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from conveyor.log_context import CURRENT_EVENT
from conveyor.outcomes import Cancel, PermanentFailure, RetryAfter, Snooze, reason_text
from conveyor.retry import RetryPolicy
from conveyor.router import Route
from conveyor.types import Event, EventState
from conveyor.validation import DELAY_MAX_SECONDS

log = logging.getLogger(__name__)

ERROR_MAX_CHARS = 2000
TRACEBACK_MAX_CHARS = 4000
# Used only when even the retry policy failed while recording an error.
FALLBACK_RETRY_DELAY = 60.0
# SystemExit, KeyboardInterrupt and GeneratorExit raised by a handler are its
# own doing (argparse or click inside it, a library calling sys.exit): a failed
# attempt like any other error. The worker's own stop comes from its signal
# handlers, never from an exception inside a handler, so nothing is lost by
# not letting them through, and the handler's neighbours finish normally.
HANDLER_EXITS: tuple[type[BaseException], ...] = (SystemExit, KeyboardInterrupt, GeneratorExit)


# Not frozen: one is made per handled event, and a frozen dataclass's __init__
# costs about 1 us more (object.__setattr__ per field). Nothing mutates one.
@dataclass(slots=True)
class Outcome:
    """What to write back for one attempt (fenced on ``event_id`` + ``attempt``)."""

    event_id: int
    attempt: int
    state: EventState
    delay: float | None = None
    refund: int = 0
    error: str | None = None
    traceback: str | None = None

    @classmethod
    def handed_back(cls, event: Event) -> Outcome:
        """Returned unfinished at shutdown: due now, the attempt given back."""
        return cls(event.id, event.attempt, EventState.PENDING, delay=0.0, refund=1)


def _clip(text: object, limit: int) -> str:
    """``text`` cut to ``limit`` bytes of UTF-8 (stored sizes are bytes, not characters).

    PostgreSQL text cannot hold NUL, and lone surrogates cannot be encoded: an
    error message must never be what makes its acknowledgement fail. Anything
    that is not a str is printed first, without raising.
    """
    data = reason_text(text).replace("\x00", "\\0").encode("utf-8", "replace")
    if len(data) <= limit:
        return data.decode("utf-8")
    return data[: limit - 15].decode("utf-8", "ignore") + "...[truncated]"


def _describe(exc: BaseException) -> str:
    return _clip(reason_text(exc), ERROR_MAX_CHARS)


def _traceback() -> str | None:
    """The traceback being handled, clipped; None if even formatting it fails."""
    try:
        return _clip(traceback.format_exc(), TRACEBACK_MAX_CHARS)
    except BaseException:  # noqa: BLE001 - a broken __str__ deep in a chain must not lose the outcome
        return None


def failure(event: Event, error: str, tb: str | None, backoff: RetryPolicy,
            delay: float | None = None) -> Outcome:
    """A failed attempt: retried after a delay, or parked when it was the last."""
    if event.attempt >= event.max_attempts:
        return Outcome(event.id, event.attempt, EventState.FAILED, error=error, traceback=tb)
    wait = backoff.delay(event.attempt) if delay is None else delay
    # Whatever a policy computes, the database must be able to store it.
    wait = min(max(wait, 0.0), DELAY_MAX_SECONDS) if math.isfinite(wait) else DELAY_MAX_SECONDS
    return Outcome(event.id, event.attempt, EventState.PENDING, delay=wait, error=error,
                   traceback=tb)


def _call_plain(handler: Callable[[Event], Any], event: Event) -> None:
    """Run a plain handler in a pool thread, with its event as the logging context.

    A StopIteration (``next()`` on an exhausted iterator) cannot be set on an
    asyncio future: it would be logged from a callback and the call would never
    complete, holding the slot until the handler timeout with the error lost.
    """
    token = CURRENT_EVENT.set(event)
    try:
        handler(event)
    except StopIteration as exc:
        raise RuntimeError(f"handler raised StopIteration: {reason_text(exc)}") from exc
    finally:
        CURRENT_EVENT.reset(token)


async def _in_thread(route: Route, event: Event, pool: Executor,
                     on_abandoned: Callable[[Future[Any]], None] | None) -> None:
    future = pool.submit(_call_plain, route.handler, event)
    try:
        await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        # A queued call is cancelled with its wrapper; a running one cannot be
        # stopped, and whoever owns the pool must know its thread is still busy.
        if not future.done() and on_abandoned is not None:
            on_abandoned(future)
        raise


def outcome_of_error(exc: BaseException, event: Event, backoff: RetryPolicy) -> Outcome:
    """What a handler call that raised ``exc`` leads to (a signal, or a failed attempt).

    Call it inside the ``except`` block, so the traceback is the handler's.
    Never raises: whatever the handler raised, with whatever reason or broken
    ``__str__``, its event gets an outcome, or it would stay ``running``.
    """
    try:
        return _classify(exc, event, backoff)
    except BaseException:  # see above; the fallback uses nothing of the handler's
        log.exception("could not describe a handler's error; recording it as unprintable",
                      extra={"action": "outcome_fallback", "event_id": event.id})
        error = f"<unprintable {type(exc).__name__}>"
        if event.attempt >= event.max_attempts:
            return Outcome(event.id, event.attempt, EventState.FAILED, error=error)
        return Outcome(event.id, event.attempt, EventState.PENDING, delay=FALLBACK_RETRY_DELAY,
                       error=error)


def _classify(exc: BaseException, event: Event, backoff: RetryPolicy) -> Outcome:
    if isinstance(exc, RetryAfter):
        return failure(event, _clip(exc.reason, ERROR_MAX_CHARS), None, backoff, delay=exc.seconds)
    if isinstance(exc, Snooze):
        return Outcome(event.id, event.attempt, EventState.PENDING, delay=exc.seconds, refund=1)
    if isinstance(exc, PermanentFailure):
        return Outcome(event.id, event.attempt, EventState.FAILED,
                       error=_clip(exc.reason or "permanent failure", ERROR_MAX_CHARS))
    if isinstance(exc, Cancel):
        return Outcome(event.id, event.attempt, EventState.CANCELLED,
                       error=_clip("cancelled by handler" + (f": {exc.reason}" if exc.reason
                                                             else ""), ERROR_MAX_CHARS))
    if isinstance(exc, asyncio.CancelledError) and not reason_text(exc):
        message = "handler raised CancelledError"
    else:
        message = _describe(exc)
    return failure(event, message, _traceback(), backoff)


def success(event: Event) -> Outcome:
    return Outcome(event.id, event.attempt, EventState.SUCCEEDED)


async def call_handler(route: Route, event: Event, thread_pool: Executor | None,
                       on_abandoned: Callable[[Future[Any]], None] | None) -> None:
    """Call the handler the way its kind needs: awaited, in a thread, or inline."""
    if route.is_async:
        await route.handler(event)
    elif route.blocking:
        if thread_pool is None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, _call_plain, route.handler, event)
        else:
            await _in_thread(route, event, thread_pool, on_abandoned)
    else:
        route.handler(event)


async def run_handler(
    route: Route,
    event: Event,
    *,
    timeout: float | None,
    backoff: RetryPolicy,
    thread_pool: Executor | None,
    on_abandoned: Callable[[Future[Any]], None] | None = None,
) -> Outcome:
    """Call the route's handler with a timeout and classify the result.

    With ``timeout=None`` the caller enforces the deadline itself by cancelling
    the task. ``on_abandoned`` is told about a plain handler's thread that is
    still running when the call timed out or was cancelled. (The worker inlines
    this in its own task to save two coroutines per event.)
    """
    token = CURRENT_EVENT.set(event)
    try:
        return await _run_with_deadline(route, event, timeout, backoff, thread_pool, on_abandoned)
    finally:
        CURRENT_EVENT.reset(token)


async def _run_with_deadline(route: Route, event: Event, timeout: float | None,
                             backoff: RetryPolicy, thread_pool: Executor | None,
                             on_abandoned: Callable[[Future[Any]], None] | None) -> Outcome:
    deadline: asyncio.Timeout | None = None
    try:
        if timeout is None:
            await call_handler(route, event, thread_pool, on_abandoned)
        else:
            async with asyncio.timeout(timeout) as deadline:
                await call_handler(route, event, thread_pool, on_abandoned)
    except TimeoutError as exc:
        if deadline is not None and deadline.expired():
            return failure(event, f"handler timed out after {timeout:g}s", None, backoff)
        return outcome_of_error(exc, event, backoff)
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller cancelled this call (shutdown, lost lease)
        return outcome_of_error(exc, event, backoff)
    except BaseException as exc:  # noqa: BLE001 - even SystemExit: see HANDLER_EXITS
        return outcome_of_error(exc, event, backoff)
    return success(event)
