"""One interface for what a worker runs beside its claims (Oban's plugins, River's services).

A :class:`Service` has a ``name``, ``run(stopping)``, its loop on a
connection of its own until ``stopping`` is set, and ``run_once(conn)``, one
pass on a connection it is handed: a test drives a service through
``run_once`` against a real database, without booting a worker or waiting
out an interval or a lease. The worker runs the services it builds (the
maintenance passes, the flow claims, cron) and those it is given
(``Worker(services=[...])``: the metrics refresher, a relay's ordered
streams) the same way, through :class:`ServiceTasks`: each in a task of its
own, told to stop at the worker's shutdown, cancelled if it does not.

The maintenance services are :class:`Periodic` passes: ``due_at()`` says when
the next pass is worth running. A :class:`ServiceLoop` runs a list of them on
one dedicated connection, each when it is due, in list order; it is a
Service itself.

A loop that fails waits out one :class:`~conveyor.worker.backoff.Backoff`
(a :class:`~conveyor.retry.RetryPolicy` counted per failure in a row), as a
reconnect does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import psycopg

from conveyor.outcomes import reason_text
from conveyor.worker.connection import RECOVERABLE_ERRORS, ManagedConnection
from conveyor.worker.deadline import with_deadline

log = logging.getLogger(__name__)

# The shortest sleep between two passes of a loop (a service due "now" again).
MIN_SLEEP = 0.05


class Service(Protocol):
    """What a worker runs beside its claims, from its start to its shutdown.

    ``run(stopping)`` returns soon after ``stopping`` is set; ``run_once(conn)``
    does one pass of its work on ``conn``.
    """

    name: str

    async def run(self, stopping: asyncio.Event) -> None:
        """Work until ``stopping`` is set."""
        ...

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> object:
        """One pass on ``conn`` (what it returns, if anything, is the service's own)."""
        ...


class Periodic(Protocol):
    """A worker's periodic job, one of the passes a :class:`ServiceLoop` runs.

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
    """Runs ``passes`` on the connection ``conn``, each pass when it is due.

    A connection error drops the connection (the next pass reconnects); any
    other database error is logged as ``<name>_failed`` and the loop waits
    the connection's backoff. Either way the pass resumes with the first
    service still due, so an early service that failed delays the later ones.
    """

    def __init__(self, name: str, conn: ManagedConnection, passes: Sequence[Periodic], *,
                 query_timeout: float) -> None:
        self.name = name
        self.conn = conn
        self.services = list(passes)
        self.query_timeout = query_timeout
        self._poked = asyncio.Event()

    def poke(self) -> None:
        """End the loop's sleep now: a pass became due earlier than it said."""
        self._poked.set()

    async def _run(self, service: Periodic, conn: psycopg.AsyncConnection[Any]) -> None:
        await with_deadline(conn, service.run_once(conn), service.timeout or self.query_timeout)

    async def run(self, stopping: asyncio.Event) -> None:
        """Every pass, when due, until ``stopping`` is set."""
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
            self._poked.clear()
            await sleep_unless(stopping, sleep_for, self._poked)

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """One pass of every service, due or not, in order."""
        for service in self.services:
            await self._run(service, conn)


async def sleep_unless(stopping: asyncio.Event, seconds: float,
                       poked: asyncio.Event | None = None) -> None:
    """Sleep ``seconds``, less if ``stopping`` (or ``poked``) is set meanwhile."""
    if poked is None:
        try:
            await asyncio.wait_for(stopping.wait(), timeout=seconds)
        except TimeoutError:
            pass
        return
    waits = {asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(poked.wait())}
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


class ServiceTasks:
    """A worker's services, each in a task of its own.

    A service that raises is logged (``service_failed``) and reported through
    ``on_failure``: a worker without one of its services must not go on as if
    nothing happened; ``failed`` keeps the first such error.
    """

    def __init__(self, on_failure: Callable[[], None] | None = None) -> None:
        self._tasks: list[tuple[Service, asyncio.Task[None]]] = []
        self._on_failure = on_failure
        self.failed: BaseException | None = None

    def start(self, service: Service, stopping: asyncio.Event) -> None:
        """Run ``service`` until ``stopping`` is set."""
        task = asyncio.create_task(service.run(stopping), name=f"conveyor-{service.name}")
        task.add_done_callback(self._ended)
        self._tasks.append((service, task))

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or (exc := task.exception()) is None:
            return
        log.error("the %s service failed: %s", task.get_name().removeprefix("conveyor-"),
                  reason_text(exc), exc_info=exc, extra={"action": "service_failed"})
        if self.failed is None:
            self.failed = exc
        if self._on_failure is not None:
            self._on_failure()

    async def wait(self, service: Service, timeout: float) -> None:
        """Wait up to ``timeout`` for ``service`` to return (it was told to stop)."""
        tasks = {task for s, task in self._tasks if s is service}
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def stop(self, grace: float) -> None:
        """Give every service up to ``grace`` seconds to return, then cancel the rest."""
        tasks = {task for _, task in self._tasks}
        if not tasks:
            return
        await asyncio.wait(tasks, timeout=grace)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
