"""A worker's start-up: what it must know before its first claim, then what runs beside it.

First the schema check, the one fatal step: a schema missing, older or newer
than this Conveyor stops the run before anything is claimed.

Then each step runs once, on the maintenance connection, before the fetch loop
sends its first claim, because each changes what that claim may take:

- register: the worker's row, so other workers see its topics (0018's lanes);
- learn the pauses: a pause committed while no worker ran holds from the
  first claim; until this succeeds the claims use the pause-aware statement;
- learn the flow limits: a limit declared by any worker holds from this
  worker's first claim on;
- bring back a ``fifo_by`` route's aside events: a key's event written since
  the others were set aside would otherwise run before them;
- make the history's partitions (0025, 0026): the acknowledgements move
  finished events into the history only once their partition exists;
- check autovacuum: a server or table without it is the environment's doing,
  and one line at start saves the hunt for why claims slow down.

None of them is fatal: with the database away a step is skipped, and the
maintenance passes catch up (the first heartbeat registers the worker, the
pause check and the lanes pass follow). :func:`start_details` says what else
decides what the worker claims, for its "started" line.

Last, :meth:`StartUp.launch` starts what runs beside the fetch loop until the
shutdown (worker/shutdown.py) ends it, as :class:`Started`: the services, the
listener, the completer and the loop watchdog.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg

from conveyor.config import WorkerConfig
from conveyor.cron import default_name
from conveyor.router import Router
from conveyor.schema.migrator import AsyncMigrator
from conveyor.vacuum_health import vacuum_warnings_async
from conveyor.worker.completer import Completer
from conveyor.worker.connection import (
    CONNECTION_ERRORS,
    RECOVERABLE_ERRORS,
    ManagedConnection,
    StopRequested,
)
from conveyor.worker.deadline import with_deadline
from conveyor.worker.flow import FlowControl, describe_limit
from conveyor.worker.lanes import Lanes
from conveyor.worker.listener import Listener
from conveyor.worker.maintenance import Maintenance
from conveyor.worker.service import Service, ServiceTasks
from conveyor.worker.wakeups import PauseState, describe_pause
from conveyor.worker.watchdog import LoopWatchdog

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Started:
    """The tasks a started worker runs beside its fetch loop, for its shutdown to end."""

    services: ServiceTasks
    listener: asyncio.Task[None] | None
    completer: asyncio.Task[None]


class StartUp:
    """The start-up of one worker: its steps on its maintenance connection ``conn``,
    then the launch of what runs beside its claims.

    ``listener`` is ``None`` for a worker that only polls. ``stopping`` stops the
    listener and ``services``; ``closing``, the completer and the maintenance loop.
    """

    def __init__(self, conn: ManagedConnection, config: WorkerConfig, router: Router, *,
                 maintenance: Maintenance, flow: FlowControl, lanes: Lanes,
                 services: Sequence[Service], listener: Listener | None, completer: Completer,
                 watchdog: LoopWatchdog, stopping: asyncio.Event,
                 closing: asyncio.Event) -> None:
        self.conn = conn
        self.config = config
        self.router = router
        self.maintenance = maintenance
        self.flow = flow
        self.lanes = lanes
        self.services = services
        self.listener = listener
        self.completer = completer
        self.watchdog = watchdog
        self.stopping = stopping
        self.closing = closing
        # Whether to check autovacuum, and to make the history's partitions: a
        # multi-tenant worker's turns check at a tenant's first turn, and make
        # the partitions once half of those made are used up, not at every turn
        # (tenancy/turns.py); a turn may be too short for a prune pass.
        self.vacuum_check = True
        self.history_days = True
        self._ready_for_batches = False

    async def check_schema(self) -> None:
        """Fail fast when the schema is missing, older or newer than this Conveyor."""
        conn = await self.conn.get()
        await AsyncMigrator(self.config.schema).require_current(conn)

    async def schema_checked(self) -> bool:
        """:meth:`check_schema` before a run: ``False`` when a stop came before the
        database could be reached. The connection is closed if the run ends here."""
        try:
            await self.check_schema()
        except StopRequested:
            await self.conn.close()
            return False
        except BaseException:
            # A supervisor retrying run() must not leak the connection.
            await self.conn.close()
            raise
        return True

    async def run(self) -> None:
        """Every step, in order."""
        # Unbounded: the first heartbeat registers the worker if the database is away now.
        await self.step(self.maintenance.lease.register, bounded=False)
        await self.step(self.maintenance.check_pauses)
        await self.learn_flow()
        if any(r.flow is not None and r.flow.fifo_by is not None for r in self.router.routes):
            # On an error the maintenance pass brings them back.
            await self.step(self.lanes.bring_back, errors=RECOVERABLE_ERRORS)
        if self.history_days:
            await self.step(self.maintenance.pruner.keep_history, errors=RECOVERABLE_ERRORS)
        if self.vacuum_check:
            await self.check_vacuum()

    def launch(self, on_failure: Callable[[], None]) -> Started:
        """Start what runs beside the fetch loop (``on_failure``: a service raised)."""
        services = ServiceTasks(on_failure=on_failure)
        # Until nothing is left to acknowledge: draining handlers keep their leases.
        services.start(self.maintenance, self.closing)
        for service in self.services:
            services.start(service, self.stopping)
        listener = None if self.listener is None else asyncio.create_task(
            self.listener.run(self.stopping), name="conveyor-listener")
        completer = asyncio.create_task(self.completer.run(self.closing), name="conveyor-ack")
        self.watchdog.start()
        return Started(services, listener, completer)

    async def before_run_once(self, fetch: ManagedConnection) -> None:
        """The steps of a worker run one batch at a time (``run_once``, for tests),
        taken before its first batch only: the flow limits, then the aside events
        brought back on ``fetch``."""
        if self._ready_for_batches:
            return
        await self.learn_flow()
        self._ready_for_batches = True
        # Unregistered, this worker may find its topics set aside by others.
        await self.lanes.bring_back(await fetch.get())

    async def step(self, step: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]], *,
                   errors: tuple[type[BaseException], ...] = CONNECTION_ERRORS,
                   bounded: bool = True) -> T | None:
        """One step on the maintenance connection (``bounded``: by the query timeout);
        ``None`` when the database is away."""
        try:
            conn = await self.conn.get()
            if not bounded:
                return await step(conn)
            return await with_deadline(conn, step(conn), self.config.query_timeout)
        except StopRequested:
            return None
        except errors as exc:
            await self.conn.discard(exc)
            return None

    async def learn_flow(self) -> None:
        """Declare this worker's flow limits and read the fleet's."""
        timeout = self.config.query_timeout

        async def learn(conn: psycopg.AsyncConnection[Any]) -> None:
            await with_deadline(conn, self.flow.declare(conn), timeout)
            await with_deadline(conn, self.flow.refresh(conn), timeout)
        await self.step(learn, bounded=False)

    async def check_vacuum(self) -> None:
        try:
            found = await self.step(lambda conn: vacuum_warnings_async(conn, self.config.schema))
        except psycopg.Error as exc:
            log.debug("vacuum check failed: %s", exc)
            return
        for warning in found or ():
            log.warning(warning.message, extra={"action": warning.action})


def start_details(router: Router, pauses: PauseState) -> str:
    """``; cron: ...; limits: ...; paused: ...``: what else decides what a worker claims."""
    details = []
    if router.schedules:
        details.append("cron: " + ", ".join(
            f"{s.name} ({s.expression} -> {s.topic})" if s.name != default_name(
                s.topic, s.expression, s.timezone) else s.name
            for s in router.schedules))
    limits = [describe_limit(route.flow) for route in router.routes if route.flow]
    if limits:
        details.append("limits: " + ", ".join(limits))
    if pauses.in_force:
        details.append("paused: " + ", ".join(describe_pause(*key) for key in pauses.in_force))
    return "".join(f"; {detail}" for detail in details)
