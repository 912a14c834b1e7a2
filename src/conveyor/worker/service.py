"""One interface for a worker's periodic jobs (Oban's plugins, River's services).

A :class:`Service` does one pass with ``run_once(conn)`` and says with
``due_at()`` when its next pass is worth running. A :class:`ServiceLoop` runs
a list of them on one dedicated connection, each when it is due, in list
order, until it is told to stop; its ``run_once()`` runs every pass once, so a
test drives a service through ``Service.run_once`` against a real database
without booting a worker or waiting out an interval. The maintenance
services (worker/maintenance.py) share the maintenance connection that way.

A loop that fails waits out its connection's
:class:`~conveyor.worker.connection.Backoff` (a
:class:`~conveyor.retry.RetryPolicy` counted per failure), as a reconnect does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import psycopg

from conveyor.worker.connection import RECOVERABLE_ERRORS, ManagedConnection
from conveyor.worker.deadline import with_deadline

log = logging.getLogger(__name__)

# The shortest sleep between two passes of a loop (a service due "now" again).
MIN_SLEEP = 0.05


class Service(Protocol):
    """A worker's periodic job.

    ``timeout`` bounds one pass in seconds (``None``: the loop's query timeout).
    """

    name: str
    timeout: float | None

    def due_at(self) -> float:
        """When the next pass is worth running (time.monotonic())."""
        ...

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """One pass on ``conn``; schedules the next."""
        ...


class ServiceLoop:
    """Runs ``services`` on the connection ``conn``, each pass when it is due.

    A connection error drops the connection (the next pass reconnects); any
    other database error is logged as ``<name>_failed`` and the loop waits
    the connection's backoff. Either way the pass resumes with the first
    service still due, so an early service that failed delays the later ones.
    """

    def __init__(self, name: str, conn: ManagedConnection, services: Sequence[Service], *,
                 query_timeout: float) -> None:
        self.name = name
        self.conn = conn
        self.services = list(services)
        self.query_timeout = query_timeout

    async def _run(self, service: Service, conn: psycopg.AsyncConnection[Any]) -> None:
        await with_deadline(conn, service.run_once(conn), service.timeout or self.query_timeout)

    async def run(self, stopping: asyncio.Event) -> None:
        """Every service's passes, when due, until ``stopping`` is set."""
        while not stopping.is_set():
            now = time.monotonic()
            try:
                conn = await self.conn.get(give_up_on_stop=False)
                for service in self.services:
                    if now >= service.due_at():
                        await self._run(service, conn)
            except RECOVERABLE_ERRORS as exc:
                await self.conn.discard(exc)
                continue
            except psycopg.Error as exc:
                log.error("%s failed: %s", self.name, exc, extra={"action": f"{self.name}_failed"})
                await self.conn.pause_after_failure(interruptible=False)
                continue
            sleep_for = max(MIN_SLEEP, min(s.due_at() for s in self.services) - time.monotonic())
            try:
                await asyncio.wait_for(stopping.wait(), timeout=sleep_for)
            except TimeoutError:
                pass

    async def run_once(self) -> None:
        """One pass of every service, due or not, in order."""
        conn = await self.conn.get(give_up_on_stop=False)
        for service in self.services:
            await self._run(service, conn)
