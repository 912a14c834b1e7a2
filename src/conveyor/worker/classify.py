"""How a handler call ended, as an :class:`Outcome`: pure decisions, no I/O.

Whatever a handler returned or raised (a signal such as
:class:`~conveyor.outcomes.RetryAfter`, an error, even ``SystemExit``), its
event gets an outcome: these functions never raise. The
:class:`~conveyor.worker.executor.Executor` calls them from each of its call
paths; the retry delay comes from the route's (or the worker's) retry policy.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import InvalidInputError
from conveyor.middleware import HandlerResult
from conveyor.outcomes import Cancel, PermanentFailure, RetryAfter, Snooze, reason_text
from conveyor.retry import RetryPolicy
from conveyor.router import RESULT_MAX_DEPTH, Route
from conveyor.types import Event, EventState
from conveyor.validation import DELAY_MAX_SECONDS, encode_payload

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
# What a middleware hook's after() may raise without changing the decided
# outcome: the same as a handler (a CancelledError is a stop, and goes through).
HOOK_ERRORS: tuple[type[BaseException], ...] = (Exception, *HANDLER_EXITS)


# Not frozen: one is made per handled event, and a frozen dataclass's __init__
# costs about 1 us more (object.__setattr__ per field). Only the executor sets
# ``watched``, ``started`` and ``duration`` on one it has just made.
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
    # The handler's return value as JSON text, for a route with store_result.
    result: str | None = None
    # Someone may wait for this event's end (a store_result route): the
    # acknowledgement announces a final state on the results channel.
    watched: bool = False
    # When the handler call that decided it began (time.monotonic()) and how
    # long it ran, stamped by an executor that times its calls (a
    # SettledObserver is installed: conveyor/worker/accounting.py); unset on
    # an outcome no call decided (a hand-back) or that nobody times. Not
    # __init__ arguments, so that an outcome nobody times sets nothing more.
    started: float = field(init=False, repr=False, compare=False)
    duration: float = field(init=False, repr=False, compare=False)

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


def traceback_text(exc: BaseException | None = None) -> str | None:
    """The traceback of ``exc`` (default: the one being handled), clipped; None if even
    formatting it fails."""
    try:
        text = traceback.format_exc() if exc is None else "".join(traceback.format_exception(exc))
        return _clip(text, TRACEBACK_MAX_CHARS)
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


def _failure_never_raising(event: Event, error: str, tb: str | None,
                           backoff: RetryPolicy) -> Outcome:
    """:func:`failure`, falling back to a fixed delay if even the retry policy raises."""
    try:
        return failure(event, error, tb, backoff)
    except BaseException:  # the event needs an outcome whatever the policy does
        log.exception("the retry policy failed; retrying in %gs", FALLBACK_RETRY_DELAY,
                      extra={"action": "outcome_fallback", "event_id": event.id})
        if event.attempt >= event.max_attempts:
            return Outcome(event.id, event.attempt, EventState.FAILED, error=error, traceback=tb)
        return Outcome(event.id, event.attempt, EventState.PENDING, delay=FALLBACK_RETRY_DELAY,
                       error=error, traceback=tb)


def unsettled_outcome(route: Route, event: Event, exc: BaseException | None,
                      backoff: RetryPolicy) -> Outcome:
    """The failed attempt of an event whose call ended without an outcome.

    The executor's safety net: every way a call ends is meant to decide an
    outcome, and an event left without one would stay ``running``, its lease
    renewed, for as long as the worker lives. Whatever slipped through (``exc``)
    is recorded, and the event is retried or parked like after any failure.
    """
    what = f": {_describe(exc)}" if exc is not None else ""
    error = _clip(f"handler call of {route.pattern} ended without an outcome{what}",
                  ERROR_MAX_CHARS)
    log.error("event %d (%s): %s; recorded as a failed attempt", event.id, event.topic, error,
              extra={"action": "outcome_missing", "event_id": event.id, "topic": event.topic,
                     "attempt": event.attempt})
    return _failure_never_raising(event, error, None if exc is None else traceback_text(exc), backoff)


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
    return failure(event, message, traceback_text(), backoff)


def with_article(value: object) -> str:
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def batch_outcomes(route: Route, events: list[Event], results: object,
                    backoff: RetryPolicy) -> list[Outcome]:
    """Each event's outcome from what a batch handler returned (see Router.add)."""
    if results is None:
        return [success(e) for e in events]
    items: list[Any] | None
    try:
        iterator = iter(results)  # type: ignore[call-overload]
    except TypeError:
        items = None
    except BaseException as exc:  # noqa: BLE001 - the handler's object; see HANDLER_EXITS
        return batch_failed(route, events, f"returned {with_article(results)} that raised "
                             f"{reason_text(exc)}", traceback_text(), backoff)
    else:
        try:
            # A generator runs the handler's code here, and may raise part-way.
            items = list(iterator)
        except BaseException as exc:  # noqa: BLE001 - as above
            return batch_failed(route, events, f"returned {with_article(results)} that raised "
                                 f"{reason_text(exc)}", traceback_text(), backoff)
    if items is None or len(items) != len(events) \
            or not all(r is None or isinstance(r, BaseException) for r in items):
        shown = f"{len(items)} items" if items is not None else f"{type(results).__name__}"
        return batch_failed(route, events, f"returned {shown} for {len(events)} events: "
                             "expected None or one None-or-exception per event", None, backoff)
    outcomes = []
    for event, result in zip(events, items, strict=True):
        if result is None:
            outcomes.append(success(event))
            continue
        try:
            raise result
        except BaseException as exc:  # noqa: BLE001 - classified like a raised error
            outcomes.append(outcome_of_error(exc, event, backoff))
    return outcomes


