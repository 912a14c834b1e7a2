"""The worker process's engine: composition and life cycle.

A worker is a few services around one set of claimed events
(:class:`~conveyor.worker.running.RunningSet`):
:class:`~conveyor.worker.claims.Claims` claims into it (the fetch loop, with
its claim windows when ``claim_window`` is set) and
:class:`~conveyor.worker.flow_claims.FlowClaims` beside it (the flow limits),
the :class:`~conveyor.worker.executor.Executor` runs the handlers, the
:class:`~conveyor.worker.completer.Completer` acknowledges the outcomes,
:class:`~conveyor.worker.maintenance.Maintenance` runs the periodic passes
(leases, rescue, pruning), the :class:`~conveyor.worker.scheduler.Scheduler`
fires cron schedules, the :class:`~conveyor.worker.listener.Listener` and
:class:`~conveyor.worker.wakeups.DueTimes` say when to claim (and pass the
``!`` signals on: worker/reactions.py). Each has a dedicated connection, so a
slow acknowledgement never delays a claim and the LISTEN connection is never
borrowed; every one reconnects on its own. The
:class:`~conveyor.worker.watchdog.LoopWatchdog` keeps the leases while a
handler blocks the loop.

Here the parts are run: they are built and wired to one another in
worker/parts.py; the optional ones are set up by their own modules (claim
windows by ``Claims``, the stall leases by ``LoopWatchdog.for_worker``). The
services run through one interface (worker/service.py), and so do those a
worker is given (``services=``). What happens before the first claim, and the
launch of what runs beside the claims, is worker/startup.py; the graceful
shutdown, worker/shutdown.py.

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
from collections.abc import Callable, Sequence
from datetime import datetime

from conveyor.config import WorkerConfig
from conveyor.errors import ConfigError
from conveyor.middleware import Middleware
from conveyor.router import Router
from conveyor.worker.connection import ConnectionGate
from conveyor.worker.parts import build_parts
from conveyor.worker.service import Service
from conveyor.worker.startup import start_details

log = logging.getLogger(__name__)


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
        services: more :class:`~conveyor.worker.service.Service` objects to run
            from the worker's start to its shutdown, beside its own (cron, the
            flow claims, maintenance): a relay's ordered streams, the metrics
            refresher. One that raises stops the worker, and ``run`` raises
            its error. Defaults to none.
        connection_gate: what admits the connections this worker opens only now and
            then (its flow claims', when a flow limit exists; its stall watchdog's,
            while the event loop is blocked) within a budget shared with other
            workers: a multi-tenant worker's per-server one. Refused, they wait
            (the flow claims) or are skipped (a stall's lease renewal). Defaults to
            none: always opened.
    """

    def __init__(self, conninfo: str, router: Router, config: WorkerConfig | None = None, *,
                 listen_conninfo: str | None = None,
                 middleware: Sequence[Middleware] = (),
                 clock: Callable[[], datetime] | None = None,
                 services: Sequence[Service] = (),
                 connection_gate: ConnectionGate | None = None) -> None:
        if not router.routes and not router.schedules:
            raise ConfigError("router has no routes: the worker would claim nothing")
        self.conninfo = conninfo
        self.router = router
        c = self.config = config or WorkerConfig()
        self.id = str(uuid.uuid4())
        self.name = c.name or f"{socket.gethostname()}:{os.getpid()}"
        parts = build_parts(conninfo, router, c, worker_id=self.id, name=self.name,
                            listen_conninfo=listen_conninfo, middleware=middleware,
                            clock=clock, services=services, connection_gate=connection_gate)
        self._q = parts.queries
        self._stopping = parts.stopping
        self.stats = parts.stats
        self.tally = parts.tally
        self.failure_log = parts.failure_log
        self.connections = parts.connections
        self.listens = parts.listens
        self.holder = parts.holder
        self.running = parts.running
        self.flow = parts.flow
        self.accounting = parts.accounting
        self.completer = parts.completer
        self.executor = parts.executor
        self.claims = parts.claims
        self.flow_claims = parts.flow_claims
        self.pauses = parts.pauses
        self.lanes = parts.lanes
        self.maintenance = parts.maintenance
        self.scheduler = parts.scheduler
        self.due_times = parts.due_times
        self.listener = parts.listener
        self.watchdog = parts.watchdog
        self.services = parts.services
        self.startup = parts.startup
        self.shutdown = parts.shutdown
        self.started = asyncio.Event()
        # The level of its start and stop lines: a multi-tenant worker's turns
        # log them once per tenant, not once per turn (conveyor.tenancy.turns).
        self.lifecycle_level = logging.INFO

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

    def request_stop(self) -> None:
        """Begin a graceful stop: claim nothing more, let running handlers finish."""
        if not self._stopping.is_set():
            log.log(self.lifecycle_level, "worker stopping", extra={"action": "stopping"})
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
        await self.startup.check_schema()

    async def run(self) -> None:
        """Work until :meth:`request_stop`, then shut down gracefully."""
        if not await self.startup.schema_checked():
            log.info("stopped before the database could be reached", extra={"action": "stopped"})
            return
        await self.startup.run()
        started = self.startup.launch(on_failure=self.request_stop)
        if not self.listens:
            log.log(self.lifecycle_level, "not listening for notifications: polling every %.1fs",
                    self.config.poll_interval, extra={"action": "poll_only"})
        log.log(self.lifecycle_level, "worker %s started: topics %s, concurrency %d%s", self.name,
                ", ".join(self.router.patterns), self.config.concurrency,
                start_details(self.router, self.pauses),
                extra={"action": "started", "worker": self.id})
        self.started.set()
        try:
            await self.claims.fetch_loop()
        finally:
            await self.shutdown.run(started)
        log.log(self.lifecycle_level, "worker stopped",
                extra={"action": "stopped", "worker": self.id})
        if started.services.failed is not None:
            raise started.services.failed

    async def run_once(self) -> int:
        """Claim one batch, run it to completion and acknowledge it; returns the count.

        Deterministic single step for tests; needs no listener or maintenance task.
        """
        await self.startup.before_run_once(self.connections.fetch)
        return len(await self.claims.run_once())

    async def close(self) -> None:
        """Release connections opened by :meth:`run_once`."""
        self.executor.close()
        await self.connections.close()
