"""Runs handler calls and turns what happened into an :class:`Outcome`.

:class:`Executor` is the one handler path, shared by the worker and
:func:`conveyor.testing.work_event`; the functions below classify how a call
ended, whatever it raised.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import math
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Executor as ThreadExecutor
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from conveyor.errors import InvalidInputError
from conveyor.log_context import CURRENT_EVENT, add_source
from conveyor.middleware import HandlerResult, Middleware, check_middleware
from conveyor.outcomes import Cancel, PermanentFailure, RetryAfter, Snooze, reason_text
from conveyor.retry import RetryPolicy
from conveyor.router import Route, Router
from conveyor.types import Event, EventState
from conveyor.validation import DELAY_MAX_SECONDS, encode_payload
from conveyor.worker.running import Running, RunningSet

log = logging.getLogger(__name__)

EAGER_TASKS = sys.version_info >= (3, 12)
SWEEP_INTERVAL = 0.05
ERROR_MAX_CHARS = 2000
# Nesting a stored result may have, as an enqueued payload by default.
RESULT_MAX_DEPTH = 64
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
# ``watched`` on one it has just made.
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


def _traceback(exc: BaseException | None = None) -> str | None:
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
    return _failure_never_raising(event, error, None if exc is None else _traceback(exc), backoff)


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


def _a(value: object) -> str:
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _batch_outcomes(route: Route, events: list[Event], results: object,
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
        return _batch_failed(route, events, f"returned {_a(results)} that raised "
                             f"{reason_text(exc)}", _traceback(), backoff)
    else:
        try:
            # A generator runs the handler's code here, and may raise part-way.
            items = list(iterator)
        except BaseException as exc:  # noqa: BLE001 - as above
            return _batch_failed(route, events, f"returned {_a(results)} that raised "
                                 f"{reason_text(exc)}", _traceback(), backoff)
    if items is None or len(items) != len(events) \
            or not all(r is None or isinstance(r, BaseException) for r in items):
        shown = f"{len(items)} items" if items is not None else f"{type(results).__name__}"
        return _batch_failed(route, events, f"returned {shown} for {len(events)} events: "
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


def _batch_failed(route: Route, events: list[Event], what: str, tb: str | None,
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
        tb = _traceback()
    else:
        return Outcome(event.id, event.attempt, EventState.SUCCEEDED, result=text, watched=True)
    return Outcome(event.id, event.attempt, EventState.FAILED, watched=True, traceback=tb,
                   error=_clip(f"handler of {event.topic} succeeded but its result could not "
                               f"be stored: {reason}", ERROR_MAX_CHARS))


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


# Shared, never appended to: a call without middleware allocates no list.
_NONE_ENTERED: list[Middleware] = []


def _result(outcome: Outcome, raised: BaseException | None, started: float) -> HandlerResult:
    return HandlerResult(
        state=outcome.state, error=outcome.error, exception=raised,
        duration=time.monotonic() - started,
        retry_in=outcome.delay if outcome.state is EventState.PENDING else None,
        attempt_spent=not outcome.refund)


def _hook_failed(hook: Middleware, event: Event) -> None:
    # The outcome is decided; a hook's error must not change it.
    log.exception("middleware %r failed after event %d", hook, event.id,
                  extra={"action": "middleware_failed", "event_id": event.id})


def _after_quietly(hook: Middleware, event: Event, result: HandlerResult) -> None:
    try:
        done = hook.after(event, result)
        if done is not None:   # an async hook on the inline path cannot happen: see _async_hooks
            raise TypeError("an async after() hook needs a task; handlers ran inline")
    except HOOK_ERRORS:  # logged with its traceback by _hook_failed
        _hook_failed(hook, event)


def _stopped() -> bool:
    """Whether the current task is being cancelled from outside (a stop, a lost lease)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _exit_refused(exc: BaseException, event: Event) -> None:
    log.error("handler of %s raised %s; recorded as a failed attempt, the worker keeps running",
              event.topic, type(exc).__name__,
              extra={"action": "handler_exit_refused", "event_id": event.id,
                     "topic": event.topic, "attempt": event.attempt})


