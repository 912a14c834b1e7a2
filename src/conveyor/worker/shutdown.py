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
   must not wait for it;
5. whatever became of 1-4, the loop watchdog stops, the retry timers are
   cancelled, the handler threads are let go and the failure log writes the
   lines it held back: none of them may outlive the worker.
"""

from __future__ import annotations

import asyncio
import logging

from conveyor.config import WorkerConfig
from conveyor.worker.claims import Claims
from conveyor.worker.completer import Completer
from conveyor.worker.executor import Executor
from conveyor.worker.failure_log import FailureLogLimiter
from conveyor.worker.flow_claims import FlowClaims
from conveyor.worker.maintenance import Maintenance
from conveyor.worker.sessions import WorkerConnections
from conveyor.worker.startup import Started
from conveyor.worker.wakeups import DueTimes
from conveyor.worker.watchdog import LoopWatchdog

log = logging.getLogger(__name__)

# A service told to stop (with the claims, or with the acknowledgements for the
# maintenance loop) gets this long to return once the completer is done.
SERVICE_GRACE = 1.0


class Shutdown:
    """The order of one worker's graceful shutdown (see the module docstring);
    each step is its owner's: the claims drain, the completer finishes, the
    maintenance loop leaves the registry.

    ``stopping`` stops the claims and the services; ``closing``, the
    completer and the maintenance loop.
    """

    def __init__(self, config: WorkerConfig, *, stopping: asyncio.Event, closing: asyncio.Event,
                 claims: Claims, flow_claims: FlowClaims, completer: Completer,
                 maintenance: Maintenance, connections: WorkerConnections,
                 watchdog: LoopWatchdog, due_times: DueTimes, executor: Executor,
                 failure_log: FailureLogLimiter) -> None:
        self.config = config
        self.stopping = stopping
        self.closing = closing
        self.claims = claims
        self.flow_claims = flow_claims
        self.completer = completer
        self.maintenance = maintenance
        self.connections = connections
        self.watchdog = watchdog
        self.due_times = due_times
        self.executor = executor
        self.failure_log = failure_log

    async def run(self, started: Started) -> None:
        """Every step, in order, ending the tasks ``started``."""
        try:
            await self.stop(started)
        finally:
            self.release()

    async def stop(self, started: Started) -> None:
        """Steps 1 to 4: the claims, the handlers, the outcomes, the services."""
        c = self.config
        self.stopping.set()
        await started.services.wait(self.flow_claims, timeout=c.query_timeout + 1)
        await self.claims.drain(c.shutdown_timeout)
        self.closing.set()
        await self.completer.finish(started.completer, c.shutdown_timeout)
        if started.listener is not None:
            started.listener.cancel()
            await asyncio.gather(started.listener, return_exceptions=True)
        await started.services.stop(SERVICE_GRACE)
        await self.maintenance.leave()
        await self.connections.close()

    def release(self) -> None:
        """Step 5: what must not outlive the worker, however its shutdown went."""
        self.watchdog.stop()
        self.due_times.cancel()
        self.executor.close()
        self.failure_log.flush(everything=True)
