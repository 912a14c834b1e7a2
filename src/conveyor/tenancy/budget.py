"""How many connections a multi-tenant worker may hold on one server, and whose turn it is.

No I/O here, only the arithmetic the turns (:mod:`conveyor.tenancy.turns`)
follow, so it can be read, and tested, on its own:

* a tenant's **server** is where its database lives (host and port of its
  URL): PostgreSQL's ``max_connections`` is a server's, so the budget is one
  per server, whatever the number of databases on it;
* a **turn** is one :class:`~conveyor.worker.Worker` running for one tenant;
  it reserves :func:`turn_connections` (those its worker always holds) before
  it starts, and its worker's occasional connections are admitted one by one
  by the server's :class:`ConnectionLedger`, so the budget holds whatever the
  worker meets;
* :class:`ServerPlan` divides a server's budget: a few connections to wake
  parked tenants (the ``tenant_due`` check, migrations), one LISTEN
  connection per tenant when every tenant's fits in half the budget, and the
  rest in turns;
* :class:`Rotation` is the queue of tenants waiting for a turn, first come
  first served, and :func:`to_park` picks the turns to end for them: the
  idle ones first, then those that have had their turn's length.

The fairness bound follows: with ``S`` turns on a server, ``N`` tenants,
turns of at most ``turn_length`` (plus the worker's graceful stop), a tenant
found due waits behind at most ``N - 1`` others in the rotation, so it starts
within ``ceil(N / S)`` turn lengths; a tenant with nothing to do gives its
turn up as soon as someone waits.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from psycopg.conninfo import conninfo_to_dict

from conveyor.router import Router

# Per server: the due checks of parked tenants and their migrations, at most
# this many at once: a tenth of the budget, at least two (so a slow or dead
# database never holds all of them). Polling 200 tenants is mostly connecting,
# so the sweep's length is about tenants / wake connections connects.
WAKE_CONNECTIONS = 2
WAKE_SHARE = 10
# A turn's worker always holds three: fetch, ack, maintenance. Reserved when the
# turn starts, so a turn never waits for them once it runs.
TURN_BASE_CONNECTIONS = 3
# A closed connection's room comes back this long after the close: the server's
# backend exits a few milliseconds after the client lets go (measured: up to
# 5 ms on an idle server), and counts against max_connections until it has.
RELEASE_GRACE = 0.05
# The cron scheduler's connection, for a router with schedules: reserved too.
CRON_CONNECTIONS = 1
# The connections a worker opens only now and then (the flow claims', while a
# flow limit exists; the stall watchdog's, while the event loop is blocked) are
# not reserved: each is admitted by the server's ledger when there is room, and
# waits or is skipped when there is none. The least budget leaves room for two.
SPARE_CONNECTIONS = 2
MIN_CONNECTIONS = WAKE_CONNECTIONS + TURN_BASE_CONNECTIONS + CRON_CONNECTIONS + SPARE_CONNECTIONS


def server_of(conninfo: str) -> str:
    """The server a tenant's database lives on: ``host:port`` of its URL.

    Example::

        server_of("postgresql://app@db1:5433/acme")     # "db1:5433"

    A URL that does not parse is a server of its own (its tenant fails to
    start and says why); an unset host or port is libpq's default.
    """
    try:
        parts = conninfo_to_dict(conninfo)
    except Exception:  # noqa: BLE001 - psycopg raises several kinds for bad conninfo
        return "?"
    host = str(parts.get("hostaddr") or parts.get("host") or "")
    return f"{host}:{parts.get('port') or 5432}"


def wake_connections(budget: int) -> int:
    """The connections of a server's due checks and migrations (see WAKE_SHARE)."""
    return max(WAKE_CONNECTIONS, budget // WAKE_SHARE)


def turn_connections(router: Router) -> int:
    """The connections one turn of ``router``'s worker reserves (see TURN_BASE_CONNECTIONS)."""
    return TURN_BASE_CONNECTIONS + (CRON_CONNECTIONS if router.schedules else 0)


class ConnectionLedger:
    """The connections the turns of one server hold, against ``limit``.

    A turn takes its reserved connections at once; a worker's occasional
    connection (the flow claims', the stall watchdog's) takes one through
    :meth:`try_acquire`, the :class:`~conveyor.worker.connection.ConnectionGate`
    a turn's worker is given. The watchdog asks from its own thread while the
    event loop is blocked, hence the lock.
    """

    def __init__(self, limit: int, *, grace: float = 0.0) -> None:
        self.limit = limit
        self.peak = 0
        self._grace = grace
        self._in_use = 0
        self._returning: list[tuple[float, int]] = []   # (when, how many): given back later
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        with self._lock:
            self._settle()
            return self._in_use

    def _settle(self) -> None:
        if self._returning:
            now = time.monotonic()
            due = [n for when, n in self._returning if when <= now]
            self._returning = [(when, n) for when, n in self._returning if when > now]
            self._in_use -= sum(due)

    def take(self, n: int) -> bool:
        """Take ``n`` connections if they fit within the limit."""
        with self._lock:
            self._settle()
            if self._in_use + n > self.limit:
                return False
            self._in_use += n
            self.peak = max(self.peak, self._in_use)
            return True

    def give(self, n: int) -> None:
        """Give ``n`` connections back, ``grace`` seconds from now: a client's close
        returns at once, but the server's backend takes a few milliseconds more to
        exit, and until then it still counts against ``max_connections``."""
        with self._lock:
            if self._grace > 0:
                self._returning.append((time.monotonic() + self._grace, n))
            else:
                self._in_use -= n

    def try_acquire(self) -> bool:
        return self.take(1)

    def release(self) -> None:
        self.give(1)


@dataclass(frozen=True, slots=True)
class ServerPlan:
    """How one server's budget is spent.

    Attributes:
        budget: connections this process may hold on the server.
        wake: connections of the due checks and migrations (:func:`wake_connections`).
        listen: whether every tenant there holds a LISTEN connection while it is parked
            (else parked tenants are polled).
        listeners: connections held by those LISTENs.
        turn_slots: tenants whose worker may run at once.
    """

    budget: int
    wake: int
    listen: bool
    listeners: int
    turn_slots: int

    @classmethod
    def plan(cls, budget: int, tenants: int, turn_cost: int) -> ServerPlan:
        """LISTEN for every tenant while that takes at most half of what the wake-ups leave
        and still leaves one turn; poll them otherwise. The turns take the rest."""
        wake = wake_connections(budget)
        room = budget - wake
        listen = tenants <= room // 2 and room - tenants >= turn_cost
        listeners = tenants if listen else 0
        return cls(budget, wake, listen, listeners, max(0, (room - listeners) // turn_cost))


class Rotation:
    """Tenants waiting for a turn, in the order they were found due; each at most once."""

    def __init__(self) -> None:
        self._waiting: dict[str, None] = {}   # insertion-ordered: a FIFO without duplicates

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, name: object) -> bool:
        return name in self._waiting

    def add(self, name: str) -> None:
        """Queue ``name`` at the back, unless it waits already (it keeps its place)."""
        self._waiting.setdefault(name, None)

    def discard(self, name: str) -> None:
        self._waiting.pop(name, None)

    def pop(self) -> str:
        """The tenant that has waited longest."""
        name = next(iter(self._waiting))
        del self._waiting[name]
        return name

    def names(self) -> list[str]:
        return list(self._waiting)


@dataclass(frozen=True, slots=True)
class TurnView:
    """What :func:`to_park` needs of one running turn.

    Attributes:
        name: the tenant.
        started_at: when the turn began (``time.monotonic()``).
        idle_since: since when its worker has had nothing to do, or ``None`` while it has.
        ending: whether it was asked to end already.
    """

    name: str
    started_at: float
    idle_since: float | None
    ending: bool = False


def to_park(turns: Iterable[TurnView], now: float, turn_length: float, wanted: int) -> list[str]:
    """The turns to end so that ``wanted`` waiting tenants can start: idle ones first
    (longest idle first), then busy ones past ``turn_length`` (longest first). A busy
    turn within its length is never ended: that is the turn a tenant is promised."""
    if wanted <= 0:
        return []
    open_turns = [t for t in turns if not t.ending]
    idle = sorted((t for t in open_turns if t.idle_since is not None),
                  key=lambda t: t.idle_since or 0.0)
    spent = sorted((t for t in open_turns
                    if t.idle_since is None and now - t.started_at >= turn_length),
                   key=lambda t: t.started_at)
    return [t.name for t in [*idle, *spent][:wanted]]


def wait_bound(tenants: int, turn_slots: int, turn_length: float) -> float:
    """Seconds a tenant found due waits for its turn at most, busy tenants everywhere:
    the rotation is first come first served, so at most ``tenants - 1`` turns start
    before its own, ``turn_slots`` at a time, each at most ``turn_length`` long
    (plus its worker's stop, which the caller adds)."""
    return math.ceil(max(tenants - 1, 0) / max(turn_slots, 1)) * turn_length