class Executor:
    """The one handler path: batch start, inline call, task body, deadline sweep.

    The worker runs every claimed event through it, and
    :func:`conveyor.testing.work_event` runs its one event through it too, so a
    test exercises exactly what production does. Each outcome goes to ``sink``
    while its event still holds its slot in ``running`` (a lost lease or a
    hand-back drops the slot first, and the late outcome is not written).

    Args:
        router: resolves each event's topic to its route.
        running: the slots; the executor records each call's task there.
        sink: takes each outcome (the completer's ``add``).
        handler_timeout: a route without a timeout of its own gets this one.
        backoff: the retry policy of routes without one of their own.
        timeout: when set, wins over every route's timeout (``work_event``'s argument).
        threads: size of the pool for plain handlers: a thread per slot, and as
            many in reserve for threads a timed-out handler leaves running.
        middleware: hooks around every call (see :mod:`conveyor.middleware`).
    """

    def __init__(self, router: Router, running: RunningSet, sink: Callable[[Outcome], None], *,
                 handler_timeout: float, backoff: RetryPolicy, timeout: float | None = None,
                 threads: int, middleware: Sequence[Middleware] = ()) -> None:
        self._resolve = router.resolve
        self._running = running
        self._entries = running.entries     # the same dict, looked up once per batch
        self._sink = sink
        self._handler_timeout = handler_timeout
        self._timeout = timeout
        self._backoff = backoff
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inline_done: asyncio.Future[None] | None = None
        self._inline_event: Event | None = None   # the inline handler running now, if any
        self._starting_event: Event | None = None  # the handler of a task starting eagerly
        self._task_events: weakref.WeakKeyDictionary[asyncio.Future[None], Event] = (
            weakref.WeakKeyDictionary())
        add_source(self.event_of_current_task)
        self._middleware = check_middleware(middleware)
        # An async hook needs a task to await in: no handler is called inline then.
        self._async_hooks = any(inspect.iscoroutinefunction(m.before)
                                or inspect.iscoroutinefunction(m.after) for m in self._middleware)

    def start(self, events: list[Event]) -> None:
        """Start the handlers of claimed events whose slots are taken in ``running``."""
        # The per-batch lookups are made once here, not once per event: this loop
        # runs for every claimed event (hot path, measured: see docs/benchmarks.md).
        loop = self._loop = asyncio.get_running_loop()
        now = loop.time()
        entries = self._entries
        resolve = self._resolve
        default_timeout = self._timeout or self._handler_timeout
        override = self._timeout
        call = self._call
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._threads,
                                            thread_name_prefix="conveyor-handler")
        started = False
        batches: dict[int, tuple[Route, list[Running]]] | None = None
        for event in events:
            running = entries.get((event.id, event.attempt))
            if running is None or running.task is not None:
                continue
            route = resolve(event.topic)
            if route is None:
                # The claim filter should make this impossible; give the event back untouched.
                self._sink(Outcome.handed_back(event))
                continue
            if route.batch:
                if batches is None:
                    batches = {}
                batches.setdefault(id(route), (route, []))[1].append(running)
                continue
            if not route.is_async and not route.blocking and not self._async_hooks:
                # A plain handler routed blocking=False runs to completion in one
                # call that nothing can interrupt: it needs no task or coroutine
                # of its own, and its deadline only bounds how long the watchdog
                # keeps its lease while it blocks the loop.
                running.task = self._finished(loop)
                running.deadline = now + (override or route.timeout or default_timeout)
                self._call_inline(route, event)
                continue
            timeout = override or route.timeout or default_timeout
            running.deadline = now + timeout
            coro = call(route, event, running, timeout)
            if EAGER_TASKS:
                # Python 3.12+: the handler runs at once, up to its first real wait,
                # with itself as the current task; one that never waits costs no
                # scheduling round at all.
                self._starting_event = event
                running.task = asyncio.Task(coro, loop=loop,  # type: ignore[call-arg]
                                            eager_start=True)
                self._starting_event = None
            else:
                running.task = loop.create_task(coro)
            started = True
        for route, runnings in (batches or {}).values():
            timeout = override or route.timeout or default_timeout
            task = loop.create_task(self._call_batch(route, runnings, timeout))
            # One callback per batch (per event it would cost about 2 us on the
            # hot path; a one-event call guarantees its outcome in _call itself).
            task.add_done_callback(functools.partial(self._batch_ended, route, runnings))
            for running in runnings:
                running.task = task
                running.deadline = now + timeout
            started = True
        if started and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = loop.create_task(self._sweep_deadlines())

    def close(self) -> None:
        """Stop the deadline sweeper and let go of the thread pool (never waits for its threads)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def blocking_event(self) -> Event | None:
        """The event whose handler holds the loop now; safe to call from another thread."""
        if self._inline_event is not None:
            return self._inline_event
        task = asyncio.current_task(self._loop) if self._loop is not None else None
        if task is None:
            return None
        for running in list(self._entries.values()):
            if running.task is task:
                return running.event
        return self._starting_event

    def held_during_stall(self, loop_now: float, stalled_for: float) -> list[int]:
        """Ids of the events whose leases to keep while the loop has been stuck for
        ``stalled_for`` seconds; ``loop_now`` is the loop's clock now. Safe from another thread.

        A call still running is held until its deadline: the handler blocking
        the loop may finish and succeed, but one that blocks for ever must not
        hold its event for ever. A call not started yet, or whose outcome waits
        for the loop to be written, is held for the handler timeout from the
        start of the stall.
        """
        default = self._timeout or self._handler_timeout
        stall_started = loop_now - stalled_for
        inline = self._inline_event
        held = []
        for running in list(self._entries.values()):
            task = running.task
            if task is None or (task.done() and running.event is not inline):
                limit = stall_started + default
            else:
                limit = running.deadline
            if loop_now < limit:
                held.append(running.event.id)
        return held

    def event_of_current_task(self) -> Event | None:
        """The event whose handler runs in the current task of this executor's loop, or None.

        For the log context (see :mod:`conveyor.log_context`): looked up when a
        record is logged, cached per task.
        """
        loop = self._loop
        if loop is None:
            return None
        try:
            if asyncio.get_running_loop() is not loop:
                return None
        except RuntimeError:   # not on an event loop's thread
            return None
        if self._inline_event is not None:
            return self._inline_event
        task = asyncio.current_task(loop)
        if task is None:
            return None
        event = self._task_events.get(task)
        if event is None:
            for running in list(self._entries.values()):
                if running.task is task:
                    event = running.event
                    break
            else:
                return self._starting_event
            self._task_events[task] = event
        return event

    def _finished(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A completed future standing in for the task of an inline handler call."""
        done = self._inline_done
        if done is None or done.get_loop() is not loop:
            done = self._inline_done = loop.create_future()
            done.set_result(None)
        return done

    def _call_inline(self, route: Route, event: Event) -> None:
        """Call a ``blocking=False`` plain handler here and hand on its outcome."""
        if self._middleware:
            # Hooks may set context variables for the handler: in a copy, so they
            # stay this call's and do not weigh on the fetch loop's own context.
            contextvars.copy_context().run(self._inline, route, event)
        else:
            self._inline(route, event)

    def _inline(self, route: Route, event: Event) -> None:
        self._inline_event = event
        hooks = self._middleware
        entered: list[Middleware] = [] if hooks else _NONE_ENTERED
        started = time.monotonic() if hooks else 0.0
        raised: BaseException | None = None
        outcome: Outcome | None = None
        try:
            try:
                if hooks:
                    for hook in hooks:
                        hook.before(event)
                        entered.append(hook)
                value = route.handler(event)
            except BaseException as exc:  # noqa: BLE001 - even SystemExit: see HANDLER_EXITS
                raised = exc
                outcome = outcome_of_error(exc, event, route.backoff or self._backoff)
                if isinstance(exc, HANDLER_EXITS):
                    _exit_refused(exc, event)
            else:
                outcome = (stored_success(event, route, value) if route.store_result
                           else success(event))
            if route.store_result:
                outcome.watched = True
            if entered:
                result = _result(outcome, raised, started)
                for hook in reversed(entered):
                    _after_quietly(hook, event, result)
        except BaseException as exc:  # noqa: BLE001 - the safety net: see unsettled_outcome
            # Raised here, it would end the fetch loop and the worker with it.
            if outcome is None:
                outcome = unsettled_outcome(route, event, exc, route.backoff or self._backoff)
        finally:
            self._inline_event = None
        self._sink(outcome)

    async def _call(self, route: Route, event: Event, running: Running, timeout: float) -> None:
        """One handler call in its own task, with its deadline enforced by the sweeper."""
        hooks = self._middleware
        entered: list[Middleware] = [] if hooks else _NONE_ENTERED
        started = time.monotonic() if hooks else 0.0
        raised: BaseException | None = None
        outcome: Outcome | None = None
        try:
            try:
                if hooks:
                    # Written out here rather than in a helper coroutine: a coroutine
                    # object per call and per hook is measurable on a no-op handler.
                    for hook in hooks:
                        done = hook.before(event)
                        if done is not None:
                            await done
                        entered.append(hook)   # its after() runs, whatever comes next
                if route.is_async:
                    value = await route.handler(event)
                else:
                    value = await call_handler(route, event, self._pool,
                                               self._running.thread_abandoned,
                                               contextvars.copy_context() if hooks else None)
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                cancelling = task.cancelling() if task is not None else 0
                if not cancelling:
                    # The handler raised CancelledError itself: a failed attempt like any other.
                    raised = exc
                    outcome = outcome_of_error(exc, event, route.backoff or self._backoff)
                elif running.timed_out and cancelling == 1:
                    assert task is not None
                    task.uncancel()
                    outcome = failure(event, f"handler timed out after {timeout:g}s", None,
                                      route.backoff or self._backoff)
                else:
                    raise   # a stop or a lost lease: the worker decides what to write
            except BaseException as exc:  # noqa: BLE001 - even SystemExit: see HANDLER_EXITS
                raised = exc
                outcome = outcome_of_error(exc, event, route.backoff or self._backoff)
                if isinstance(exc, HANDLER_EXITS):
                    _exit_refused(exc, event)
            else:
                outcome = (stored_success(event, route, value) if route.store_result
                           else success(event))
            if route.store_result:
                outcome.watched = True
            if entered:
                result = _result(outcome, raised, started)
                for hook in reversed(entered):
                    try:
                        done = hook.after(event, result)
                        if done is not None:
                            await done
                    except HOOK_ERRORS:  # logged with its traceback by _hook_failed
                        _hook_failed(hook, event)
                    except asyncio.CancelledError:
                        if _stopped():
                            raise
                        _hook_failed(hook, event)   # raised by the hook itself
        except BaseException as exc:  # the safety net: see unsettled_outcome
            # Here rather than in a done callback on every task: that costs
            # about 2 us per event (measured with a no-op handler).
            if isinstance(exc, asyncio.CancelledError) and _stopped():
                raise   # a stop or a lost lease: the worker decides what to write
            if outcome is None:
                outcome = unsettled_outcome(route, event, exc, route.backoff or self._backoff)
        if (event.id, event.attempt) in self._entries:
            self._sink(outcome)

    async def _call_batch(self, route: Route, runnings: list[Running], timeout: float) -> None:
        """One call of a batch handler for the route's events of one claim, in its own task.

        Middleware sees each event as if it had a call of its own: every
        ``before`` in order, the call, every ``after`` in reverse. The deadline
        is the batch's: the sweeper cancels the task when it passes, and every
        event of the batch gets the timeout. Whatever escapes, the task's done
        callback (:meth:`_batch_ended`) gives the events left without an outcome
        a failed attempt.
        """
        events = [r.event for r in runnings]
        backoff = route.backoff or self._backoff
        hooks = self._middleware
        entered: list[tuple[Event, Middleware]] = []
        started = time.monotonic()
        raised: BaseException | None = None
        outcomes: list[Outcome]
        try:
            for event in events:
                for hook in hooks:
                    done = hook.before(event)
                    if done is not None:
                        await done
                    entered.append((event, hook))
            handler: Any = route.handler    # a batch handler takes the list (Router.add)
            # A copy: the handler may consume or reorder its list (``events.pop()``),
            # and the results are matched to these events, in this order.
            results = await handler(list(events))
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            cancelling = task.cancelling() if task is not None else 0
            if not cancelling:
                raised = exc
                outcomes = [outcome_of_error(exc, e, backoff) for e in events]
            elif cancelling == 1 and any(r.timed_out for r in runnings):
                assert task is not None
                task.uncancel()
                outcomes = [failure(e, f"batch handler timed out after {timeout:g}s", None,
                                    backoff) for e in events]
            else:
                raise   # a stop: the worker decides what to write
        except BaseException as exc:  # noqa: BLE001 - even SystemExit: see HANDLER_EXITS
            raised = exc
            outcomes = [outcome_of_error(exc, e, backoff) for e in events]
            if isinstance(exc, HANDLER_EXITS):
                _exit_refused(exc, events[0])
        else:
            try:
                outcomes = _batch_outcomes(route, events, results, backoff)
            except BaseException as exc:  # noqa: BLE001 - the handler's objects ran in there
                outcomes = _batch_failed(route, events, f"returned {_a(results)} that could "
                                         f"not be read: {reason_text(exc)}", _traceback(), backoff)
        by_id = {o.event_id: o for o in outcomes}
        for event, hook in reversed(entered):
            outcome = by_id[event.id]
            try:
                done = hook.after(event, _result(outcome, raised, started))
                if done is not None:
                    await done
            except HOOK_ERRORS:  # logged with its traceback by _hook_failed
                _hook_failed(hook, event)
            except asyncio.CancelledError:
                if _stopped():
                    raise   # a stop: the worker decides what to write
                _hook_failed(hook, event)   # raised by the hook itself
        for running, outcome in zip(runnings, outcomes, strict=True):
            running.settled = True
            if (outcome.event_id, outcome.attempt) in self._entries:
                self._sink(outcome)

    def _batch_ended(self, route: Route, runnings: list[Running],
                     task: asyncio.Future[None]) -> None:
        """The safety net of a batch call: an event it left without an outcome gets a failure.

        A cancelled task was stopped from outside (a shutdown, lost leases):
        the worker hands those events back or has dropped them already.
        """
        if task.cancelled():
            return
        exc = task.exception()   # retrieved, so asyncio does not report it at exit
        for running in runnings:
            event = running.event
            if running.settled or self._entries.get((event.id, event.attempt)) is not running:
                continue
            running.settled = True
            self._sink(unsettled_outcome(route, event, exc, route.backoff or self._backoff))

    async def _sweep_deadlines(self) -> None:
        """Cancel handlers past their deadline: one periodic pass instead of a timer per call."""
        loop = asyncio.get_running_loop()
        entries = self._entries
        while entries:
            await asyncio.sleep(SWEEP_INTERVAL)
            now = loop.time()
            cancelled: set[asyncio.Future[None]] = set()
            for running in list(entries.values()):
                task = running.task
                if now >= running.deadline and task is not None and not task.done() \
                        and not running.timed_out:
                    running.timed_out = True
                    if task not in cancelled:     # a batch's events share one task
                        cancelled.add(task)
                        task.cancel()
