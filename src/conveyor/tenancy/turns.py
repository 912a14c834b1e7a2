"""The tenants of one database server, served in turns within its connection budget.

A worker per tenant, always running, costs every tenant its connections
whether it has work or not: 200 tenant databases would need 800, far past a
server's ``max_connections``. So a tenant's worker runs only for a **turn**:
while the tenant has something to do, and while no other tenant waits.

* A tenant whose worker has nothing to do is **parked** when another tenant
  needs the room: its worker stops gracefully and its connections close.
  While nobody waits it stays: a server with room for every tenant runs them
  all, as if each had its own worker.
* A parked tenant is **woken** by a LISTEN connection of its own while every
  tenant's fits in the budget (:class:`~conveyor.tenancy.budget.ServerPlan`),
  else by polling its database's ``tenant_due`` query every ``poll_interval``,
  a few at a time on short-lived connections. Either way, a due check also
  runs every ``poll_interval``, so nothing depends on a NOTIFY arriving
  (a bulk insert may opt out of them).
* A woken tenant joins the :class:`~conveyor.tenancy.budget.Rotation`; it
  starts when a turn's connections are free, or when an idle turn, or a busy
  one past ``turn_length``, is ended for it (that one queues again at the
  back). So a backlog gets turns of ``turn_length`` while others wait, and
  every tenant with due work starts within ``ceil(N / S)`` turns.
* Each turn's worker is an ordinary :class:`~conveyor.worker.Worker` (fenced
  acknowledgements, leases, maintenance, graceful stop), made anew per turn:
  what a parked tenant keeps is its name, its router and its next due check.

A server that stops answering holds up only its own tenants: budgets, wake
connections and rotations are per server, and every wait on a database is
bounded by ``query_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from conveyor.db.arrays import text_array
from conveyor.db.connect_async import connect_async
from conveyor.db.named_queries import Queries
from conveyor.errors import ConveyorError
from conveyor.notify import SIGNAL_PREFIX, WAKE_ALL, parse_wake
from conveyor.router import Router
from conveyor.tenancy.budget import (
    RELEASE_GRACE,
    ConnectionLedger,
    Rotation,
    ServerPlan,
    TurnView,
    to_park,
    turn_connections,
    wake_connections,
)
from conveyor.tenancy.databases import TenantDatabase
from conveyor.worker import Worker
from conveyor.worker.connection import ConnectionGate
from conveyor.worker.deadline import with_deadline
from conveyor.worker.wakeups import due_epoch

log = logging.getLogger(__name__)

# How often the rotation looks at its turns when nothing else wakes it: an idle
# turn is noticed (and ended, if someone waits) within this.
TICK = 0.05
# A parked tenant whose database did not answer is checked again after this
# many seconds, doubling up to RETRY_MAX: a dead server is not hammered.
RETRY_MIN = 0.5
RETRY_MAX = 10.0
WAKE_APPLICATION = "conveyor-tenant-wake"
LISTEN_APPLICATION = "conveyor-tenant-listen"


@dataclass(slots=True)
class TenantState:
    """One tenant as the multi-tenant worker sees it.

    Attributes:
        tenant: the tenant and its database.
        worker: the worker of its current turn, or ``None`` while it is parked.
        error: why its last turn or due check failed, or ``None``.
        turns: how many turns it has had.
        started_at: when its last turn began (``time.monotonic()``).
        found_due_at: when it last joined the rotation with work (``time.monotonic()``).
    """

    tenant: TenantDatabase
    worker: Worker | None = None
    task: asyncio.Task[None] | None = None
    error: str | None = None
    router: Router | None = field(default=None, repr=False)
    turns: int = 0
    started_at: float = 0.0
    found_due_at: float = 0.0
    next_check: float = 0.0
    requeue: bool = field(default=False, repr=False)
    ending: bool = field(default=False, repr=False)
    ready: bool = field(default=False, repr=False)
    checking: bool = field(default=False, repr=False)
    failures: int = field(default=0, repr=False)
    listener: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        """Whether the tenant has a turn now (its worker runs)."""
        return self.task is not None and not self.task.done()

    @property
    def parked(self) -> bool:
        """Whether the tenant waits without connections (nothing to do, or no room)."""
        return not self.running


def idle_since(worker: Worker) -> float | None:
    """Since when ``worker`` has had nothing to do: started, nothing running or left to
    acknowledge, and its last claim found nothing. ``None`` while it has work."""
    stats = worker.stats
    if (not worker.started.is_set() or worker.in_flight or worker.completer.unacknowledged()
            or not stats.last_empty_claim_at or stats.last_empty_claim_at != stats.last_claim_at):
        return None
    return stats.last_empty_claim_at


@dataclass(slots=True)
class TurnStats:
    """What one server's turns and due checks have taken, since the start.

    Attributes:
        turns: turns started.
        longest_turn: seconds of the longest turn ended (its worker's start and stop in),
            and whose it was.
        longest_start: seconds of the longest start of a turn's worker (connections,
            start-up steps), as the rotation's ticks see it.
        longest_held: the longest a turn went on while a tenant waited for room: what
            the fairness bound counts per turn (a turn nobody waits for may last).
        checks: due checks of parked tenants (on short-lived connections).
        longest_check: seconds of the longest one (the connect in).
        peak_connections: the most connections the turns held at once (the ledger's).
    """

    turns: int = 0
    longest_turn: float = 0.0
    longest_turn_tenant: str = ""
    longest_start: float = 0.0
    longest_held: float = 0.0
    checks: int = 0
    longest_check: float = 0.0
    peak_connections: int = 0


class ServerTurns:
    """Serves the tenants of one server, never holding more than ``budget`` connections there.

    Args:
        server: the server, as :func:`~conveyor.tenancy.budget.server_of` names it.
        budget: connections this process may hold on it.
        queries: the schema's named queries.
        make_worker: a new worker for one turn of a tenant, its occasional connections
            admitted by the given gate.
        turn_length: seconds a busy turn lasts while other tenants wait.
        poll_interval: seconds between due checks of a parked tenant.
        query_timeout: bound of every connect and statement of the wake-ups.
    """

    def __init__(self, server: str, budget: int, queries: Queries, *,
                 make_worker: Callable[[TenantState, ConnectionGate], Worker],
                 turn_length: float,
                 poll_interval: float, query_timeout: float) -> None:
        self.server = server
        self.budget = budget
        self._q = queries
        self._make_worker = make_worker
        self.turn_length = turn_length
        self.poll_interval = poll_interval
        self.query_timeout = query_timeout
        self.states: dict[str, TenantState] = {}
        self.rotation = Rotation()
        # The due checks and migrations of this server's tenants, a few at a time.
        self.wake_slots = asyncio.Semaphore(wake_connections(budget))
        self.turn_cost = 1       # until a tenant's router says (_replan)
        self.plan = ServerPlan.plan(budget, 0, 1)
        # The turns' connections (ending turns' too, until their worker has closed them).
        self.ledger = ConnectionLedger(budget - wake_connections(budget), grace=RELEASE_GRACE)
        self.listening = 0       # LISTEN tasks that may hold a connection
        self.stats = TurnStats()
        self._waited_since: float | None = None   # since when the rotation has not been empty
        self._changed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = False

    # ------------------------------------------------------------- membership

    def add(self, state: TenantState) -> None:
        """Serve ``state``'s tenant; it gets a first turn (its backlog, its first rescue)."""
        assert state.router is not None
        self.states[state.tenant.name] = state
        self.rotation.add(state.tenant.name)
        self._replan()

    async def remove(self, name: str) -> None:
        """Stop serving ``name``: its turn ends gracefully, its LISTEN connection closes."""
        state = self.states.pop(name, None)
        self.rotation.discard(name)
        if state is None:
            return
        await self._stop_listener(state)
        if state.worker is not None:
            state.worker.request_stop()
        if state.task is not None:
            await asyncio.gather(state.task, return_exceptions=True)
        self._replan()

    def _replan(self) -> None:
        costs = [turn_connections(s.router) for s in self.states.values() if s.router is not None]
        self.turn_cost = max(costs, default=1)
        plan = ServerPlan.plan(self.budget, len(self.states), self.turn_cost)
        if plan.listen != self.plan.listen:
            log.info("server %s: %d tenants, %s", self.server, len(self.states),
                     "a LISTEN connection each" if plan.listen else
                     f"polled every {self.poll_interval:g}s (their LISTENs would not fit "
                     f"{self.budget} connections)",
                     extra={"action": "tenant_wakeups", "server": self.server})
        self.plan = plan
        self._set_limit()
        if self._running:
            self._sync_listeners()
        self._changed.set()

    # ---------------------------------------------------------------- running

    async def run(self, stopping: asyncio.Event) -> None:
        """Serve until ``stopping`` is set; then end every turn gracefully."""
        self._running = True
        self._sync_listeners()
        polls = asyncio.create_task(self._poll_loop(), name=f"conveyor-tenant-polls-{self.server}")
        try:
            while not stopping.is_set():
                try:
                    self._fill()
                except Exception:   # a bad tick must not stop every tenant of the server
                    log.exception("server %s: serving its tenants failed; trying again",
                                  self.server, extra={"action": "tenant_turns_failed"})
                    await asyncio.sleep(1.0)
                try:
                    async with asyncio.timeout(TICK):
                        await self._changed.wait()
                except TimeoutError:
                    pass
                self._changed.clear()
        finally:
            self._stopping.set()
            polls.cancel()
            await asyncio.gather(polls, return_exceptions=True)
            await self.close()

    async def close(self) -> None:
        """End every turn gracefully and close every wake-up connection."""
        self._stopping.set()
        self._running = False
        for state in self.states.values():
            if state.worker is not None:
                state.worker.request_stop()
        await asyncio.gather(*(s.task for s in self.states.values() if s.task is not None),
                             return_exceptions=True)
        await asyncio.gather(*(self._stop_listener(s) for s in self.states.values()))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _fill(self) -> None:
        """Start waiting tenants while the budget has room; make room by ending turns."""
        self._set_limit()
        later = []
        while self.rotation and self.ledger.take(self.turn_cost):
            name = self.rotation.pop()
            state = self.states.get(name)
            if state is not None and not state.running:
                self._start_turn(state, self.turn_cost)
                continue
            self.ledger.give(self.turn_cost)
            if state is not None:
                later.append(name)      # heard while its turn ends: the next one is its
        for name in later:
            self.rotation.add(name)
        turns = [s for s in self.states.values() if s.running]
        now = time.monotonic()
        for state in turns:
            if not state.ready and state.worker is not None and state.worker.started.is_set():
                state.ready = True
                self.stats.longest_start = max(self.stats.longest_start, now - state.started_at)
        # Turns past the room they have (the LISTENs were given a share of it when
        # the tenants came to fit) end like turns others wait for, so the LISTENs
        # may connect.
        excess = -(-(self.ledger.in_use - self.ledger.limit) // max(1, self.turn_cost))
        if not self.rotation and excess <= 0:
            self._waited_since = None
            return
        if self._waited_since is None:
            self._waited_since = now
        ending = sum(1 for s in turns if s.ending)
        views = [self._view(s) for s in turns]
        for name in to_park(views, now, self.turn_length,
                            len(self.rotation) + max(excess, 0) - ending):
            self._end_turn(self.states[name])
        for state in turns:
            self._nudge(state)

    def _set_limit(self) -> None:
        # LISTEN connections still closing after a switch to polling count until closed.
        self.ledger.limit = self.budget - self.plan.wake - max(self.plan.listeners,
                                                               self.listening)

    def _view(self, state: TenantState) -> TurnView:
        worker = state.worker
        idle = None if worker is None else idle_since(worker)
        return TurnView(state.tenant.name, state.started_at, idle, state.ending)

    @staticmethod
    def _nudge(state: TenantState) -> None:
        """A worker whose handlers are done sits out its poll interval before claiming
        again (no slot freed wakes it); while tenants wait, make it look now, so it
        either works on or shows itself idle."""
        worker = state.worker
        if (worker is None or state.ending or not worker.started.is_set() or worker.in_flight
                or idle_since(worker) is not None):
            return
        worker.wake()

    def _start_turn(self, state: TenantState, cost: int) -> None:
        worker = self._make_worker(state, self.ledger)
        worker.startup.vacuum_check = state.turns == 0    # one warning per tenant, not per turn
        state.worker, state.ending, state.requeue, state.ready = worker, False, False, False
        state.started_at = time.monotonic()
        state.turns += 1
        self.stats.turns += 1
        self.stats.peak_connections = max(self.stats.peak_connections, self.ledger.peak)
        state.task = asyncio.create_task(self._turn(state, worker, cost),
                                         name=f"conveyor-tenant-{state.tenant.name}")

    def _end_turn(self, state: TenantState) -> None:
        worker = state.worker
        if worker is None:
            return
        # A turn ended while its worker still had work goes to the back of the rotation.
        state.requeue = idle_since(worker) is None
        state.ending = True
        worker.request_stop()

    async def _turn(self, state: TenantState, worker: Worker, cost: int) -> None:
        name = state.tenant.name
        try:
            await worker.run()
            state.error = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one tenant's crash must not stop the others
            state.error = f"{type(exc).__name__}: {exc}"
            log.error("worker of tenant %s stopped: %s; its database is checked again in %gs",
                      name, state.error, self.poll_interval,
                      extra={"action": "tenant_worker_died", "tenant": name})
        finally:
            self.ledger.give(cost)
            took = time.monotonic() - state.started_at
            if took > self.stats.longest_turn:
                self.stats.longest_turn, self.stats.longest_turn_tenant = took, name
            if self._waited_since is not None:
                held = time.monotonic() - max(state.started_at, self._waited_since)
                self.stats.longest_held = max(self.stats.longest_held, held)
            self.stats.peak_connections = max(self.stats.peak_connections, self.ledger.peak)
            if state.worker is worker:
                state.worker = None
            state.ending = False
            state.next_check = time.monotonic() + self.poll_interval
            if state.requeue and self.states.get(name) is state and not self._stopping.is_set():
                self.rotation.add(name)
            self._changed.set()

    # ---------------------------------------------------------------- wake-ups

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
            self._queue(state)

    def _queue(self, state: TenantState) -> None:
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

    async def _poll_loop(self) -> None:
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
            async with self.wake_slot():
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
    async def wake_slot(self) -> AsyncIterator[None]:
        """One of the server's wake connections, for a due check or a migration; given
        back RELEASE_GRACE after, once the server's backend has exited."""
        await self.wake_slots.acquire()
        try:
            yield
        finally:
            asyncio.get_running_loop().call_later(RELEASE_GRACE, self.wake_slots.release)

    def _sync_listeners(self) -> None:
        for state in self.states.values():
            if self.plan.listen and state.listener is None:
                state.listener = asyncio.create_task(
                    self._listen(state), name=f"conveyor-tenant-listen-{state.tenant.name}")
            elif not self.plan.listen and state.listener is not None:
                state.listener.cancel()
                state.listener = None

    async def _stop_listener(self, state: TenantState) -> None:
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
            while self.ledger.in_use > self.ledger.limit and not self._stopping.is_set():
                self._changed.set()
                await asyncio.sleep(TICK)
            try:
                conn = await self._connect(state, LISTEN_APPLICATION)
                await with_deadline(conn, conn.execute(channel), self.query_timeout)
                state.next_check = 0.0       # what was committed before the LISTEN
                while not self._stopping.is_set():
                    if not state.running and state.next_check <= time.monotonic():
                        self._found(state, await self._due(conn, state))
                    wait = max(0.01, min(self.poll_interval,
                                         state.next_check - time.monotonic()))
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
            return
        if payload.startswith(SIGNAL_PREFIX):
            return          # pauses, leases, controls: a turn's worker reads them at start
        topic, due = parse_wake(payload)
        assert state.router is not None
        if topic != WAKE_ALL and not state.router.handles(topic):
            return
        epoch = due_epoch(due) if due else None
        if epoch is None or epoch <= time.time():
            self._queue(state)
        else:
            state.next_check = min(state.next_check, time.monotonic() + epoch - time.time())
