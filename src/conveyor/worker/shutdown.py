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

from conveyor.config import WorkerConfig
from conveyor.worker.claims import Claims
from conveyor.worker.completer import Completer
from conveyor.worker.flow_claims import FlowClaims
from conveyor.worker.maintenance import Maintenance
from conveyor.worker.service import ServiceTasks
from conveyor.worker.sessions import WorkerConnections

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
                 maintenance: Maintenance, connections: WorkerConnections) -> None:
        self.config = config
        self.stopping = stopping
        self.closing = closing
        self.claims = claims
        self.flow_claims = flow_claims
        self.completer = completer
        self.maintenance = maintenance
        self.connections = connections

    async def run(self, services: ServiceTasks, listener: asyncio.Task[None] | None,
                  completer: asyncio.Task[None]) -> None:
        """Every step, in order; ``completer`` is the completer's task."""
        c = self.config
        self.stopping.set()
        await services.wait(self.flow_claims, timeout=c.query_timeout + 1)
        await self.claims.drain(c.shutdown_timeout)
        self.closing.set()
        await self.completer.finish(completer, c.shutdown_timeout)
        if listener is not None:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
        await services.stop(SERVICE_GRACE)
        await self.maintenance.leave()
        await self.connections.close()
