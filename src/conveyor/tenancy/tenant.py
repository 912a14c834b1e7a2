"""One tenant as a server's turns see it, and what the turns have taken.

:class:`TenantState` is what a multi-tenant worker keeps of a tenant between
its turns (:mod:`conveyor.tenancy.turns`); :func:`idle_since` reads a turn's
worker to tell whether its turn may be given to another; :class:`TurnStats`
is a server's record of its turns and due checks, for logs and tests.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime

from conveyor.router import Router
from conveyor.tenancy.databases import TenantDatabase
from conveyor.worker import Worker


@dataclass(slots=True)
class TenantState:
    """One tenant as the multi-tenant worker sees it.

    Attributes:
        tenant: the tenant and its database.
        worker: the worker of its current turn, or ``None`` while it is parked.
        last_worker: the worker of its last turn that ended, whose counters the next
            turn's worker carries on from (and the metrics show while it is parked).
        error: why its last turn or due check failed, or ``None``.
        turns: how many turns it has had.
        started_at: when its last turn began (``time.monotonic()``).
        found_due_at: when it last joined the rotation with work (``time.monotonic()``).
        history_due: when a turn of it should make the history's partitions
            again (0026: half the time to the end of those made), or ``None``
            until a turn has made them: a turn may be too short for a prune pass.
    """

    tenant: TenantDatabase
    worker: Worker | None = None
    task: asyncio.Task[None] | None = None
    error: str | None = None
    router: Router | None = field(default=None, repr=False)
    turns: int = 0
    started_at: float = 0.0
    found_due_at: float = 0.0
    history_due: datetime | None = None
    next_check: float = 0.0
    requeue: bool = field(default=False, repr=False)
    ending: bool = field(default=False, repr=False)
    ready: bool = field(default=False, repr=False)
    checking: bool = field(default=False, repr=False)
    failures: int = field(default=0, repr=False)
    listener: asyncio.Task[None] | None = field(default=None, repr=False)
    heard_at: float = field(default=0.0, repr=False)    # a wake passed to its turn's worker
    last_worker: Worker | None = field(default=None, repr=False)   # its last turn's, stopped

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


def carry_counters(worker: Worker, earlier: Worker) -> None:
    """Start ``worker``'s counters where ``earlier``'s (the tenant's last turn's) ended: a
    tenant's counters run on across its turns, as a metrics scraper expects of a counter."""
    worker.stats.carry(earlier.stats)
    worker.completer.stale += earlier.completer.stale
    reconnects = {m.role: m.reconnects for m in earlier.connections.all()}
    for managed in worker.connections.all():
        managed.reconnects += reconnects.get(managed.role, 0)


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
