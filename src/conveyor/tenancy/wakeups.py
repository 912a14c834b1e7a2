"""How a server's parked tenants are woken: their due checks, by LISTEN or by polling.

A parked tenant holds no worker and no turn's connections
(:mod:`conveyor.tenancy.turns`); what tells the server it has work again is
here. While every tenant's LISTEN fits in the budget
(:class:`~conveyor.tenancy.budget.ServerPlan`), each holds one connection that
hears its routes' NOTIFYs and runs the ``tenant_due`` check after each
(re)connect and every ``poll_interval``; otherwise the parked tenants' due
checks are polled a few at a time (:meth:`TenantWakeups.slot`) on short-lived
connections. A tenant found due joins the rotation; a database that does not
answer is checked again after a doubling delay, and says so once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
from psycopg import sql

from conveyor.db.arrays import text_array
from conveyor.db.connect_async import connect_async
from conveyor.db.named_queries import Queries
from conveyor.db.wake_gate import WakeGate
from conveyor.errors import ConveyorError
from conveyor.notify import SIGNAL_PREFIX, WAKE_ALL, parse_wake
from conveyor.tenancy.budget import RELEASE_GRACE, Rotation, wake_connections
from conveyor.tenancy.tenant import TenantState, TurnStats
from conveyor.worker.deadline import with_deadline
from conveyor.worker.wakeups import due_epoch

log = logging.getLogger(__name__)

# How often the poll loop looks for parked tenants due a check, and a LISTEN
# waiting for the turns to shrink looks again.
TICK = 0.05
# A parked tenant whose database did not answer is checked again after this
# many seconds, doubling up to RETRY_MAX: a dead server is not hammered.
RETRY_MIN = 0.5
RETRY_MAX = 10.0
WAKE_APPLICATION = "conveyor-tenant-wake"
LISTEN_APPLICATION = "conveyor-tenant-listen"


class TenantWakeups:
    """The due checks and LISTEN connections of one server's parked tenants.

    Args:
        queries: the schema's named queries.
        budget: the server's connection budget (its share for due checks is
            :func:`~conveyor.tenancy.budget.wake_connections`).
        states: the server's tenants, by name (shared with the turns).
        rotation: the tenants waiting for a turn (shared): a tenant found due joins it.
        stats: the server's record, which counts the due checks.
        changed: set whenever the turns should look again.
        stopping: set when the server stops serving.
        room: whether the turns are within their share, so a LISTEN may connect.
        poll_interval: seconds between due checks of a parked tenant.
        query_timeout: bound of every connect and statement here.
    """

    def __init__(self, queries: Queries, budget: int, *, states: dict[str, TenantState],
                 rotation: Rotation, stats: TurnStats, changed: asyncio.Event,
                 stopping: asyncio.Event, room: Callable[[], bool], poll_interval: float,
                 query_timeout: float) -> None:
        self._q = queries
        self._slots = asyncio.Semaphore(wake_connections(budget))
        self.states = states
        self.rotation = rotation
        self.stats = stats
        self._changed = changed
        self._stopping = stopping
        self._room = room
        self.poll_interval = poll_interval
        self.query_timeout = query_timeout
        self.listening = 0       # LISTEN tasks that may hold a connection
        self._tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Close every LISTEN connection and end the due checks under way."""
        await asyncio.gather(*(self.stop_listener(s) for s in self.states.values()))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _due_params(self, state: TenantState) -> dict[str, Any]:
        assert state.router is not None
        claim_filter = {**state.router.claim_filter(), "all_tenants": True, "tenants": []}
        params = {k: text_array(v) if isinstance(v, list) else v for k, v in claim_filter.items()}
        return {**params, "cron": bool(state.router.schedules)}

    async def _due(self, conn: psycopg.AsyncConnection[Any], state: TenantState) -> bool:
        async with conn.cursor() as cur:
            await with_deadline(conn, cur.execute(self._q["tenant_due"], self._due_params(state)),
                                self.query_timeout, stopping=self._stopping)
            row = await cur.fetchone()
        return bool(row and row[0])

    def _found(self, state: TenantState, due: bool) -> None:
        if state.error is not None and state.failures:
            log.info("tenant %s: its database answers again", state.tenant.name,
                     extra={"action": "tenant_reachable", "tenant": state.tenant.name})
            state.error = None
        state.failures = 0
        state.next_check = time.monotonic() + self.poll_interval
        if due and not state.running and state.tenant.name in self.states:
            self.queue(state)

    def queue(self, state: TenantState) -> None:
        """``state``'s tenant has work: into the rotation, at the back unless it waits already."""
        if state.tenant.name not in self.rotation:
            state.found_due_at = time.monotonic()
            self.rotation.add(state.tenant.name)
        self._changed.set()

    def _failed(self, state: TenantState, exc: BaseException) -> None:
        state.failures += 1
        delay = min(RETRY_MIN * 2 ** (state.failures - 1), RETRY_MAX)
        state.next_check = time.monotonic() + delay
        if state.failures == 1:
            state.error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            log.warning("tenant %s: its database did not answer the due check: %s",
                        state.tenant.name, state.error,
                        extra={"action": "tenant_unreachable", "tenant": state.tenant.name})

    async def _connect(self, state: TenantState, application: str) -> psycopg.AsyncConnection[Any]:
        async with asyncio.timeout(self.query_timeout):
            return await connect_async(state.tenant.conninfo, autocommit=True,
                                       application_name=application,
                                       connect_timeout=max(2, round(self.query_timeout)))

    async def poll_loop(self) -> None:
        """Due checks of the parked tenants that hold no LISTEN connection."""
        while not self._stopping.is_set():
            now = time.monotonic()
            for state in list(self.states.values()):
                if (state.checking or state.running or state.listener is not None
                        or state.next_check > now or state.tenant.name in self.rotation):
                    continue
                state.checking = True
                task = asyncio.create_task(self._check(state))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            try:
                async with asyncio.timeout(TICK):
                    await self._stopping.wait()
            except TimeoutError:
                pass

    async def _check(self, state: TenantState) -> None:
        try:
            async with self.slot():
                if state.running or self._stopping.is_set():
                    return
                began = time.monotonic()
                conn = await self._connect(state, WAKE_APPLICATION)
                try:
                    due = await self._due(conn, state)
                finally:
                    await conn.close()
                self.stats.checks += 1
                self.stats.longest_check = max(self.stats.longest_check,
                                               time.monotonic() - began)
            self._found(state, due)
        except (ConveyorError, psycopg.Error, OSError, TimeoutError) as exc:
            self._failed(state, exc)
        finally:
            state.checking = False

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """One of the server's wake connections, for a due check or a migration; given
        back RELEASE_GRACE after, once the server's backend has exited."""
        await self._slots.acquire()
        try:
            yield
        finally:
            asyncio.get_running_loop().call_later(RELEASE_GRACE, self._slots.release)

    def sync(self, listen: bool) -> None:
        """A LISTEN connection for every tenant when ``listen``, none otherwise."""
        for state in self.states.values():
            if listen and state.listener is None:
                state.listener = asyncio.create_task(
                    self._listen(state), name=f"conveyor-tenant-listen-{state.tenant.name}")
            elif not listen and state.listener is not None:
                state.listener.cancel()
                state.listener = None

    async def stop_listener(self, state: TenantState) -> None:
        task, state.listener = state.listener, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _listen(self, state: TenantState) -> None:
        """One parked tenant's LISTEN connection: a NOTIFY of its routes' topics queues it
        at once; while it has a turn, its worker hears them instead. A due check runs on
        the same connection after each (re)connect and every poll interval."""
        self.listening += 1
        try:
            await self._listen_until_stopped(state)
        finally:
            asyncio.get_running_loop().call_later(RELEASE_GRACE, self._listener_gone)

    def _listener_gone(self) -> None:
        self.listening -= 1
        self._changed.set()

    async def _listen_until_stopped(self, state: TenantState) -> None:
        channel = sql.SQL("LISTEN {}").format(sql.Identifier(self._q.channel))
        while not self._stopping.is_set():
            conn: psycopg.AsyncConnection[Any] | None = None
            # Just switched to listening: the turns must first shrink to their share.
            while not self._room() and not self._stopping.is_set():
                self._changed.set()
                await asyncio.sleep(TICK)
            try:
                conn = await self._connect(state, LISTEN_APPLICATION)
                await with_deadline(conn, conn.execute(channel), self.query_timeout)
                state.next_check = 0.0       # what was committed before the LISTEN
                # Held for as long as it listens, so producers wake it (db/wake_gate.py).
                gate = WakeGate(self._q)
                while not self._stopping.is_set():
                    if await with_deadline(conn, gate.hold(conn), self.query_timeout):
                        state.next_check = 0.0   # and by a producer that woke nobody
                    if not state.running and state.next_check <= time.monotonic():
                        self._found(state, await self._due(conn, state))
                    wait = gate.retry_in(max(0.01, min(self.poll_interval,
                                                       state.next_check - time.monotonic())))
                    async for notify in conn.notifies(timeout=wait):
                        self._heard(state, notify.payload)
            except (ConveyorError, psycopg.Error, OSError, TimeoutError) as exc:
                self._failed(state, exc)
            finally:
                if conn is not None:
                    await conn.close()
            try:
                async with asyncio.timeout(max(0.0, state.next_check - time.monotonic())):
                    await self._stopping.wait()
            except TimeoutError:
                pass

    def _heard(self, state: TenantState, payload: str) -> None:
        worker = state.worker
        if state.running and worker is not None and not state.ending:
            worker.due_times.notified(payload)     # as its own listener would
            if not payload.startswith(SIGNAL_PREFIX):
                state.heard_at = time.monotonic()
            return
        if payload.startswith(SIGNAL_PREFIX):
            return          # pauses, leases, controls: a turn's worker reads them at start
        topic, due = parse_wake(payload)
        assert state.router is not None
        if topic != WAKE_ALL and not state.router.handles(topic):
            return
        epoch = due_epoch(due) if due else None
        if epoch is None or epoch <= time.time():
            self.queue(state)
        else:
            state.next_check = min(state.next_check, time.monotonic() + epoch - time.time())
