"""Runs handler calls and hands on their :class:`~conveyor.worker.classify.Outcome`.

:class:`Executor` is the one handler path, shared by the worker and
:func:`conveyor.testing.work_event`. Every call goes through one core: the ``before``
hooks, the call, its outcomes (``returned``, :meth:`Executor._failed`: the exits,
``store_result``, the timeout), the ``after`` hooks (those steps shared by every driver
are in :mod:`conveyor.worker.call_steps`) and the safety net
(:meth:`Executor._unsettled`); an attempt every middleware lets through
(``Middleware.quiet``) skips the hooks and runs in the context they set up. Two drivers
compose it, as httpx drives one auth flow sync and async: :meth:`Executor._inline` calls
a ``blocking=False`` plain handler right here, :meth:`Executor._call` runs one call, or
one call of a batch handler, in a task. The hook steps stop at what is to be awaited, so
each driver waits (or refuses to) in its own way; the call itself is written out in each
driver, since a generator or coroutine per call is measurable on a no-op handler.

How a call ended becomes an outcome in :mod:`conveyor.worker.classify`; how a handler is
called (awaited, in a thread) is :mod:`conveyor.worker.handler_call`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from conveyor.log_context import add_source
from conveyor.middleware import Middleware, check_middleware
from conveyor.retry import RetryPolicy
from conveyor.router import Route, Router
from conveyor.types import Event
from conveyor.worker.call_steps import (
    NO_HOOKS,
    NO_RESULTS,
    after_awaited,
    after_hooks,
    after_inline,
    before_awaited,
    before_hooks,
    before_inline,
    enters_all,
    hook_results,
    quiet_context,
    quiet_hooks,
    returned,
    stamp,
)
from conveyor.worker.classify import ERROR_MAX_CHARS as ERROR_MAX_CHARS
from conveyor.worker.classify import (
    HANDLER_EXITS,
    exit_refused,
    failure,
    handler_result,
    outcome_of_error,
    unsettled_outcome,
)
from conveyor.worker.classify import TRACEBACK_MAX_CHARS as TRACEBACK_MAX_CHARS
from conveyor.worker.classify import Outcome as Outcome
from conveyor.worker.handler_call import call_handler, stopped_from_outside
from conveyor.worker.in_flight import InFlight
from conveyor.worker.running import Running, RunningSet

log = logging.getLogger(__name__)

EAGER_TASKS = sys.version_info >= (3, 12)


class Executor(InFlight):
    """The one handler path: one call core, driven inline or in a task.

    Its base, :class:`~conveyor.worker.in_flight.InFlight`, sweeps the deadlines
    and tells the watchdog and the log context which call holds the loop.

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
        timed: stamp each call's outcomes with its start and duration, for a
            :class:`~conveyor.worker.accounting.SettledObserver`.
    """

    def __init__(self, router: Router, running: RunningSet, sink: Callable[[Outcome], None], *,
                 handler_timeout: float, backoff: RetryPolicy, timeout: float | None = None,
                 threads: int, middleware: Sequence[Middleware] = (), timed: bool = False
                 ) -> None:
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
        self._inline_event = None
        self._starting_event = None
        self._task_events = weakref.WeakKeyDictionary()
        add_source(self.event_of_current_task)
        self._middleware = check_middleware(middleware)
        self._timed = timed
        # An async hook needs a task to await in: no handler is called inline then.
        self._async_hooks = any(inspect.iscoroutinefunction(m.before)
                                or inspect.iscoroutinefunction(m.after) for m in self._middleware)
        # Hooks with only an ``after`` (metrics, say) are entered without a step to run
        # (a generator per call would be most of their cost), a one-event call into a
        # list all share: nothing appends to a full list (hot path, measured).
        self._enters_all = enters_all(self._middleware)
        self._entered_one: list[Middleware] = [*self._middleware] if self._enters_all else []
        # Every hook's ``quiet``, when each has one: an attempt they all let
        # through runs as if no middleware were installed (see quiet_context).
        self._quiet = quiet_hooks(self._middleware)

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
        quiets = self._quiet
        # Read once here and handed to each call: a look-up per call was
        # measurable on a no-op handler (benchmarks/hook_instructions.py).
        timed = self._timed
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
            # A quiet attempt's context: what its hooks set up there instead of running.
            quiet = quiet_context(quiets, event) if quiets is not None else None
            if not route.is_async and not route.blocking and not self._async_hooks:
                # A plain handler routed blocking=False runs to completion in one
                # call that nothing can interrupt: it needs no task or coroutine
                # of its own, and its deadline only bounds how long the watchdog
                # keeps its lease while it blocks the loop.
                running.task = self._finished(loop)
                running.deadline = now + (override or route.timeout or default_timeout)
                self._call_inline(route, event, quiet, timed)
                continue
            timeout = override or route.timeout or default_timeout
            running.deadline = now + timeout
            coro = call(route, [event], [running], timeout,
                        self._middleware if quiet is None else NO_HOOKS, timed)
            if EAGER_TASKS:
                # Python 3.12+: the handler runs at once, up to its first real wait,
                # with itself as the current task; one that never waits costs no
                # scheduling round at all.
                self._starting_event = event
                running.task = asyncio.Task(coro, loop=loop,  # type: ignore[call-arg]
                                            eager_start=True, context=quiet)
                self._starting_event = None
            else:
                running.task = loop.create_task(coro, context=quiet)
            started = True
        for route, runnings in (batches or {}).values():
            timeout = override or route.timeout or default_timeout
            task = loop.create_task(call(route, [r.event for r in runnings], runnings, timeout,
                                         self._middleware, timed))
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

    def _entered(self, events: list[Event]) -> list[Middleware]:
        """Every hook of every event (see :func:`before_hooks`) when no hook has a
        ``before``; else an empty list for :func:`before_hooks` to fill as each
        one's ``before`` returns."""
        if not self._enters_all:
            return []
        return [*self._middleware] * len(events)

    def _call_inline(self, route: Route, event: Event, quiet: contextvars.Context | None,
                     timed: bool) -> None:
        """Call a ``blocking=False`` plain handler here and hand on its outcome."""
        if quiet is not None:
            quiet.run(self._inline, route, event, NO_HOOKS, timed)
        elif self._middleware:
            # Hooks may set context variables for the handler: in a copy, so they
            # stay this call's and do not weigh on the fetch loop's own context.
            contextvars.copy_context().run(self._inline, route, event, self._middleware, timed)
        else:
            self._inline(route, event, NO_HOOKS, timed)

    def _inline(self, route: Route, event: Event, hooks: Sequence[Middleware],
                timed: bool) -> None:
        """The synchronous driver of the call core: hooks and call, right here."""
        self._inline_event = event
        events = [event]
        entered = NO_HOOKS
        started = 0.0
        raised: BaseException | None = None
        outcomes: list[Outcome] | None = None
        try:
            try:
                if hooks:
                    entered = (self._entered_one if self._enters_all and not route.batch
                               else self._entered(events))
                    started = time.monotonic()
                    if not entered:
                        before_inline(hooks, events, entered)
                elif timed:
                    started = time.monotonic()
                value = route.handler(event)
            except BaseException as exc:  # noqa: BLE001 - even SystemExit: see HANDLER_EXITS
                outcomes, raised = self._failed(route, events, exc, None, 0.0)
            else:
                outcomes = returned(route, events, value, self._backoff)
            if timed:
                stamp(outcomes, started)
            if entered:
                after_inline(hooks, events, entered, hook_results(outcomes, raised, started))
        except BaseException as exc:  # noqa: BLE001 - raised here, it would end the fetch loop
            outcomes = self._unsettled(route, events, exc, outcomes, None)
        finally:
            self._inline_event = None
        self._sink(outcomes[0])

    async def _call(self, route: Route, events: list[Event], runnings: list[Running],
                    timeout: float, hooks: Sequence[Middleware], timed: bool) -> None:
        """The asynchronous driver of the call core: one call in its own task, or one
        call of a batch handler for the route's events of one claim.

        Its deadline is enforced by the sweeper, which cancels the task; a
        batch's deadline is the batch's, and every event of it gets the timeout.
        Middleware sees each event of a batch as if it had a call of its own.
        ``hooks``: the executor's middleware, or none for a ``quiet`` attempt,
        whose task runs in the context its hooks' ``quiet`` set up.
        """
        entered = NO_HOOKS
        started = 0.0
        raised: BaseException | None = None
        outcomes: list[Outcome] | None = None
        try:
            try:
                if hooks:
                    entered = (self._entered_one if self._enters_all and not route.batch
                               else self._entered(events))
                    started = time.monotonic()
                    if not entered and (done := before_hooks(hooks, events,
                                                             entered)) is not None:
                        await before_awaited(hooks, events, entered, done)
                elif timed:
                    started = time.monotonic()
                if route.batch:
                    handler: Any = route.handler    # a batch handler takes the list
                    # A copy: the handler may consume or reorder its list
                    # (``events.pop()``); the results are matched to these events.
                    value = await handler(list(events))
                elif route.is_async:
                    value = await route.handler(events[0])
                else:
                    # The context copied after the hooks ran (or their quiet set it
                    # up): what they set reaches the thread.
                    value = await call_handler(
                        route, events[0], self._pool, self._running.thread_abandoned,
                        contextvars.copy_context() if self._middleware else None)
            except BaseException as exc:  # noqa: BLE001 - even SystemExit: see HANDLER_EXITS
                outcomes, raised = self._failed(route, events, exc, runnings, timeout)
            else:
                outcomes = returned(route, events, value, self._backoff)
            if timed:
                stamp(outcomes, started)
            if entered:
                results = ((handler_result(outcomes[0], raised, started), NO_RESULTS)
                           if len(outcomes) == 1 else hook_results(outcomes, raised, started))
                pending = after_hooks(hooks, events, entered, results,
                                      len(entered) - 1, stoppable=True)
                if pending is not None:
                    await after_awaited(hooks, events, entered, results, pending)
        except BaseException as exc:  # noqa: BLE001 - the safety net: see _unsettled
            outcomes = self._unsettled(route, events, exc, outcomes, runnings)
        if not route.batch:
            if (events[0].id, events[0].attempt) in self._entries:
                self._sink(outcomes[0])
            return
        for running, outcome in zip(runnings, outcomes, strict=True):
            running.settled = True
            if (outcome.event_id, outcome.attempt) in self._entries:
                self._sink(outcome)

    def _failed(self, route: Route, events: list[Event], exc: BaseException,
                runnings: list[Running] | None, timeout: float
                ) -> tuple[list[Outcome], BaseException | None]:
        """The call core's outcomes of a call that raised ``exc``, and the error the
        hooks see (none for a timeout). Called in the driver's ``except`` block, so
        the traceback is the handler's.

        A CancelledError in a task (``runnings``) is the handler's own unless the
        task is being cancelled: once, with a slot past its deadline, it is a
        timeout and the cancel is taken back; otherwise a stop or a lost lease,
        re-raised for the worker to decide what to write.
        """
        backoff = route.backoff or self._backoff
        raised: BaseException | None = exc
        if runnings is not None and isinstance(exc, asyncio.CancelledError) \
                and (task := asyncio.current_task()) is not None and task.cancelling():
            if task.cancelling() > 1 or not any(r.timed_out for r in runnings):
                raise exc
            task.uncancel()
            what = "batch handler" if route.batch else "handler"
            outcomes = [failure(e, f"{what} timed out after {timeout:g}s", None, backoff)
                        for e in events]
            raised = None
        else:
            outcomes = [outcome_of_error(exc, e, backoff) for e in events]
            if isinstance(exc, HANDLER_EXITS):
                exit_refused(exc, events[0])
        if route.store_result:
            outcomes[0].watched = True
        return outcomes, raised

    def _unsettled(self, route: Route, events: list[Event], exc: BaseException,
                   outcomes: list[Outcome] | None, runnings: list[Running] | None
                   ) -> list[Outcome]:
        """The safety net of the call core: what escaped a call leaves no event without
        an outcome (here rather than in a done callback on every task, which
        the hot path would pay for).

        A stop or a lost lease is re-raised (the worker decides what to write);
        so is anything escaping a batch call, whose net is its task's done
        callback (:meth:`_batch_ended`).
        """
        if route.batch or (runnings is not None and isinstance(exc, asyncio.CancelledError)
                           and stopped_from_outside()):
            raise exc
        if outcomes is not None:
            return outcomes
        return [unsettled_outcome(route, e, exc, route.backoff or self._backoff) for e in events]

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
