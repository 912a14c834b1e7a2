"""The vacuum-horizon alert: who holds back vacuum, for how long, at what cost.

A pinned horizon is the slow death of any table queue: every finished or
claimed event leaves a dead row no vacuum may remove, and each claim walks
more of them. The worker cannot end someone else's transaction; it says who
holds it, for how long, and what it costs (``horizon_pinned``), again every
``HORIZON_REPEAT`` seconds while the pin lasts, and ``horizon_released``
when it ends.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from conveyor.db.named_queries import Queries

log = logging.getLogger(__name__)

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


class HorizonAlert:
    """Checks the horizon every quarter of ``alert_after`` (at most every 30 s).

    ``alert_after``: seconds a transaction may pin the horizon unreported;
    ``None`` turns the check off.
    """

    name = "horizon"
    timeout: float | None = None

    def __init__(self, queries: Queries, alert_after: float | None,
                 rng: random.Random | None = None) -> None:
        self._q = queries
        self._limit = alert_after
        # Checked often enough that a pin is reported within 1.25 x the threshold.
        self._every = min(HORIZON_CHECK_INTERVAL, (alert_after or 0) / 4) or None
        self._next = math.inf if self._every is None else \
            time.monotonic() + self._every * (rng or random.Random()).random()
        self.holder: HorizonHolder | None = None   # set while the alert stands
        self._first_seen: dict[str, float] = {}    # holders whose start time is hidden
        self._reported = 0.0

    def due_at(self) -> float:
        return self._next

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> None:
        now = time.monotonic()
        await self.check(conn)
        if self._every is not None:
            self._next = now + self._every

    async def check(self, conn: psycopg.AsyncConnection[Any]) -> HorizonHolder | None:
        """Alert when a transaction has pinned the vacuum horizon past the threshold."""
        limit = self._limit
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
            if self.holder is not None:
                log.info("vacuum horizon released (was held by %s for %.0fs)",
                         self.holder.who, self.holder.seconds,
                         extra={"action": "horizon_released"})
            self.holder = None
            return None
        seconds, row = oldest
        cur = await conn.execute(self._q["events_dead_rows"], {"table": self._q.live_table})
        dead = await cur.fetchone()
        holder = HorizonHolder(kind=row[0], who=row[1], seconds=float(seconds),
                               xid_age=row[3], dead_rows=dead[0] if dead else None)
        if self.holder is None or now - self._reported >= HORIZON_REPEAT:
            self._reported = now
            log.warning(
                "vacuum horizon pinned for %.0fs by %s %s: dead rows cannot be removed "
                "(%s in the events table) and claims slow down; end that transaction",
                holder.seconds, holder.kind, holder.who,
                "unknown" if holder.dead_rows is None else f"{holder.dead_rows:,}",
                extra={"action": "horizon_pinned", "holder": holder.who,
                       "seconds": round(holder.seconds), "dead_rows": holder.dead_rows})
        self.holder = holder
        return holder
