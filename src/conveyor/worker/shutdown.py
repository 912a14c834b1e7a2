"""A worker's graceful shutdown: claim nothing more, finish or hand back, write it all.

The order is the guarantee. A stop must neither lose an outcome nor leave an
event ``running`` until its lease expires:

1. the flow claims end first (their claim in flight ends, or is cut), so every
   event they claimed is among those the drain waits for; the batches the
   fetch loop deferred start, to finish within the timeout like the rest;
2. the running handlers get ``shutdown_timeout``; those still running then are
   cancelled, and whatever has no outcome yet goes back without spending an
   attempt;
3. the completer writes the last outcomes while the maintenance loop keeps
   renewing the leases (both run until ``closing``); a completer that cannot
   finish in time is cut, and those leases expire;
4. the services stop, the last outcome counts are flushed and the worker
   leaves the registry, briefly: the registry row expires on its own, the exit
   must not wait for it.
"""

from __future__ import annotations

import asyncio
import logging

import psycopg

from conveyor.config import WorkerConfig
from conveyor.worker.claims import Claims
from conveyor.worker.classify import Outcome
from conveyor.worker.completer import Completer
from conveyor.worker.connection import RECOVERABLE_ERRORS, WorkerConnections
from conveyor.worker.deadline import with_deadline
from conveyor.worker.executor import Executor
from conveyor.worker.failure_log import FailureLogLimiter
from conveyor.worker.flow_claims import FlowClaims
from conveyor.worker.maintenance import Maintenance
from conveyor.worker.running import RunningSet
from conveyor.worker.service import ServiceTasks
from conveyor.worker.stats import WorkerStats
from conveyor.worker.wakeups import DueTimes

log = logging.getLogger(__name__)

# A service told to stop (with the claims, or with the acknowledgements for the
# maintenance loop) gets this long to return once the completer is done.
SERVICE_GRACE = 1.0
_UNREGISTER_ERRORS: tuple[type[BaseException], ...] = (*RECOVERABLE_ERRORS, psycopg.Error)


class Shutdown:
    """The steps of one worker's graceful shutdown (see the module docstring).

    ``stopping`` stops the claims and the services; ``closing``, the
    completer and the maintenance loop.
    """

    def __init__(self, config: WorkerConfig, *, stopping: asyncio.Event, closing: asyncio.Event,
                 connections: WorkerConnections, claims: Claims, flow_claims: FlowClaims,
                 running: RunningSet, completer: Completer, maintenance: Maintenance,
                 executor: Executor, due_times: DueTimes, stats: WorkerStats,
                 failure_log: FailureLogLimiter, worker_id: str) -> None:
        self.config = config
        self.stopping = stopping
        self.closing = closing
        self.connections = connections
        self.claims = claims
        self.flow_claims = flow_claims
        self.running = running
        self.completer = completer
        self.maintenance = maintenance
        self.executor = executor
        self.due_times = due_times
        self.stats = stats
        self.failure_log = failure_log
        self.worker_id = worker_id

    async def run(self, services: ServiceTasks, listener: asyncio.Task[None] | None,
                  completer: asyncio.Task[None]) -> None:
        """Every step, in order; ``completer`` is the completer's task."""
        self.stopping.set()
        await self.drain(services)
        self.closing.set()
        self.due_times.cancel()
        await self.acknowledge(completer)
        if listener is not None:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
        await self.leave(services)
        self.executor.close()
        self.failure_log.flush(everything=True)
        log.info("worker stopped", extra={"action": "stopped", "worker": self.worker_id})

    async def drain(self, services: ServiceTasks) -> None:
        """Steps 1 and 2: every claimed event finished, cancelled or handed back."""
        c = self.config
        await services.wait(self.flow_claims, timeout=c.query_timeout + 1)
        self.claims.start_deferred()
        pending = self.running.unfinished_tasks()
        if pending:
            log.info("waiting up to %.0fs for %d running handlers", c.shutdown_timeout,
                     len(pending), extra={"action": "draining"})
            _done, late = await asyncio.wait(pending, timeout=c.shutdown_timeout)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        for event in self.running.hand_back(self.completer.unacknowledged()):
            self.completer.add(Outcome.handed_back(event))
            self.stats.handed_back += 1

    async def acknowledge(self, completer: asyncio.Task[None]) -> None:
        """Step 3: wait for ``completer`` (told to close) to write the last outcomes."""
        done, _ = await asyncio.wait({completer}, timeout=self.config.shutdown_timeout)
        if done:
            return
        log.error("could not acknowledge %d results before exit; their leases will expire",
                  self.completer.backlog, extra={"action": "ack_abandoned"})
        # Its statements run in its own task (with_deadline_in_task): close the
        # socket first, so the cancellation does not wait on the server.
        self.connections.ack.abort()
        completer.cancel()
        await asyncio.wait({completer}, timeout=1.0)

    async def leave(self, services: ServiceTasks) -> None:
        """Step 4: services stopped, last counts flushed, registry row removed."""
        await services.stop(SERVICE_GRACE)
        try:
            conn = await asyncio.wait_for(
                self.connections.maintenance.get(give_up_on_stop=False), 5)
            await with_deadline(conn, self.maintenance.flush_counts(conn), 2)
            await with_deadline(conn, self.maintenance.unregister(conn), 2)
        except _UNREGISTER_ERRORS:
            pass
        await self.connections.close()