def batch_failed(route: Route, events: list[Event], what: str, tb: str | None,
                  backoff: RetryPolicy) -> list[Outcome]:
    error = _clip(f"batch handler of {route.pattern} {what}", ERROR_MAX_CHARS)
    return [failure(e, error, tb, backoff) for e in events]


def success(event: Event) -> Outcome:
    return Outcome(event.id, event.attempt, EventState.SUCCEEDED)


def stored_success(event: Event, route: Route, value: object) -> Outcome:
    """A success that keeps the handler's return value; one that cannot be stored parks the event.

    Parked, not retried: the handler's work is done, and running it again
    would not make what it returns storable. Never raises: the value's own
    code runs here (a mapping's ``items()``, a ``__str__``), and whatever it
    raises, even MemoryError or SystemExit, is the reason recorded.
    """
    tb = None
    try:
        text = encode_payload(value, max_bytes=route.result_limit, max_depth=RESULT_MAX_DEPTH)
    except InvalidInputError as exc:
        # The payload checks' messages, about the result here.
        reason = str(exc).replace("payload", "the result", 1)
    except BaseException as exc:  # noqa: BLE001 - see above
        reason = reason_text(exc)
        tb = traceback_text()
    else:
        return Outcome(event.id, event.attempt, EventState.SUCCEEDED, result=text, watched=True)
    return Outcome(event.id, event.attempt, EventState.FAILED, watched=True, traceback=tb,
                   error=_clip(f"handler of {event.topic} succeeded but its result could not "
                               f"be stored: {reason}", ERROR_MAX_CHARS))


def handler_result(outcome: Outcome, raised: BaseException | None, started: float) -> HandlerResult:
    # tuple.__new__ with the fields in order: the NamedTuple's own __new__ is a
    # Python function around it, and from keywords costs three times as much (hot path).
    state = outcome.state
    return tuple.__new__(HandlerResult, (
        state, outcome.error, raised, time.monotonic() - started,
        outcome.delay if state is EventState.PENDING else None, not outcome.refund))


def exit_refused(exc: BaseException, event: Event) -> None:
    log.error("handler of %s raised %s; recorded as a failed attempt, the worker keeps running",
              event.topic, type(exc).__name__,
              extra={"action": "handler_exit_refused", "event_id": event.id,
                     "topic": event.topic, "attempt": event.attempt})
