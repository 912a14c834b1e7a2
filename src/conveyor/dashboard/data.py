"""What the dashboard reads: its connection pool, and the overview's data.

The pages read through :class:`~conveyor.admin.AsyncAdmin`, the operator API
the CLI uses; this module holds what lies under and beside it: the pool
(every statement under ``statement_timeout``), the outcome chart's series
(``event_counts``, read by no other operator), and the overview's topic
table, bounded however many topics there are. Kept apart from the pages so
what a page costs the database can be read in one place.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

import conveyor.dashboard.charts as charts
from conveyor.dashboard.config import DashboardConfig
from conveyor.db.named_queries import Queries
from conveyor.records import TopicCount

# The overview lists this many topics (those with the most open events); the
# rest are one "other" row, so a producer that makes topics from data cannot
# make the page grow without bound.
TOPICS_SHOWN = 50
OPEN_COLUMNS = ("pending", "scheduled", "running", "failed")


class Database:
    """The dashboard's pool, opened at the first request.

    A Starlette app mounted in another one gets no lifespan events of its own,
    so the pool cannot wait for a startup hook; ``close()`` lets the host (or
    the standalone server) release it.
    """

    def __init__(self, conninfo: str, config: DashboardConfig) -> None:
        self._conninfo = conninfo
        self._config = config
        self._pool: AsyncConnectionPool[Any] | None = None
        self._lock = asyncio.Lock()

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        ms = max(1, round(self._config.statement_timeout * 1000))
        await conn.execute(f"SET statement_timeout = {ms}")
        await conn.execute("SET application_name = 'conveyor-dashboard'")
        # Compiling a page's statement costs more than it saves: past
        # jit_above_cost (a few million events) the overview and the listings
        # were compiled on every request (tests/dashboard/test_sessions.py).
        await conn.execute("SET jit = off")

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if self._pool is None:
            async with self._lock:
                if self._pool is None:
                    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                        self._conninfo, min_size=1, max_size=self._config.pool_size, open=False,
                        kwargs={"autocommit": True}, configure=self._configure,
                        name="conveyor-dashboard")
                    await pool.open(wait=True, timeout=10)
                    self._pool = pool
        async with self._pool.connection() as conn:
            yield conn

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


async def outcome_chart(conn: psycopg.AsyncConnection[Any], queries: Queries,
                        span: str) -> charts.Chart:
    """The overview's chart of ``span`` (a key of ``charts.SPANS``), up to the database's now."""
    seconds, step, _ = charts.SPANS[span]
    cur = await conn.execute(queries["event_counts_series"], {"span": seconds, "step": step})
    series = await cur.fetchall()
    clock = await (await conn.execute(queries["clock_now"])).fetchone()
    return charts.build(series, span, float(clock[0]) if clock else datetime.now(UTC).timestamp())


async def topic_chart(conn: psycopg.AsyncConnection[Any], queries: Queries, pattern: str,
                      span: str) -> charts.Chart:
    """The outcome chart of the topics of ``pattern`` (checked by the caller) over ``span``."""
    seconds, step, _ = charts.SPANS[span]
    cur = await conn.execute(queries["event_counts_topic_series"],
                             {"span": seconds, "step": step, "pattern": pattern})
    series = await cur.fetchall()
    clock = await (await conn.execute(queries["clock_now"])).fetchone()
    return charts.build(series, span, float(clock[0]) if clock else datetime.now(UTC).timestamp())


# The span of the outcomes the overview's topic table shows beside the events
# (event_counts keeps eight days; a day is what the chart's longer span shows).
DONE_SPAN = 86_400


async def recent_outcomes(conn: psycopg.AsyncConnection[Any], queries: Queries,
                          limit: int) -> dict[str, dict[str, int]]:
    """Each topic's succeeded and failed outcomes of the last day, the busiest ``limit``."""
    cur = await conn.execute(queries["event_counts_topics"], {"span": DONE_SPAN, "limit": limit})
    return {topic: {"succeeded": int(s), "failed": int(f)}
            for topic, s, f in await cur.fetchall()}


def topic_table(counts: Sequence[TopicCount], shown: int,
                done: dict[str, dict[str, int]] | None = None
                ) -> tuple[list[tuple[str, dict[str, int]]], dict[str, int] | None]:
    """The overview's topic rows: the ``shown`` topics with the most open events
    (pending, scheduled, running, failed), by name, and one row totalling the
    rest (None when every topic is shown, else with ``topics``: how many).

    ``done``: each topic's outcomes of the last day (:func:`recent_outcomes`),
    put in each row as ``succeeded_24h``; a topic found only there (all its
    events finished, maybe pruned or deleted at success) gets a row too.
    A count that is a bound (``TopicCount.capped``) marks its row with
    ``<state>_capped`` (1, or on the other row how many of its topics are capped).
    """
    table: dict[str, dict[str, int]] = {}
    for count in counts:
        row = table.setdefault(count.topic, {})
        row[count.state.value] = row.get(count.state.value, 0) + count.count
        if count.capped:
            row[f"{count.state.value}_capped"] = 1
        if count.scheduled:
            row["scheduled"] = row.get("scheduled", 0) + count.scheduled
    for topic, outcomes in (done or {}).items():
        table.setdefault(topic, {})["succeeded_24h"] = outcomes["succeeded"]
    if len(table) <= shown:
        return sorted(table.items()), None

    def open_events(item: tuple[str, dict[str, int]]) -> tuple[int, str]:
        row = item[1]
        return -sum(row.get(k, 0) for k in OPEN_COLUMNS), item[0]

    ranked = heapq.nsmallest(shown, table.items(), key=open_events)
    kept = {topic for topic, _ in ranked}
    other: dict[str, int] = {"topics": len(table) - len(kept)}
    for topic, row in table.items():
        if topic not in kept:
            for key, value in row.items():
                other[key] = other.get(key, 0) + value
    return sorted(ranked), other
