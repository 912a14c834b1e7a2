"""The worker's sessions: one dedicated connection per role, each with its settings.

A worker talks to PostgreSQL over a few connections of its own (fetch,
acknowledge, maintenance, listen; cron, flow and the claim windows' only when
used), so that no role's statement waits behind another's. Each is a
:class:`~conveyor.worker.connection.ManagedConnection`; this module says which
exist and what each session sets, and why.
"""

from __future__ import annotations

import asyncio
from typing import Any

from conveyor.config import WorkerConfig
from conveyor.worker.connection import ConnectionGate, ManagedConnection, SessionMode

GENERIC = {"plan_cache_mode": "force_generic_plan"}
# No sort where an index gives the order: planned on statistics from before a
# burst (a queue usually drained, its history all finished rows), a claim of
# 100 estimates a handful of pending rows and reads and sorts the whole backlog
# instead of walking the claim index in order, on every claim until the table
# is analyzed again (tests/worker/test_claim_plan.py). A sort no index can
# replace still runs: the setting only prices it out of the choice (before
# PostgreSQL 18 by adding 10^10 to the plan's cost: see NO_JIT).
NO_SORT = {"enable_sort": "off"}
# No statement of a worker runs long enough for compiling it to pay, and one
# whose estimate passes jit_above_cost (a prune batch or a status count on a
# big table; before PostgreSQL 18 any plan with a sort priced out) was
# compiled each time it ran: 250-460 ms a fifo_by claim on a quiet machine
# (tests/worker/test_sessions.py).
NO_JIT = {"jit": "off"}
# A worker never leaves a transaction open; a session that does is cut off.
IDLE_IN_TX_TIMEOUT = "60s"
LOCK_TIMEOUT_MS = 1000
# Pruning a long backlog of finished rows may take minutes.
MAINTENANCE_STATEMENT_TIMEOUT = 300.0


class WorkerConnections:
    """The four dedicated connections of one worker (five with cron schedules), each with
    its own session settings.

    Told of a transaction pooler, or finding one on the first connect, the
    worker keeps no session state on that URL (see SessionMode).
    """

    def __init__(self, conninfo: str, config: WorkerConfig, stopping: asyncio.Event, *,
                 listen_conninfo: str | None = None, cron: bool = False,
                 gate: ConnectionGate | None = None) -> None:
        c = config
        modes = {conninfo: SessionMode(pooled=c.transaction_pooler)}

        def managed(role: str, settings: dict[str, str] | None = None,
                    target: str = conninfo, **kwargs: Any) -> ManagedConnection:
            settings = {"statement_timeout": str(int(c.query_timeout * 1000)),
                        "idle_in_transaction_session_timeout": IDLE_IN_TX_TIMEOUT,
                        **NO_JIT, **(settings or {})}
            return ManagedConnection(target, role, reconnect_min=c.reconnect_min,
                                     reconnect_max=c.reconnect_max, stopping=stopping,
                                     settings=settings, query_timeout=c.query_timeout,
                                     mode=modes.setdefault(target, SessionMode()), **kwargs)
        # Claims and acknowledgements commit asynchronously: one lost in a server
        # crash only makes its event run again, which at-least-once allows (the
        # event is still pending, or its lease expires and it is rescued). It
        # takes the WAL flush out of every claim's and every ack's round trip.
        self.fetch = managed("fetch", settings={"synchronous_commit": "off", **NO_SORT})
        # A row another transaction holds must not stall acknowledgements or
        # heartbeats: they give up waiting and step around the lock.
        # Acknowledgements are prepared at once and always run their generic plan
        # (one index probe per id): a custom plan for an array of 1000 ids picks
        # a hash join over the whole table, 10x slower, on the first executions.
        self.ack = managed("ack", settings={"synchronous_commit": "off", **GENERIC,
                                            "lock_timeout": str(LOCK_TIMEOUT_MS)},
                           prepare_threshold=0)
        self.maintenance = managed("maintenance", settings={
            "lock_timeout": str(LOCK_TIMEOUT_MS),
            "statement_timeout": str(int(max(c.query_timeout, MAINTENANCE_STATEMENT_TIMEOUT) * 1000))})
        self.listen_target = listen_conninfo or conninfo
        self.listen = managed("listen", target=self.listen_target)
        # Only for a router with cron schedules: a firing is a transaction of its
        # own, which must not interleave with the heartbeat's statements.
        self.cron = managed("cron", settings={"lock_timeout": str(LOCK_TIMEOUT_MS)}) if cron else None
        self._managed = managed
        self._gate = gate
        self.flow: ManagedConnection | None = None
        # Only with claim windows (worker/window.py): a second connection for a
        # window's transaction while the fetch connection holds another, and one
        # on which each window's record is committed.
        self.window: ManagedConnection | None = None
        self.record: ManagedConnection | None = None
        if c.claim_window:
            self.window = managed("window", settings={"synchronous_commit": "off", **NO_SORT})
            self.record = managed("record", settings={"synchronous_commit": "off"})

    def flow_connection(self) -> ManagedConnection:
        """The flow claims' connection (worker/flow.py), made when first asked for: a
        worker never opens it while no flow limit exists."""
        if self.flow is None:
            # Claims commit asynchronously, and never sort a backlog, as the
            # fetch connection's; what no index can order (a fifo claim's
            # unfinished events by key, a fair claim's turns) is sorted as before.
            self.flow = self._managed("flow", settings={"synchronous_commit": "off", **NO_SORT},
                                      gate=self._gate)
        return self.flow

    def claimers(self) -> list[ManagedConnection]:
        """The connections claim windows run on: the fetch connection, and the window
        connection when there is one."""
        return [c for c in (self.fetch, self.window) if c is not None]

    def all(self) -> tuple[ManagedConnection, ...]:
        base = (self.fetch, self.ack, self.maintenance, self.listen)
        extra = tuple(c for c in (self.cron, self.flow, self.window, self.record)
                      if c is not None)
        return (*base, *extra)

    async def close(self) -> None:
        for managed in self.all():
            await managed.close()
