"""The tenants of one database server, served in turns within its connection budget.

A worker per tenant, always running, costs every tenant its connections
whether it has work or not: 200 tenant databases would need 800, far past a
server's ``max_connections``. So a tenant's worker runs only for a **turn**:
while the tenant has something to do, and while no other tenant waits.

* A tenant whose worker has nothing to do is **parked** when another tenant
  needs the room: its worker stops gracefully and its connections close.
  While nobody waits it stays: a server with room for every tenant runs them
  all, as if each had its own worker.
* A parked tenant is **woken** (:mod:`conveyor.tenancy.wakeups`) by a LISTEN
  connection of its own while every tenant's fits in the budget
  (:class:`~conveyor.tenancy.budget.ServerPlan`), else by polling its
  database's ``tenant_due`` query every ``poll_interval``, a few at a time on
  short-lived connections. Either way, a due check also runs every
  ``poll_interval``, so nothing depends on a NOTIFY arriving (a bulk insert
  may opt out of them).
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
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from conveyor.db.named_queries import Queries
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
from conveyor.tenancy.tenant import TenantState, TurnStats, carry_counters, idle_since
from conveyor.tenancy.wakeups import TenantWakeups
from conveyor.worker import Worker
from conveyor.worker.connection import ConnectionGate

log = logging.getLogger(__name__)

# How often the rotation looks at its turns when nothing else wakes it: an idle
# turn is noticed (and ended, if someone waits) within this.
TICK = 0.05


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
        self._make_worker = make_worker
        self.turn_length = turn_length
        self.poll_interval = poll_interval
        self.query_timeout = query_timeout
        self.states: dict[str, TenantState] = {}
        self.rotation = Rotation()
        self.turn_cost = 1       # until a tenant's router says (_replan)
        self.plan = ServerPlan.plan(budget, 0, 1)
        # The turns' connections (ending turns' too, until their worker has closed them).
        self.ledger = ConnectionLedger(budget - wake_connections(budget), grace=RELEASE_GRACE)
        self.stats = TurnStats()
        self._waited_since: float | None = None   # since when the rotation has not been empty
        self._changed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._running = False
        self.wakeups = TenantWakeups(
            queries, budget, states=self.states, rotation=self.rotation, stats=self.stats,
            changed=self._changed, stopping=self._stopping, room=self._turns_fit,
            poll_interval=poll_interval, query_timeout=query_timeout)

    @property
    def listening(self) -> int:
        """LISTEN connections of parked tenants that may be open (closing ones too)."""
        return self.wakeups.listening

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
        await self.wakeups.stop_listener(state)
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
            self.wakeups.sync(plan.listen)
        self._changed.set()

    # ---------------------------------------------------------------- running

    async def run(self, stopping: asyncio.Event) -> None:
        """Serve until ``stopping`` is set; then end every turn gracefully."""
        self._running = True
        self.wakeups.sync(self.plan.listen)
        polls = asyncio.create_task(self.wakeups.poll_loop(), name=f"conveyor-tenant-polls-{self.server}")
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
        await self.wakeups.close()

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

    def _turns_fit(self) -> bool:
        """Whether the turns hold no more than their share (a LISTEN waits until they do)."""
        if self.ledger.in_use <= self.ledger.limit:
            return True
        self._changed.set()
        return False

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
        # One vacuum warning, and one set of start and stop lines, per tenant, not per turn.
        worker.startup.vacuum_check = state.turns == 0
        due = state.history_due
        worker.startup.history_days = due is None or datetime.now(UTC) >= due
        worker.lifecycle_level = logging.INFO if state.turns == 0 else logging.DEBUG
        if state.last_worker is not None:
            carry_counters(worker, state.last_worker)
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
            state.last_worker = worker
            state.history_due = worker.maintenance.pruner.history_due or state.history_due
            state.ending = False
            state.next_check = time.monotonic() + self.poll_interval
            # A NOTIFY handed to this turn's worker may have come as the turn was ended,
            # too late for a claim; the LISTEN has passed it on and will not hear it
            # again: the tenant queues for another turn rather than wait a poll interval.
            if state.heard_at >= state.started_at:
                state.requeue = True
            if state.requeue and self.states.get(name) is state and not self._stopping.is_set():
                self.rotation.add(name)
            self._changed.set()
