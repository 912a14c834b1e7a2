"""Periodic upkeep every worker does: heartbeat, lease renewal, rescue, pruning.

Rescue runs on every worker, so events of a dead worker come back as long as
any worker is alive; ``FOR UPDATE SKIP LOCKED`` keeps concurrent rescuers from
fighting over the same rows.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from conveyor.config import WorkerConfig
from conveyor.db.named_queries import Queries
from conveyor.types import FINISHED_STATES, EventState

log = logging.getLogger(__name__)

RESCUE_BATCH = 1000
PRUNE_BATCH = 5000
DEAD_WORKER_ROW_AGE = 3600.0
HORIZON_CHECK_INTERVAL = 30.0
HORIZON_REPEAT = 300.0     # a pin that lasts is reported again this often


@dataclass(frozen=True, slots=True)
class HorizonHolder:
    """The transaction holding back vacuum the longest, as last seen by the worker."""

    kind: str              # "session", "standby", "replication slot" or "prepared transaction"
    who: str               # "pid 123 (app, idle in transaction)", "replica1 at 10.0.0.7
                           # (walsender pid 99)", a slot's name or a prepared gid
    # How long its transaction has been open; where this role cannot read the
    # start time, how long the worker has seen it (a lower bound).
    seconds: float
    xid_age: int | None    # transactions since its snapshot
    dead_rows: int | None  # dead rows in the events table at the time


class Maintenance:
    def __init__(self, queries: Queries, config: WorkerConfig, owner: str, name: str,
                 topics: list[str], owned: Callable[[], list[tuple[int, int]]]) -> None:
        self._q = queries
        self._config = config
        self._owner = owner
        self._owned = owned
        self.horizon: HorizonHolder | None = None   # set while the alert stands
        self._first_seen: dict[str, float] = {}    # holders whose start time is hidden
        self._horizon_reported = 0.0
        self.registration = {
            "id": owner, "name": name, "host": socket.gethostname(), "pid": os.getpid(),
            "topics": topics, "concurrency": config.concurrency,
            "tenants": list(config.tenants) if config.tenants is not None else None,
        }

    async def heartbeat(self, conn: psycopg.AsyncConnection[Any]) -> set[tuple[int, int]]:
        """Refresh the registry row and this worker's leases; returns the (id, attempt) it lost."""
        await conn.execute(self._q["worker_heartbeat"], self.registration)
        owned = set(self._owned())
        if not owned:
            return set()
        cur = await conn.execute(self._q["event_extend_leases"], {
            "ids": sorted({event_id for event_id, _ in owned}), "owner": self._owner,
            "lease_ttl": self._config.lease_ttl})
        kept = {(r[0], r[1]) for r in await cur.fetchall()}
        missing = owned - kept
        if missing:
            # Skipped because locked elsewhere is not lost; look without locking.
            cur = await conn.execute(self._q["event_owned"], {
                "ids": sorted({event_id for event_id, _ in missing}), "owner": self._owner})
            missing -= {(r[0], r[1]) for r in await cur.fetchall()}
        # Pairs acknowledged while the queries ran are not lost; the caller re-checks.
        return missing

    async def unregister(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(self._q["worker_unregister"], {"id": self._owner})

    async def rescue(self, conn: psycopg.AsyncConnection[Any]) -> tuple[int, int]:
        """Return expired leases to pending (or park them); returns (requeued, parked)."""
        requeued = parked = 0
        while True:
            cur = await conn.execute(self._q["event_rescue_expired"], {"limit": RESCUE_BATCH})
            rows = await cur.fetchall()
            for event_id, state, topic in rows:
                if state == EventState.PENDING:
                    requeued += 1
                else:
                    parked += 1
                log.warning("event %s rescued from a lost worker -> %s", event_id, state,
                            extra={"action": "rescued", "event_id": event_id, "topic": topic})
            if requeued:
                await conn.execute(self._q["event_notify"],
                                   {"channel": self._q.channel, "payload": "*"})
            if len(rows) < RESCUE_BATCH:
                return requeued, parked

    async def prune(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """Delete succeeded and cancelled events older than the retention."""
        await conn.execute(self._q["worker_prune_dead"], {"older_than": DEAD_WORKER_ROW_AGE})
        if self._config.retention is None:
            return 0
        states = [s.value for s in FINISHED_STATES if s is not EventState.FAILED]
        total = 0
        while True:
            cur = await conn.execute(self._q["event_prune"], {
                "older_than": self._config.retention, "states": states, "limit": PRUNE_BATCH})
            total += cur.rowcount
            if cur.rowcount < PRUNE_BATCH:
                return total

    async def check_horizon(self, conn: psycopg.AsyncConnection[Any]) -> HorizonHolder | None:
        """Alert when a transaction has pinned the vacuum horizon past the threshold.

        A pinned horizon is the slow death of any table queue: every finished or
        claimed event leaves a dead row no vacuum may remove, and each claim
        walks more of them. The worker cannot end someone else's transaction;
        it says who holds it, for how long, and what it costs.
        """
        limit = self._config.horizon_alert_after
        if limit is None:
            return None
        cur = await conn.execute(self._q["horizon_holders"])
        rows = await cur.fetchall()
        now = time.monotonic()
        seen: dict[str, float] = {}
        oldest: tuple[float, Any] | None = None
        for row in rows:
            seconds = row[2]
            if seconds is None:
                seen[row[4]] = self._first_seen.get(row[4], now)
                seconds = now - seen[row[4]]
            if oldest is None or seconds > oldest[0]:
                oldest = (seconds, row)
        self._first_seen = seen
        if oldest is None or oldest[0] < limit:
            if self.horizon is not None:
                log.info("vacuum horizon released (was held by %s for %.0fs)",
                         self.horizon.who, self.horizon.seconds,
                         extra={"action": "horizon_released"})
            self.horizon = None
            return None
        seconds, row = oldest
        cur = await conn.execute(self._q["events_dead_rows"], {"table": self._q.events_table})
        dead = await cur.fetchone()
        holder = HorizonHolder(kind=row[0], who=row[1], seconds=float(seconds),
                               xid_age=row[3], dead_rows=dead[0] if dead else None)
        if self.horizon is None or now - self._horizon_reported >= HORIZON_REPEAT:
            self._horizon_reported = now
            log.warning(
                "vacuum horizon pinned for %.0fs by %s %s: dead rows cannot be removed "
                "(%s in the events table) and claims slow down; end that transaction",
                holder.seconds, holder.kind, holder.who,
                "unknown" if holder.dead_rows is None else f"{holder.dead_rows:,}",
                extra={"action": "horizon_pinned", "holder": holder.who,
                       "seconds": round(holder.seconds), "dead_rows": holder.dead_rows})
        self.horizon = holder
        return holder
