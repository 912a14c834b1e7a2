"""The worker process's engine: composition and life cycle.

A worker is a few services around one set of claimed events
(:class:`~conveyor.worker.running.RunningSet`):
:class:`~conveyor.worker.claims.Claims` claims into it (the fetch and flow
loops), the :class:`~conveyor.worker.executor.Executor` runs the handlers,
the :class:`~conveyor.worker.completer.Completer` acknowledges the outcomes,
:class:`~conveyor.worker.maintenance.Maintenance` runs the periodic services (leases,
rescue, pruning; worker/service.py), the
:class:`~conveyor.worker.listener.Listener` and
:class:`~conveyor.worker.wakeups.DueTimes` say when to claim. Each service
has a dedicated connection, so a slow acknowledgement never delays a claim
and the LISTEN connection is never borrowed; every one reconnects on its own.

Example::

    worker = Worker(dsn, router, WorkerConfig(concurrency=50))
    asyncio.run(worker.run())          # until worker.request_stop()
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import psycopg

from conveyor.config import WorkerConfig
from conveyor.cron import default_name
from conveyor.db.arrays import text_array
from conveyor.db.named_queries import queries_for
from conveyor.errors import ConfigError
from conveyor.middleware import Middleware
from conveyor.router import Router
from conveyor.schema.migrator import AsyncMigrator
from conveyor.vacuum_health import vacuum_warnings_async
from conveyor.worker.accounting import OutcomeAccounting
from conveyor.worker.claims import Claims
from conveyor.worker.classify import Outcome
from conveyor.worker.completer import Completer
from conveyor.worker.connection import (
    CONNECTION_ERRORS,
    RECOVERABLE_ERRORS,
    StopRequested,
    WorkerConnections,
)
from conveyor.worker.deadline import StopFlag, with_deadline
from conveyor.worker.executor import Executor
from conveyor.worker.failure_log import FailureLogLimiter
from conveyor.worker.flow import FlowControl, describe_limit
from conveyor.worker.lanes import Lanes
from conveyor.worker.listener import Listener
from conveyor.worker.maintenance import Maintenance
from conveyor.worker.running import RunningSet
from conveyor.worker.scheduler import Scheduler
from conveyor.worker.stats import OutcomeTally, WorkerStats
from conveyor.worker.wakeups import DueTimes, describe_pause
from conveyor.worker.watchdog import LoopWatchdog, StallLeases

log = logging.getLogger(__name__)

T = TypeVar("T")

# A loop that has not run for this long (or a quarter of the lease, if less) is
# reported: every handler and the heartbeat wait on it.
LOOP_STALL_WARNING = 1.0
_UNREGISTER_ERRORS: tuple[type[BaseException], ...] = (*RECOVERABLE_ERRORS, psycopg.Error)


class Worker:
    """Runs the handlers of ``router`` for events in ``config.schema``.

    Args:
        conninfo: libpq connection string or URL; the worker opens its own
            dedicated connections from it (never pooled ones).
        router: which topics this worker claims and who handles them.
        config: tuning. Defaults to ``WorkerConfig()``.
        listen_conninfo: where the LISTEN connection goes when it must bypass a
            transaction pooler (``config.transaction_pooler``); defaults to ``conninfo``.
        middleware: hooks around every handler call, in this order
            (see :mod:`conveyor.middleware`). Defaults to none.
        clock: what the cron schedules take as the current time, a callable
            returning an aware datetime: for tests that move time. Defaults
            to None, the database's clock.
    """

    def __init__(self, conninfo: str, router: Router, config: WorkerConfig | None = None, *,
                 listen_conninfo: str | None = None,
                 middleware: Sequence[Middleware] = (),
                 clock: Callable[[], datetime] | None = None) -> None:
        if not router.routes and not router.schedules:
            raise ConfigError("router has no routes: the worker would claim nothing")
        self.conninfo = conninfo
        self.router = router
        c = self.config = config or WorkerConfig()
        self.id = str(uuid.uuid4())
        self.name = c.name or f"{socket.gethostname()}:{os.getpid()}"
        self.stats = WorkerStats()
        self.tally = OutcomeTally()   # outcomes by minute and topic, for event_counts (0008)
        self.failure_log = FailureLogLimiter(c.failure_log_limit, c.failure_log_window)
        self._q = queries_for(c.schema)
        tenants = c.tenants
        claim_filter = {**router.claim_filter(), "all_tenants": tenants is None,
                        "tenants": list(tenants or ())}
        # Array parameters as literals, rendered once: psycopg would adapt each
        # list element by element on every claim.
        self._filter = {k: text_array(v) if isinstance(v, list) else v
                        for k, v in claim_filter.items()}
        self._stopping = StopFlag()
        self._closing = asyncio.Event()   # set once nothing more will be acknowledged
        self.connections = WorkerConnections(conninfo, c, self._stopping,
                                             listen_conninfo=listen_conninfo,
                                             cron=bool(router.schedules))
        self.listens = c.listen and not (c.transaction_pooler is True
                                         and self.connections.listen_target == conninfo)
        self.running = RunningSet(c.concurrency)
        self.flow = FlowControl(self._q, router)
        self.accounting = OutcomeAccounting(
            self.running, self.stats, self.tally, self.failure_log,
            clock_offset=lambda: self.maintenance.clock_offset,
            wake_at=lambda when: self.due_times.wake_at(when), room_freed=self.flow.room_freed)
        self.completer = Completer(self.connections.ack, self._q, self.id,
                                   flush_size=c.batch_size, interval=c.ack_interval,
                                   query_timeout=c.query_timeout,
                                   on_acked=self.accounting.settled,
                                   delete_succeeded=c.retention == 0)
        self.executor = Executor(router, self.running, self.completer.add,
                                 handler_timeout=c.handler_timeout, backoff=c.backoff,
                                 threads=2 * c.concurrency, middleware=middleware)
        self.claims = Claims(self.connections, self._q, c, self.id, self.flow, self._filter,
                             running=self.running, executor=self.executor,
                             completer=self.completer, stats=self.stats, stopping=self._stopping)
        self.pauses = self.claims.pauses
        self.lanes = Lanes(self._q, self._filter, heartbeat_interval=c.heartbeat_interval,
                           on_back=self.wake)
        self.maintenance = Maintenance(self.connections.maintenance, self._q, c, self.id,
                                       self.name, router.patterns, self.running,
                                       self.completer.unacknowledged, self.stats,
                                       pauses=self.pauses, tally=self.tally, lanes=self.lanes)
        self.due_times = DueTimes(self.wake, router.handles,
                                  lambda: self.maintenance.clock_offset,
                                  on_pause=self._pauses_changed)
        self.listener = Listener(self.connections.listen, self._q.channel,
                                 on_notify=self.due_times.notified, on_connected=self.wake,
                                 ping_interval=c.listener_ping_interval,
                                 send_probe=self.maintenance.send_probe)
        self.watchdog = LoopWatchdog(identify=self.executor.blocking_event,
                                     warn_after=min(LOOP_STALL_WARNING, c.lease_ttl / 4),
                                     lease_ttl=c.lease_ttl, on_stall=self._stalled,
                                     leases=StallLeases(conninfo, self._q, self.id,
                                                        lease_ttl=c.lease_ttl,
                                                        query_timeout=c.query_timeout,
                                                        held=self.executor.held_during_stall),
                                     renew_every=c.heartbeat_interval)
        self.scheduler: Scheduler | None = None
        if self.connections.cron is not None:
            self.scheduler = Scheduler(self.connections.cron, self._q, router.schedules,
                                       query_timeout=c.query_timeout, clock=clock,
                                       clock_offset=lambda: self.maintenance.clock_offset)
        self._flow_task: asyncio.Task[None] | None = None
        self._flow_learned = False
        self.started = asyncio.Event()

    @property
    def clock_offset(self) -> float:
        """The database clock minus this machine's, as last measured."""
        return self.maintenance.clock_offset

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested (a graceful shutdown is under way or done)."""
        return self._stopping.is_set()

    @property
    def in_flight(self) -> int:
        return len(self.running)

    def wake(self) -> None:
        """Ask the fetch loop to claim now (a NOTIFY arrived, or a slot freed)."""
        self.claims.wake()

    def _pauses_changed(self) -> None:
        self.pauses.notified()
        self.lanes.bring_back_soon()   # a resume: the aside events come back

    def request_stop(self) -> None:
        """Begin a graceful stop: claim nothing more, let running handlers finish."""
        if not self._stopping.is_set():
            log.info("worker stopping", extra={"action": "stopping"})
        self._stopping.set()
        self.claims.woken.set()
        self.running.freed.set()

    def install_signal_handlers(self) -> None:
        """Stop gracefully on SIGTERM and SIGINT (call from inside the running loop)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def check_schema(self) -> None:
        """Fail fast when the schema is missing, older or newer than this Conveyor."""
        conn = await self.connections.maintenance.get()
        await AsyncMigrator(self.config.schema).require_current(conn)

    async def run(self) -> None:
        """Work until :meth:`request_stop`, then shut down gracefully."""
        try:
            await self.check_schema()
        except StopRequested:
            log.info("stopped before the database could be reached", extra={"action": "stopped"})
            await self.connections.maintenance.close()
            return
        except BaseException:
            # A supervisor retrying run() must not leak the connection.
            await self.connections.maintenance.close()
            raise
        # The first heartbeat registers the worker if the database is away now.
        await self._at_start(self.maintenance.lease.register, bounded=False)
        await self._learn_pauses()
        await self._learn_flow()
        await self._bring_back_keys()
        await self._check_vacuum()
        tasks = [asyncio.create_task(self.maintenance.run(self._closing),
                                     name="conveyor-maintenance")]
        if self.listens:
            tasks.append(asyncio.create_task(self.listener.run(self._stopping),
                                             name="conveyor-listener"))
        else:
            log.info("not listening for notifications: polling every %.1fs",
                     self.config.poll_interval, extra={"action": "poll_only"})
        if self.scheduler is not None:
            tasks.append(asyncio.create_task(self.scheduler.run(self._stopping),
                                             name="conveyor-cron"))
        self._flow_task = asyncio.create_task(self.claims.flow_loop(), name="conveyor-flow")
        tasks.append(self._flow_task)
        completer = asyncio.create_task(self.completer.run(self._closing), name="conveyor-ack")
        log.info("worker %s started: topics %s, concurrency %d%s", self.name,
                 ", ".join(self.router.patterns), self.config.concurrency, self._start_details(),
                 extra={"action": "started", "worker": self.id})
        self.started.set()
        self.watchdog.start()
        try:
            await self.claims.fetch_loop()
        finally:
            try:
                await self._shutdown(tasks, completer)
            finally:
                self.watchdog.stop()

    def _start_details(self) -> str:
        """``; cron: ...; limits: ...; paused: ...``: what else decides what this worker claims."""
        details = []
        if self.router.schedules:
            details.append("cron: " + ", ".join(
                f"{s.name} ({s.expression} -> {s.topic})" if s.name != default_name(
                    s.topic, s.expression, s.timezone) else s.name
                for s in self.router.schedules))
        limits = [describe_limit(route.flow) for route in self.router.routes if route.flow]
        if limits:
            details.append("limits: " + ", ".join(limits))
        if self.pauses.in_force:
            details.append("paused: " + ", ".join(describe_pause(*key)
                                                  for key in self.pauses.in_force))
        return "".join(f"; {detail}" for detail in details)

    async def _at_start(self, step: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], *,
                        errors: tuple[type[BaseException], ...] = CONNECTION_ERRORS,
                        bounded: bool = True) -> T | None:
        """One start-up step on the maintenance connection (``bounded``: by the query
        timeout); ``None`` when the database is away (the maintenance passes catch up)."""
        try:
            conn = await self.connections.maintenance.get()
            if not bounded:
                return await step(conn)
            return await with_deadline(conn, step(conn), self.config.query_timeout)
        except StopRequested:
            return None
        except errors as exc:
            await self.connections.maintenance.discard(exc)
            return None

    async def _learn_pauses(self) -> None:
        # Before the first claim, so a pause committed while no worker ran
        # holds from the start; until this succeeds the worker claims with
        # the pause-aware statement (PauseState starts so).
        await self._at_start(self.maintenance.check_pauses)

    async def _learn_flow(self) -> None:
        # Before the first claim, as the pauses: a limit declared by any worker
        # holds from this worker's first claim on.
        async def learn(conn: psycopg.AsyncConnection[Any]) -> None:
            await with_deadline(conn, self.flow.declare(conn), self.config.query_timeout)
            await with_deadline(conn, self.flow.refresh(conn), self.config.query_timeout)
        await self._at_start(learn, bounded=False)

    async def _bring_back_keys(self) -> None:
        # A fifo_by route's aside events come back before the first claim, not
        # in the first maintenance pass beside it: a key's event written since
        # the others were set aside would otherwise run before them.
        if any(r.flow is not None and r.flow.fifo_by is not None for r in self.router.routes):
            # On an error the maintenance pass brings them back.
            await self._at_start(self.lanes.bring_back, errors=RECOVERABLE_ERRORS)

    async def _check_vacuum(self) -> None:
        # Once at start: a server or table without autovacuum is the
        # environment's doing, and one line saves the hunt for why claims slow.
        try:
            found = await self._at_start(
                lambda conn: vacuum_warnings_async(conn, self.config.schema))
        except psycopg.Error as exc:
            log.debug("vacuum check failed: %s", exc)
            return
        for warning in found or ():
            log.warning(warning.message, extra={"action": warning.action})

    async def _shutdown(self, tasks: list[asyncio.Task[Any]],
                        completer: asyncio.Task[None]) -> None:
        self._stopping.set()
        if self._flow_task is not None:
            # Its claim in flight ends (or is cut) first, so every event it
            # claimed is among those the drain below waits for.
            await asyncio.wait({self._flow_task}, timeout=self.config.query_timeout + 1)
        self.claims.start_deferred()
        pending = self.running.unfinished_tasks()
        if pending:
            log.info("waiting up to %.0fs for %d running handlers", self.config.shutdown_timeout,
                     len(pending), extra={"action": "draining"})
            _done, late = await asyncio.wait(pending, timeout=self.config.shutdown_timeout)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        # Whatever has no outcome yet goes back without spending an attempt.
        for event in self.running.hand_back(self.completer.unacknowledged()):
            self.completer.add(Outcome.handed_back(event))
            self.stats.handed_back += 1
        self._closing.set()
        self.due_times.cancel()
        done, _ = await asyncio.wait({completer}, timeout=self.config.shutdown_timeout)
        if not done:
            log.error("could not acknowledge %d results before exit; their leases will expire",
                      self.completer.backlog, extra={"action": "ack_abandoned"})
            # Its statements run in its own task (with_deadline_in_task): close the
            # socket first, so the cancellation does not wait on the server.
            self.connections.ack.abort()
            completer.cancel()
            await asyncio.wait({completer}, timeout=1.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            conn = await asyncio.wait_for(
                self.connections.maintenance.get(give_up_on_stop=False), 5)
            # Short: the registry row expires on its own, the exit must not wait.
            # The last outcomes' counts first (the dashboard's charts), as briefly.
            await with_deadline(conn, self.maintenance.flush_counts(conn), 2)
            await with_deadline(conn, self.maintenance.unregister(conn), 2)
        except _UNREGISTER_ERRORS:
            pass
        await self.connections.close()
        self.executor.close()
        self.failure_log.flush(everything=True)
        log.info("worker stopped", extra={"action": "stopped", "worker": self.id})

    def _stalled(self, seconds: float) -> None:
        self.stats.loop_stalls += 1
        self.stats.loop_stall_max_s = max(self.stats.loop_stall_max_s, seconds)

    async def run_once(self) -> int:
        """Claim one batch, run it to completion and acknowledge it; returns the count.

        Deterministic single step for tests; needs no listener or maintenance task.
        """
        if not self._flow_learned:
            await self._learn_flow()
            self._flow_learned = True
            # Unregistered, this worker may find its topics set aside by others.
            await self.lanes.bring_back(await self.connections.fetch.get())
        claimed = await self.claims.run_once()
        if not claimed:
            return 0
        await asyncio.gather(*self.running.tasks(), return_exceptions=True)
        await self.completer.flush()
        return len(claimed)

    async def close(self) -> None:
        """Release connections opened by :meth:`run_once`."""
        self.executor.close()
        await self.connections.close()
