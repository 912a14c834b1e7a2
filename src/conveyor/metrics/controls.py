"""Gauges of what holds events back or puts them in: cron schedules, pauses, flow limits.

Read by :class:`~conveyor.metrics.DatabaseGauges` on its timer, in the same
round as the queue depths, and served from that read. Schedules and limited
patterns are declared by code, so they are few; still, past
``MetricsConfig.max_topics`` of each the rest are folded into ``_other``. The
pauses, which operators add, are exported as a count and an age only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import psycopg
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from psycopg import sql

from conveyor.db.named_queries import parse_named_queries, with_package_fragments
from conveyor.metrics.config import OTHER
from conveyor.validation import check_schema_name

_QUERIES = with_package_fragments(parse_named_queries(
    (resources.files("conveyor.metrics") / "queries.sql").read_text("utf-8")))


def metrics_query(name: str, schema: str) -> str:
    """The named query of queries.sql with ``{schema}`` bound (validated, as an identifier)."""
    return sql.SQL(_QUERIES[name]).format(
        schema=sql.Identifier(check_schema_name(schema))).as_string()


@dataclass(frozen=True, slots=True)
class CronReading:
    missed: int
    overdue_s: float
    last_fire_age_s: float | None


@dataclass(frozen=True, slots=True)
class FlowReading:
    running: int
    max_running: int | None
    tokens: float | None


@dataclass(frozen=True, slots=True)
class Controls:
    """One read of the schedules, pauses and limits, bounded; replaced whole, never mutated."""

    cron: dict[str, CronReading] = field(default_factory=dict)
    pauses: int = 0
    oldest_pause_s: float | None = None
    flow: dict[str, FlowReading] = field(default_factory=dict)


def _fold(readings: dict[str, Any], most: int, merge: Callable[[Any, Any], Any]) -> dict[str, Any]:
    """The first ``most`` names (sorted) kept, the rest merged into ``_other``."""
    names = sorted(readings)
    kept = {name: readings[name] for name in names[:most]}
    for name in names[most:]:
        previous = kept.get(OTHER)
        kept[OTHER] = readings[name] if previous is None else merge(previous, readings[name])
    return kept


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None and b is None else (a or 0) + (b or 0)


def _max(a: float | None, b: float | None) -> float | None:
    return None if a is None and b is None else max(a or 0, b or 0)


def _merge_cron(a: CronReading, b: CronReading) -> CronReading:
    # The folded schedules' worst: their misses together, the most overdue, the stalest.
    return CronReading(a.missed + b.missed, max(a.overdue_s, b.overdue_s),
                       _max(a.last_fire_age_s, b.last_fire_age_s))


def _merge_flow(a: FlowReading, b: FlowReading) -> FlowReading:
    max_running = _add(a.max_running, b.max_running)
    return FlowReading(a.running + b.running,
                       None if max_running is None else int(max_running),
                       _add(a.tokens, b.tokens))


async def read_controls(conn: psycopg.AsyncConnection[Any], schema: str, most: int) -> Controls:
    cron = {name: CronReading(missed, overdue, age) for name, missed, overdue, age in
            await (await conn.execute(metrics_query("metrics_cron", schema))).fetchall()}
    row = await (await conn.execute(metrics_query("metrics_pauses", schema))).fetchone()
    pauses, oldest = row if row else (0, None)
    flow = {pattern: FlowReading(running, max_running, tokens)
            for pattern, max_running, running, tokens in
            await (await conn.execute(metrics_query("metrics_flow", schema))).fetchall()}
    return Controls(_fold(cron, most, _merge_cron), pauses, oldest,
                    _fold(flow, most, _merge_flow))


def control_families(controls: Controls) -> Iterator[Metric]:
    missed = CounterMetricFamily("conveyor_cron_missed_slots",
                                 "Slots of each cron schedule skipped, later than its catch-up "
                                 "window, as last read.", labels=["schedule"])
    overdue = GaugeMetricFamily("conveyor_cron_overdue_seconds",
                                "Seconds the next slot of each cron schedule is overdue (0 "
                                "while on time), as last read.", labels=["schedule"])
    fired = GaugeMetricFamily("conveyor_cron_last_fire_age_seconds",
                              "Seconds since each cron schedule last fired, as last read "
                              "(absent before its first slot).", labels=["schedule"])
    for name, reading in controls.cron.items():
        missed.add_metric([name], reading.missed)
        overdue.add_metric([name], reading.overdue_s)
        if reading.last_fire_age_s is not None:
            fired.add_metric([name], reading.last_fire_age_s)
    yield from (missed, overdue, fired)
    pauses = GaugeMetricFamily("conveyor_pauses", "Pauses in force (conveyor pause), as last "
                               "read.", value=controls.pauses)
    oldest = GaugeMetricFamily("conveyor_pause_oldest_age_seconds",
                               "Seconds the oldest pause in force has lasted (0 without "
                               "pauses), as last read.", value=controls.oldest_pause_s or 0.0)
    yield from (pauses, oldest)
    running = GaugeMetricFamily("conveyor_flow_running",
                                "Running events of each flow-limited pattern, fleet-wide, as "
                                "last read.", labels=["pattern"])
    most = GaugeMetricFamily("conveyor_flow_max_running",
                             "max_running of each pattern limited by it.", labels=["pattern"])
    tokens = GaugeMetricFamily("conveyor_flow_tokens",
                               "Tokens in the bucket of each rate-limited pattern (a claim "
                               "spends one per event), as last read.", labels=["pattern"])
    for pattern, limit in controls.flow.items():
        running.add_metric([pattern], limit.running)
        if limit.max_running is not None:
            most.add_metric([pattern], limit.max_running)
        if limit.tokens is not None:
            tokens.add_metric([pattern], limit.tokens)
    yield from (running, most, tokens)
