"""The maintenance services every worker runs on its maintenance connection.

One :class:`~conveyor.worker.service.ServiceLoop` runs, each when it is due
and in this order:

- :class:`~conveyor.worker.lease.Lease`: the registry row and the leases
  (the heartbeat), then :class:`~conveyor.worker.lease.DatabaseClock` and
  :class:`~conveyor.worker.counts.CountsFlush`, at the heartbeat's pace;
- :class:`PauseCheck`: re-reads whether any topic is paused, twice a second,
  the fallback for a worker that does not LISTEN (or missed the notification);
- :class:`~conveyor.worker.lanes.Lanes`: the aside lane, after the heartbeat
  (a bring-back follows this worker's registry row, so no set-aside can miss it);
- :class:`~conveyor.worker.rescuer.Rescuer`, :class:`~conveyor.worker.horizon.HorizonAlert`
  and :class:`~conveyor.worker.pruner.Pruner`;
- :class:`~conveyor.worker.dependencies.Dependencies`: waiting events whose
  dependencies finished become due (or are parked), after the rescue.

:class:`Maintenance` composes them for one worker and keeps the start-up and
shutdown steps that use the same connection (register, the listener's probe,
unregister).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import psycopg

from conveyor.config import WorkerConfig
from conveyor.db.named_queries import Queries
from conveyor.worker.connection import RECOVERABLE_ERRORS, ManagedConnection
from conveyor.worker.counts import CountsFlush
from conveyor.worker.deadline import with_deadline
from conveyor.worker.dependencies import Dependencies
from conveyor.worker.horizon import HorizonAlert, HorizonHolder
from conveyor.worker.lanes import Lanes
from conveyor.worker.lease import DatabaseClock, Lease
from conveyor.worker.pruner import PRUNE_BATCH, Pruner
from conveyor.worker.rescuer import RESCUE_BATCH, Rescuer
from conveyor.worker.running import Key, RunningSet
from conveyor.worker.service import Periodic, ServiceLoop
from conveyor.worker.stats import OutcomeTally, WorkerStats
from conveyor.worker.wakeups import PauseState

__all__ = ["PRUNE_BATCH", "RESCUE_BATCH", "HorizonHolder", "Maintenance", "PauseCheck"]

# Pauses are honoured within 1 s: a re-check every half second leaves the
# other half for the next claim. One read of a table of a few rows.
PAUSE_CHECK_INTERVAL = 0.5
_LEAVE_ERRORS: tuple[type[BaseException], ...] = (*RECOVERABLE_ERRORS, psycopg.Error)
# Each step of leaving the registry: the connect and its two statements. A
# connection cut by the services' stop (a statement cancelled mid-flight) is
# opened again to leave, and to a dead server that connect waits this long.
LEAVE_STEP_TIMEOUT = 2.0


class PauseCheck:
    """Tells ``pauses`` which pauses the table holds, every ``PAUSE_CHECK_INTERVAL``.

    A pause set that changed may have lost one, whose events come back from
    aside (``lanes``), even without the !pause notification (a poll-only
    worker, a pause deleted in SQL).
    """

    name = "pauses"
    timeout: float | None = None

    def __init__(self, queries: Queries, pauses: PauseState, lanes: Lanes | None) -> None:
        self._q = queries
        self._pauses = pauses
        self._lanes = lanes
        self._print: frozenset[tuple[str, str | None]] | None = None   # as last read
        self._next = 0.0

    def due_at(self) -> float:
        return self._next

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        now = time.monotonic()
        version = self._pauses.version
        cur = await conn.execute(self._q["pause_list"])
        rows = await cur.fetchall()
        self._pauses.read([(row[0], row[1], row[2]) for row in rows], version)
        if self._lanes is not None:
            printed = frozenset((row[0], row[1]) for row in rows)
            if self._print is not None and printed != self._print:
                self._lanes.bring_back_soon()
            self._print = printed
        self._next = now + PAUSE_CHECK_INTERVAL


class Maintenance:
    """The maintenance services of one worker, one :class:`~conveyor.worker.service.Service`.

    Args:
        conn: its own connection.
        queries: the schema's named queries.
        config: the worker's settings (lease, intervals, retention, horizon alert).
        owner: the worker's id, the lease owner of its events.
        name: the worker's label in the registry.
        topics: the worker's route patterns, for the registry.
        running: the worker's claimed events, whose leases the heartbeat renews.
        decided: (event id, attempt) of outcomes decided but not yet written:
            a lease missing for one of them is not a lost event.
        stats: the worker's counters (rescued, lost).
        pauses: told whether any pause exists, every ``PAUSE_CHECK_INTERVAL``.
            Defaults to None (no re-check).
        tally: the outcomes the worker has written, added to ``event_counts``
            at each heartbeat. Defaults to None (nothing counted).
        lanes: moves the events no live worker claims to the aside lane and
            back (0018), after the heartbeat of each pass it is due in.
            Defaults to None (no lanes kept).
    """

    name = "maintenance"

    def __init__(self, conn: ManagedConnection, queries: Queries, config: WorkerConfig,
                 owner: str, name: str, topics: list[str], running: RunningSet,
                 decided: Callable[[], set[Key]], stats: WorkerStats, *,
                 pauses: PauseState | None = None, tally: OutcomeTally | None = None,
                 lanes: Lanes | None = None) -> None:
        self.conn = conn
        self._q = queries
        self._config = config
        self.lanes = lanes
        self.lease = Lease(queries, config, owner, name, topics, running, decided, stats)
        self.clock = DatabaseClock(queries, config.heartbeat_interval)
        self.counts = CountsFlush(queries, tally, config.heartbeat_interval)
        self.pause_check = PauseCheck(queries, pauses, lanes) if pauses is not None else None
        self.rescuer = Rescuer(queries, config.rescue_interval, stats,
                               windows=config.claim_window > 0)
        self.horizon_alert = HorizonAlert(queries, config.horizon_alert_after)
        self.pruner = Pruner(queries, config)
        self.dependencies = Dependencies(queries)
        services: list[Periodic] = [self.lease, self.clock, self.counts]
        if self.pause_check is not None:
            services.append(self.pause_check)
        if lanes is not None:
            services.append(lanes)
        services += [self.rescuer, self.dependencies, self.horizon_alert, self.pruner]
        self.loop = ServiceLoop("maintenance", conn, services, query_timeout=config.query_timeout)

    @property
    def clock_offset(self) -> float:
        """The database clock minus this machine's, as last measured."""
        return self.clock.offset

    @property
    def wake_offset(self) -> float:
        """The smallest database clock minus this machine's the last readings allow:
        a timer set with it never fires before a due time has come in the database."""
        return self.clock.wake_offset

    @property
    def horizon(self) -> HorizonHolder | None:
        """The transaction pinning the vacuum horizon, while the alert stands."""
        return self.horizon_alert.holder

    @property
    def registration(self) -> dict[str, Any]:
        return self.lease.registration

    @property
    def tally(self) -> OutcomeTally | None:
        return self.counts.tally

    async def run(self, closing: asyncio.Event) -> None:
        """Each pass when it is due, until ``closing`` is set.

        Runs until nothing is left to acknowledge, not merely until the worker
        stops: handlers still draining after SIGTERM must keep their leases.
        """
        await self.loop.run(closing)

    async def run_once(self, conn: psycopg.AsyncConnection[Any] | None = None) -> None:
        """One pass of everything, on ``conn`` (default: the maintenance connection):
        heartbeat and clock, pauses, lanes, rescue, dependencies, horizon check, pruning."""
        await self.loop.run_once(conn or await self.conn.get(give_up_on_stop=False))

    async def register(self) -> None:
        """Add the worker to the registry; the first heartbeat does it if the database is away."""
        await self.lease.register(await self.conn.get())

    async def unregister(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await self.lease.unregister(conn)

    async def leave(self) -> None:
        """The last outcome counts flushed and the registry row removed, briefly: the
        row expires on its own, and an exit must not wait for the database."""
        try:
            conn = await asyncio.wait_for(self.conn.get(give_up_on_stop=False),
                                          LEAVE_STEP_TIMEOUT)
            await with_deadline(conn, self.flush_counts(conn), LEAVE_STEP_TIMEOUT)
            await with_deadline(conn, self.unregister(conn), LEAVE_STEP_TIMEOUT)
        except _LEAVE_ERRORS:
            pass

    def check_leases_soon(self) -> None:
        """A running event was cancelled (``!leases``): heartbeat now, to stop its handler."""
        self.lease.check_soon()
        self.loop.poke()

    def check_dependencies_soon(self) -> None:
        """Events that wait for others were written (``!deps``): settle their edges now."""
        self.dependencies.check_soon()
        self.loop.poke()

    async def send_probe(self, payload: str) -> None:
        """NOTIFY ``payload`` from this session, so the listener can tell it hears."""
        conn = await self.conn.get()
        await with_deadline(conn, conn.execute(self._q["event_notify"],
                                               {"channel": self._q.channel, "payload": payload}),
                            self._config.query_timeout)

    async def check_pauses(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Tell the pause state which pauses the table holds."""
        if self.pause_check is not None:
            await self.pause_check.run_once(conn)

    async def heartbeat(self, conn: psycopg.AsyncConnection[Any]) -> set[Key]:
        return await self.lease.heartbeat(conn)

    async def flush_counts(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await self.counts.flush(conn)

    async def rescue(self, conn: psycopg.AsyncConnection[Any]) -> tuple[int, int]:
        return await self.rescuer.rescue(conn)

    async def prune(self, conn: psycopg.AsyncConnection[Any]) -> int:
        return await self.pruner.prune(conn)

    async def check_horizon(self, conn: psycopg.AsyncConnection[Any]) -> HorizonHolder | None:
        return await self.horizon_alert.check(conn)
