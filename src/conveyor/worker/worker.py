"""The worker process's engine: fetch loop, handler tasks, acks and upkeep.

One worker holds four dedicated connections: the listener, the fetcher, the
completer and maintenance, so a slow acknowledgement never delays a claim and
the LISTEN connection is never borrowed. Every one reconnects on its own.

Example::

    worker = Worker(dsn, router, WorkerConfig(concurrency=50))
    asyncio.run(worker.run())          # until worker.request_stop()
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import operator
import os
import random
import signal
import socket
import sys
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import psycopg

from conveyor.config import WorkerConfig
from conveyor.db.arrays import text_array
from conveyor.db.named_queries import queries_for
from conveyor.errors import ConfigError, MigrationError
from conveyor.log_context import CURRENT_EVENT
from conveyor.router import Router
from conveyor.schema.migrator import AsyncMigrator, latest_version
from conveyor.types import Event, EventState
from conveyor.worker.completer import Completer
from conveyor.worker.connection import (
    CONNECTION_ERRORS,
    RECOVERABLE_ERRORS,
    CursorCache,
    Flag,
    ManagedConnection,
    SessionMode,
    StopRequested,
    bounded,
    bounded_here,
)
from conveyor.worker.executor import (
    HANDLER_EXITS,
    Outcome,
    call_handler,
    failure,
    outcome_of_error,
    success,
)
from conveyor.worker.listener import Listener
from conveyor.worker.maintenance import HORIZON_CHECK_INTERVAL, Maintenance
from conveyor.worker.watchdog import LoopWatchdog

log = logging.getLogger(__name__)

EAGER_TASKS = sys.version_info >= (3, 12)
GENERIC = {"plan_cache_mode": "force_generic_plan"}
_PRIORITY = operator.itemgetter(6)   # event_claim's priority column
# A worker never leaves a transaction open; a session that does is cut off.
IDLE_IN_TX_TIMEOUT = "60s"
PRUNE_TIMEOUT = 300.0

PRUNE_INTERVAL = 600.0
MAX_DUE_TIMES = 10_000
SWEEP_INTERVAL = 0.05
LOCK_TIMEOUT_MS = 1000
CLOCK_SKEW_WARNING = 60.0
# A loop that has not run for this long (or a quarter of the lease, if less) is
# reported: every handler and the heartbeat wait on it.
LOOP_STALL_WARNING = 1.0
_UNREGISTER_ERRORS: tuple[type[BaseException], ...] = (*RECOVERABLE_ERRORS, psycopg.Error)
# A due time announced by NOTIFY further ahead than this is not believed (and a
# timer that far out would be useless: the poll comes much sooner).
MAX_NOTIFIED_AHEAD = 366 * 24 * 3600.0


def _due_epoch(text: str) -> float | None:
    """The due time of a notification payload, or None when it is not a plausible epoch."""
    if len(text) > 32:
        return None
    try:
        epoch = float(text)
    except ValueError:
        return None
    if not math.isfinite(epoch) or epoch <= 0 or epoch > time.time() + MAX_NOTIFIED_AHEAD:
        return None
    return epoch


def log_outcome(event: Event, outcome: Outcome) -> None:
    """One line per failed attempt, scheduled retry, parked or handler-cancelled event.

    Written once the outcome is stored, so the log never tells of a result the
    database refused (a lost lease); the traceback follows at debug level.
    """
    fields = {"event_id": event.id, "topic": event.topic, "tenant": event.tenant,
              "attempt": event.attempt, "error": outcome.error}
    if outcome.state is EventState.PENDING:
        log.warning("event %d (%s) attempt %d/%d failed: %s; retrying in %.1fs", event.id,
                    event.topic, event.attempt, event.max_attempts, outcome.error, outcome.delay,
                    extra={"action": "retry_scheduled", "retry_in_s": outcome.delay, **fields})
    elif outcome.state is EventState.FAILED:
        log.error("event %d (%s) parked failed after attempt %d/%d: %s", event.id, event.topic,
                  event.attempt, event.max_attempts, outcome.error,
                  extra={"action": "event_parked", **fields})
    elif outcome.state is EventState.CANCELLED:
        log.info("event %d (%s) %s", event.id, event.topic, outcome.error,
                 extra={"action": "event_cancelled", **fields})
    if outcome.traceback and log.isEnabledFor(logging.DEBUG):
        log.debug("event %d attempt %d traceback:\n%s", event.id, event.attempt,
                  outcome.traceback, extra={"action": "attempt_traceback", **fields})


def _exit_refused(exc: BaseException, event: Event) -> None:
    log.error("handler of %s raised %s; recorded as a failed attempt, the worker keeps running",
              event.topic, type(exc).__name__,
              extra={"action": "handler_exit_refused", "event_id": event.id,
                     "topic": event.topic, "attempt": event.attempt})


@dataclass(slots=True)
class WorkerStats:
    """Counters since the worker started."""

    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    cancelled: int = 0
    handed_back: int = 0
    lost: int = 0
    rescued: int = 0
    loop_stalls: int = 0          # times a handler blocked the event loop (see LoopWatchdog)
    loop_stall_max_s: float = 0.0


@dataclass(slots=True)
class _Running:
    event: Event
    # The handler's task; for an inline call (blocking=False), a finished future.
    task: asyncio.Task[None] | asyncio.Future[None] | None
    deadline: float = float("inf")    # loop time after which the sweeper cancels it
    timed_out: bool = False


class Worker:
    """Runs the handlers of ``router`` for events in ``config.schema``.

    Args:
        conninfo: libpq connection string or URL; the worker opens its own
            dedicated connections from it (never pooled ones).
        router: which topics this worker claims and who handles them.
        config: tuning. Defaults to ``WorkerConfig()``.
        listen_conninfo: where the LISTEN connection goes when it must bypass a
            transaction pooler (``config.transaction_pooler``); defaults to ``conninfo``.
    """

    def __init__(self, conninfo: str, router: Router, config: WorkerConfig | None = None, *,
                 listen_conninfo: str | None = None) -> None:
        if not router.routes:
            raise ConfigError("router has no routes: the worker would claim nothing")
        self.conninfo = conninfo
        self.router = router
        self.config = config or WorkerConfig()
        self.id = str(uuid.uuid4())
        self.name = self.config.name or f"{socket.gethostname()}:{os.getpid()}"
        self.stats = WorkerStats()
        self._q = queries_for(self.config.schema)
        tenants = self.config.tenants
        claim_filter = {**router.claim_filter(), "all_tenants": tenants is None,
                        "tenants": list(tenants or ())}
        # Array parameters as literals, rendered once: psycopg would adapt each
        # list element by element on every claim.
        self._filter = {k: text_array(v) if isinstance(v, list) else v
                        for k, v in claim_filter.items()}
        self._stopping = Flag()
        self._closing = asyncio.Event()   # set once nothing more will be acknowledged
        self._wake = asyncio.Event()
        # Claimed and not yet acknowledged, by (event id, attempt): the same event
        # can be here twice when a lost attempt still runs and it was re-claimed.
        self._running: dict[tuple[int, int], _Running] = {}
        self._deferred: list[list[Event]] = []     # claimed batches whose handlers start next round
        self._abandoned_threads = 0               # timed-out plain handlers still running
        self._slot_freed = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._due: list[float] = []               # heap of epochs when delayed events fall due
        self._due_set: set[float] = set()
        # Database clock minus this machine's, measured with every heartbeat, so a
        # due time announced by the database fires the local timer on time.
        self.clock_offset = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._rng = random.Random()
        c = self.config
        statement_ms = str(int(c.query_timeout * 1000))

        # Told of a transaction pooler, or finding one on the first connect, the
        # worker keeps no session state on that URL (see SessionMode).
        modes = {conninfo: SessionMode(pooled=c.transaction_pooler)}

        def managed(role: str, settings: dict[str, str] | None = None,
                    target: str = conninfo, **kwargs: Any) -> ManagedConnection:
            settings = {"statement_timeout": statement_ms,
                        "idle_in_transaction_session_timeout": IDLE_IN_TX_TIMEOUT,
                        **(settings or {})}
            return ManagedConnection(target, role, reconnect_min=c.reconnect_min,
                                     reconnect_max=c.reconnect_max, stopping=self._stopping,
                                     settings=settings,
                                     mode=modes.setdefault(target, SessionMode()), **kwargs)
        # Claims and acknowledgements commit asynchronously: one lost in a server
        # crash only makes its event run again, which at-least-once allows (the
        # event is still pending, or its lease expires and it is rescued). It
        # takes the WAL flush out of every claim's and every ack's round trip.
        self._fetch_conn = managed("fetch", settings={"synchronous_commit": "off"})
        # A row another transaction holds must not stall acknowledgements or
        # heartbeats: they give up waiting and step around the lock.
        # Acknowledgements are prepared at once and always run their generic plan
        # (one index probe per id): a custom plan for an array of 1000 ids picks
        # a hash join over the whole table, 10x slower, on the first executions.
        self._ack_conn = managed("ack", settings={"synchronous_commit": "off", **GENERIC,
                                                  "lock_timeout": str(LOCK_TIMEOUT_MS)},
                                 prepare_threshold=0)
        # Pruning a long backlog of finished rows may take minutes.
        self._upkeep_conn = managed("upkeep", settings={
            "lock_timeout": str(LOCK_TIMEOUT_MS),
            "statement_timeout": str(int(max(c.query_timeout, PRUNE_TIMEOUT) * 1000))})
        listen_target = listen_conninfo or conninfo
        self.listens = c.listen and not (c.transaction_pooler is True
                                         and listen_target == conninfo)
        self._listen_conn = managed("listen", target=listen_target)
        self.completer = Completer(self._ack_conn, self._q, self.id,
                                   flush_size=c.batch_size, interval=c.ack_interval,
                                   query_timeout=c.query_timeout,
                                   on_acked=self._acked,
                                   delete_succeeded=c.retention == 0)
        self.listener = Listener(self._listen_conn, self._q.channel,
                                 on_notify=self._notified, on_connected=self.wake,
                                 ping_interval=c.listener_ping_interval,
                                 send_probe=self._send_listen_probe)
        self.maintenance = Maintenance(self._q, c, self.id, self.name, router.patterns,
                                       owned=lambda: list(self._running))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._inline_done: asyncio.Future[None] | None = None
        self._inline_event: Event | None = None   # the inline handler running now, if any
        self._claim_cursor = CursorCache(binary=True)
        self.watchdog = LoopWatchdog(identify=self._blocking_event,
                                     warn_after=min(LOOP_STALL_WARNING, c.lease_ttl / 4),
                                     lease_ttl=c.lease_ttl, on_stall=self._stalled)
        self.started = asyncio.Event()

    # ----------------------------------------------------------------- control

    def wake(self) -> None:
        """Ask the fetch loop to claim now (a NOTIFY arrived, or a slot freed)."""
        self._wake.set()

    def request_stop(self) -> None:
        """Begin a graceful stop: claim nothing more, let running handlers finish."""
        if not self._stopping.is_set():
            log.info("worker stopping", extra={"action": "stopping"})
        self._stopping.set()
        self._wake.set()
        self._slot_freed.set()

    def install_signal_handlers(self) -> None:
        """Stop gracefully on SIGTERM and SIGINT (call from inside the running loop)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    @property
    def in_flight(self) -> int:
        return len(self._running)

    # --------------------------------------------------------------- lifecycle

    async def check_schema(self) -> None:
        """Fail fast when the schema is missing or older than this Conveyor."""
        conn = await self._upkeep_conn.get()
        applied = await AsyncMigrator(self.config.schema).applied_versions(conn)
        if not applied:
            raise MigrationError(
                f"schema {self.config.schema!r} is not migrated; run 'conveyor migrate' first")
        if max(applied) > latest_version():
            raise MigrationError(
                f"schema {self.config.schema!r} is at migration {max(applied)}, newer than this "
                f"Conveyor knows ({latest_version()}); upgrade Conveyor")
        if max(applied) < latest_version():
            raise MigrationError(
                f"schema {self.config.schema!r} is at migration {max(applied)}, this Conveyor "
                f"needs {latest_version()}; run 'conveyor migrate'")

    async def run(self) -> None:
        """Work until :meth:`request_stop`, then shut down gracefully."""
        self._loop = asyncio.get_running_loop()
        try:
            await self.check_schema()
        except StopRequested:
            log.info("stopped before the database could be reached", extra={"action": "stopped"})
            await self._upkeep_conn.close()
            return
        except BaseException:
            await self._upkeep_conn.close()  # a supervisor retrying run() must not leak it
            raise
        self._pool = self._new_pool()
        await self._register()
        tasks = [asyncio.create_task(self._upkeep_loop(), name="conveyor-upkeep")]
        if self.listens:
            tasks.append(asyncio.create_task(self.listener.run(self._stopping),
                                             name="conveyor-listener"))
        else:
            log.info("not listening for notifications: polling every %.1fs",
                     self.config.poll_interval, extra={"action": "poll_only"})
        completer = asyncio.create_task(self.completer.run(self._closing), name="conveyor-ack")
        log.info("worker %s started: topics %s, concurrency %d", self.name,
                 ", ".join(self.router.patterns), self.config.concurrency,
                 extra={"action": "started", "worker": self.id})
        self.started.set()
        self.watchdog.start()
        try:
            await self._fetch_loop()
        finally:
            try:
                await self._shutdown(tasks, completer)
            finally:
                self.watchdog.stop()

    def _new_pool(self) -> ThreadPoolExecutor:
        # Threads start lazily; the second half is the reserve for abandoned ones.
        return ThreadPoolExecutor(max_workers=2 * self.config.concurrency,
                                  thread_name_prefix="conveyor-handler")

    async def _register(self) -> None:
        try:
            conn = await self._upkeep_conn.get()
            await conn.execute(self._q["worker_register"], self.maintenance.registration)
        except StopRequested:
            pass
        except CONNECTION_ERRORS as exc:
            # The first heartbeat registers the worker once the database is back.
            await self._upkeep_conn.discard(exc)

    async def _shutdown(self, tasks: list[asyncio.Task[Any]],
                        completer: asyncio.Task[None]) -> None:
        self._stopping.set()
        self._start_deferred()
        pending = [r.task for r in self._running.values()
                   if r.task is not None and not r.task.done()]
        if pending:
            log.info("waiting up to %.0fs for %d running handlers", self.config.shutdown_timeout,
                     len(pending), extra={"action": "draining"})
            _done, late = await asyncio.wait(pending, timeout=self.config.shutdown_timeout)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        # Whatever has no outcome yet goes back without spending an attempt,
        # whatever its task's state: a handler whose clean-up outlasts the wait
        # above is neither done nor cancelled, and must not keep its event
        # 'running' until the lease expires. Dropped from the running set, so a
        # late outcome of that task is never queued after the hand-back.
        queued = self.completer.unacknowledged()
        for key, running in list(self._running.items()):
            if key not in queued:
                del self._running[key]
                self.completer.add(Outcome.handed_back(running.event))
                self.stats.handed_back += 1
        self._closing.set()
        if self._sweeper is not None:
            self._sweeper.cancel()
        done, _ = await asyncio.wait({completer}, timeout=self.config.shutdown_timeout)
        if not done:
            log.error("could not acknowledge %d results before exit; their leases will expire",
                      self.completer.backlog, extra={"action": "ack_abandoned"})
            # Its statements run in its own task (bounded_here): close the socket
            # first, so the cancellation does not wait on the server.
            self._ack_conn.abort()
            completer.cancel()
            await asyncio.wait({completer}, timeout=1.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            conn = await asyncio.wait_for(self._upkeep_conn.get(give_up_on_stop=False), 5)
            # Short: the registry row expires on its own, the exit must not wait.
            await bounded(conn, self.maintenance.unregister(conn), 2)
        except _UNREGISTER_ERRORS:
            pass
        for managed in (self._fetch_conn, self._ack_conn, self._upkeep_conn, self._listen_conn):
            await managed.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        log.info("worker stopped", extra={"action": "stopped", "worker": self.id})

    # -------------------------------------------------------------- fetch loop

    def _notified(self, payload: str) -> None:
        # Any role may NOTIFY this channel (it needs no grant): the payload is a
        # hint, and nothing in it may do more than wake the worker early.
        topic, _, due = payload.partition("|")
        if topic != "*" and not self.router.handles(topic):
            return
        if not due:
            self.wake()
            return
        epoch = _due_epoch(due)
        if epoch is None:
            log.debug("ignored a notification with a bad due time: %r", payload[:100],
                      extra={"action": "notify_ignored"})
            return
        self._wake_at(epoch - self.clock_offset)

    def _wake_at(self, epoch: float) -> None:
        """Wake the fetch loop when a delayed event falls due (one timer, a heap of due times).

        ``epoch`` is in this machine's clock; callers convert database times first.
        """
        if not math.isfinite(epoch):
            return  # a NaN would sit at the heap's root for good, re-arming a 1 ms timer
        epoch = round(epoch, 3)
        if epoch in self._due_set:
            return
        heapq.heappush(self._due, epoch)
        self._due_set.add(epoch)
        if len(self._due) > MAX_DUE_TIMES:
            # Keep the earliest: a dropped later time only means that event waits
            # for a poll or for an earlier timer's claim.
            self._due = heapq.nsmallest(MAX_DUE_TIMES // 2, self._due)
            self._due_set = set(self._due)
        self._arm_timer()

    def _arm_timer(self) -> None:
        if not self._due or self._due[0] >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = self._due[0]
        # The extra millisecond lets the database clock pass the due time too.
        delay = max(0.0, self._timer_at - time.time()) + 0.001
        self._timer = asyncio.get_running_loop().call_later(delay, self._timer_fired)

    def _timer_fired(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        now = time.time()
        while self._due and self._due[0] <= now + 0.001:
            self._due_set.discard(heapq.heappop(self._due))
        self.wake()
        self._arm_timer()

    def _free_slots(self) -> int:
        # A slot stays taken until the result is acknowledged, so the table never
        # shows more of this worker's events running than its concurrency.
        # The pool has a spare thread per slot, so a timed-out plain handler whose
        # thread runs on delays nobody; only past that reserve do stuck threads
        # take slots (the work would otherwise queue behind them and time out).
        overflow = max(0, self._abandoned_threads - self.config.concurrency)
        return self.config.concurrency - len(self._running) - overflow

    async def _fetch_loop(self) -> None:
        c = self.config
        threshold = max(1, min(c.batch_size, c.concurrency) // 4)
        while not self._stopping.is_set():
            free = self._free_slots()
            if free < threshold:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            want = min(free, c.batch_size)
            self._wake.clear()
            claimed = await self._claim(want, defer=True)
            if claimed is None:
                continue
            if len(claimed) == want:
                continue
            await self._idle_wait()

    async def _idle_wait(self) -> None:
        poll = self.config.poll_interval * (1 - 0.1 * self._rng.random())
        # asyncio.timeout, not wait_for: no task in between, so a NOTIFY reaches
        # the next claim a few loop rounds (~40 us on an idle machine) sooner.
        try:
            async with asyncio.timeout(poll):
                await self._wake.wait()
        except TimeoutError:
            pass

    async def _claim(self, want: int, *, defer: bool = False) -> list[Event] | None:
        """Claim up to ``want`` events and start them; ``None`` after a database error."""
        try:
            conn = await self._fetch_conn.get()
            cur = self._claim_cursor.get(conn)
            # Binary results: the server skips formatting ids and timestamps as
            # text and the client skips parsing them (5 % of a 1000-row claim).
            await bounded_here(conn, cur.execute(self._q["event_claim"], {
                **self._filter, "limit": want, "owner": self.id,
                "lease_ttl": self.config.lease_ttl}), self.config.query_timeout,
                stopping=self._stopping)
            rows = await cur.fetchall()
            if len(rows) > 1:
                # The claim picks by priority but returns in join order; a stable
                # sort keeps the rest of that order (O(n) when all are equal).
                rows.sort(key=_PRIORITY, reverse=True)
        except StopRequested:
            return None
        except RECOVERABLE_ERRORS as exc:
            await self._fetch_conn.discard(exc)
            return None
        except psycopg.Error as exc:
            log.error("claiming events failed: %s", exc, extra={"action": "claim_failed"})
            await self._fetch_conn.pause_after_failure()
            return None
        from_row = Event._from_claim_row
        events = [from_row(r) for r in rows]
        self.stats.claimed += len(events)
        # The slots are taken now; the handlers start on the loop's next round,
        # after the fetch loop has sent its next claim, so the database works
        # on that claim while this batch's handlers start.
        for event in events:
            self._running[(event.id, event.attempt)] = _Running(event, None)
        # Only a full batch is followed at once by another claim; a short one
        # (the idle worker woken for one event) starts its handlers now.
        if defer and len(events) == want:
            self._deferred.append(events)
            asyncio.get_running_loop().call_soon(self._start_deferred)
        else:
            self._start_all(events)
        return events

    def _start_deferred(self) -> None:
        # Also called by _shutdown: claimed events start even when a stop came
        # in between, so they finish within the shutdown timeout like the rest.
        while self._deferred:
            self._start_all(self._deferred.pop(0))

    def _start_all(self, events: list[Event]) -> None:
        # The per-batch lookups (loop, clock, router, defaults) are made once
        # here, not once per event: this loop runs for every claimed event.
        loop = asyncio.get_running_loop()
        now = loop.time()
        running_map = self._running
        resolve = self.router.resolve
        default_timeout = self.config.handler_timeout
        execute = self._execute
        started = False
        for event in events:
            running = running_map.get((event.id, event.attempt))
            if running is None or running.task is not None:
                continue
            route = resolve(event.topic)
            if route is None:
                # The claim filter should make this impossible; give the event back untouched.
                self.completer.add(Outcome.handed_back(event))
                continue
            if not route.is_async and not route.blocking:
                # A plain handler routed blocking=False runs to completion in one
                # call that nothing can interrupt: it needs no task, coroutine or
                # deadline of its own (about 2 us less worker CPU per event).
                running.task = self._finished(loop)
                self._run_inline(route, event)
                continue
            timeout = route.timeout or default_timeout
            running.deadline = now + timeout
            coro = execute(route, event, running, timeout)
            if EAGER_TASKS:
                # Python 3.12+: the handler runs at once, up to its first real wait,
                # with itself as the current task; one that never waits costs no
                # scheduling round at all.
                running.task = asyncio.Task(coro, loop=loop,  # type: ignore[call-arg]
                                            eager_start=True)
            else:
                running.task = loop.create_task(coro)
            started = True
        if started and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = loop.create_task(self._sweep_deadlines())

    def _finished(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A completed future standing in for the task of an inline handler call."""
        done = self._inline_done
        if done is None or done.get_loop() is not loop:
            done = self._inline_done = loop.create_future()
            done.set_result(None)
        return done

    def _run_inline(self, route: Any, event: Event) -> None:
        """Call a ``blocking=False`` plain handler here and queue its outcome."""
        token = CURRENT_EVENT.set(event)
        self._inline_event = event
        try:
            route.handler(event)
        except BaseException as exc:  # noqa: BLE001 - even SystemExit: see HANDLER_EXITS
            self.completer.add(outcome_of_error(exc, event, route.backoff or self.config.backoff))
            if isinstance(exc, HANDLER_EXITS):
                _exit_refused(exc, event)
        else:
            self.completer.add(success(event))
        finally:
            self._inline_event = None
            CURRENT_EVENT.reset(token)

    async def _sweep_deadlines(self) -> None:
        """Cancel handlers past their deadline: one periodic pass instead of a timer per call."""
        loop = asyncio.get_running_loop()
        while self._running:
            await asyncio.sleep(SWEEP_INTERVAL)
            now = loop.time()
            for running in list(self._running.values()):
                task = running.task
                if now >= running.deadline and task is not None and not task.done() \
                        and not running.timed_out:
                    running.timed_out = True
                    task.cancel()

    async def _execute(self, route: Any, event: Event, running: _Running, timeout: float) -> None:
        # run_handler inlined: two coroutines fewer per event on the hot path.
        CURRENT_EVENT.set(event)   # the task's own context: nothing to reset
        try:
            if route.is_async:
                await route.handler(event)
            else:
                await call_handler(route, event, self._pool, self._thread_abandoned)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            cancelling = task.cancelling() if task is not None else 0
            if not cancelling:
                # The handler raised CancelledError itself: a failed attempt like any other.
                outcome = outcome_of_error(exc, event, route.backoff or self.config.backoff)
            elif running.timed_out and cancelling == 1:
                assert task is not None
                task.uncancel()
                outcome = failure(event, f"handler timed out after {timeout:g}s", None,
                                  route.backoff or self.config.backoff)
            else:
                # Shutdown timed out or the lease was lost; _shutdown decides what to write.
                raise
        except BaseException as exc:  # noqa: BLE001 - even SystemExit: see HANDLER_EXITS
            outcome = outcome_of_error(exc, event, route.backoff or self.config.backoff)
            if isinstance(exc, HANDLER_EXITS):
                _exit_refused(exc, event)
        else:
            outcome = success(event)
        if (event.id, event.attempt) in self._running:
            self.completer.add(outcome)

    def _blocking_event(self) -> Event | None:
        """The event whose handler holds the loop; called from the watchdog's thread."""
        if self._inline_event is not None:
            return self._inline_event
        loop = self._loop
        task = asyncio.current_task(loop) if loop is not None else None
        if task is None:
            return None
        for running in list(self._running.values()):
            if running.task is task:
                return running.event
        return None

    def _stalled(self, seconds: float) -> None:
        self.stats.loop_stalls += 1
        self.stats.loop_stall_max_s = max(self.stats.loop_stall_max_s, seconds)

    def _thread_abandoned(self, future: Future[Any]) -> None:
        """A plain handler timed out but its thread runs on: count it until it returns."""
        self._abandoned_threads += 1
        loop = asyncio.get_running_loop()

        def returned(_: Future[Any]) -> None:
            loop.call_soon_threadsafe(self._thread_returned)

        future.add_done_callback(returned)

    def _thread_returned(self) -> None:
        self._abandoned_threads -= 1
        self._slot_freed.set()

    def _acked(self, batch: list[Outcome], done: set[int]) -> None:
        s = self.stats
        running = self._running
        succeeded = EventState.SUCCEEDED
        if len(done) == len(batch) and all(o.state is succeeded for o in batch):
            # The common flush: plain successes, every one written.
            for outcome in batch:
                running.pop((outcome.event_id, outcome.attempt), None)
            s.succeeded += len(batch)
            self._slot_freed.set()
            return
        now = time.time()
        for outcome in batch:
            entry = running.pop((outcome.event_id, outcome.attempt), None)
            if outcome.event_id not in done:
                continue
            if outcome.state is EventState.PENDING and outcome.delay is not None:
                # Armed after the write, so the timer can never fire before run_at.
                self._wake_at(now + outcome.delay)
            if outcome.refund:
                continue  # snoozes and hand-backs spend no attempt and count as neither
            if outcome.error is not None and entry is not None:
                log_outcome(entry.event, outcome)
            if outcome.state is EventState.SUCCEEDED:
                s.succeeded += 1
            elif outcome.state is EventState.PENDING:
                s.retried += 1
            elif outcome.state is EventState.FAILED:
                s.failed += 1
            elif outcome.state is EventState.CANCELLED:
                s.cancelled += 1
        self._slot_freed.set()

    # ------------------------------------------------------------------ upkeep

    async def _upkeep_loop(self) -> None:
        c = self.config
        next_beat = next_rescue = time.monotonic()
        next_prune = time.monotonic() + self._rng.uniform(0, 60)
        # Checked often enough that a pin is reported within 1.25 x the threshold.
        horizon_every = min(HORIZON_CHECK_INTERVAL, (c.horizon_alert_after or 0) / 4) or None
        next_horizon = time.monotonic() + (horizon_every or 0) * self._rng.random()
        # Runs until nothing is left to acknowledge, not merely until stopping:
        # handlers still draining after SIGTERM must keep their leases.
        while not self._closing.is_set():
            now = time.monotonic()
            try:
                conn = await self._upkeep_conn.get(give_up_on_stop=False)
                bound = c.query_timeout
                if now >= next_beat:
                    lost = await bounded(conn, self.maintenance.heartbeat(conn), bound)
                    self._drop_lost(lost)
                    await bounded(conn, self._measure_clock(conn), bound)
                    next_beat = now + c.heartbeat_interval
                if now >= next_rescue:
                    requeued, parked = await bounded(conn, self.maintenance.rescue(conn), bound)
                    self.stats.rescued += requeued + parked
                    next_rescue = now + c.rescue_interval * (1 - 0.2 * self._rng.random())
                if horizon_every is not None and now >= next_horizon:
                    await bounded(conn, self.maintenance.check_horizon(conn), bound)
                    next_horizon = now + horizon_every
                if now >= next_prune:
                    # Pruning a large backlog of finished rows may take a while.
                    await bounded(conn, self.maintenance.prune(conn), max(bound, PRUNE_TIMEOUT))
                    next_prune = now + PRUNE_INTERVAL
            except RECOVERABLE_ERRORS as exc:
                await self._upkeep_conn.discard(exc)
                continue
            except psycopg.Error as exc:
                log.error("maintenance failed: %s", exc, extra={"action": "upkeep_failed"})
                await self._upkeep_conn.pause_after_failure(interruptible=False)
                continue
            sleep_for = max(0.05, min(next_beat, next_rescue,
                                      next_horizon if horizon_every else next_beat)
                            - time.monotonic())
            try:
                await asyncio.wait_for(self._closing.wait(), timeout=sleep_for)
            except TimeoutError:
                pass

    async def _send_listen_probe(self, payload: str) -> None:
        """NOTIFY ``payload`` from another session, so the listener can tell it hears."""
        conn = await self._upkeep_conn.get()
        await bounded(conn, conn.execute(self._q["event_notify"],
                                         {"channel": self._q.channel, "payload": payload}),
                      self.config.query_timeout)

    async def _measure_clock(self, conn: psycopg.AsyncConnection[Any]) -> None:
        before = time.time()
        cur = await conn.execute(self._q["clock_now"])
        row = await cur.fetchone()
        after = time.time()
        if row is None:
            return
        offset = float(row[0]) - (before + after) / 2
        if abs(offset) > CLOCK_SKEW_WARNING and abs(self.clock_offset) <= CLOCK_SKEW_WARNING:
            log.warning("this machine's clock is %.1fs off the database's; schedules follow the "
                        "database", offset, extra={"action": "clock_skew", "offset_s": offset})
        self.clock_offset = offset

    def _drop_lost(self, lost: set[tuple[int, int]]) -> None:
        """Stop work on events whose lease this worker no longer holds."""
        queued = self.completer.unacknowledged()
        for key in lost:
            running = self._running.get(key)
            if running is None or key in queued:
                continue
            self.stats.lost += 1
            log.warning("lost the lease of event %s; abandoning it", key[0],
                        extra={"action": "lease_lost", "event_id": key[0], "attempt": key[1]})
            del self._running[key]
            self._slot_freed.set()
            if running.task is not None and not running.task.done():
                running.task.cancel()

    # ----------------------------------------------------------- for tests/ops

    async def run_once(self) -> int:
        """Claim one batch, run it to completion and acknowledge it; returns the count.

        Deterministic single step for tests; needs no listener or upkeep task.
        """
        if self._pool is None:
            self._pool = self._new_pool()
        claimed = await self._claim(min(self._free_slots(), self.config.batch_size))
        if not claimed:
            return 0
        tasks = [r.task for r in self._running.values() if r.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.completer.flush()
        return len(claimed)

    async def close(self) -> None:
        """Release connections opened by :meth:`run_once`."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for managed in (self._fetch_conn, self._ack_conn, self._upkeep_conn, self._listen_conn):
            await managed.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
