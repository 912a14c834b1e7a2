"""Scrape-time collectors: a worker's own counters, and the last database read.

Neither queries at scrape time: :class:`WorkerCollector` reads plain
attributes, :class:`DatabaseGauges` serves what its timer last read.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from collections.abc import Iterator, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

import psycopg
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.db.connect_async import connect_async
from conveyor.db.named_queries import parse_named_queries, queries_for
from conveyor.errors import DatabaseUnavailableError
from conveyor.metrics.config import OTHER, MetricsConfig
from conveyor.metrics.controls import Controls, control_families, read_controls
from conveyor.metrics.health import health, loop_lag
from conveyor.version import __version__
from conveyor.worker.deadline import with_deadline

if TYPE_CHECKING:
    from conveyor.relay.ordered import OrderedStream
    from conveyor.worker import Worker

log = logging.getLogger(__name__)

REFRESH_INTERVAL_DEFAULT = 15.0
STATEMENT_TIMEOUT_DEFAULT = 5.0
_LOCK_SQL = parse_named_queries(
    (resources.files("conveyor.metrics") / "queries.sql").read_text("utf-8"))["metrics_try_lock"]


def _family(kind: type[Any], name: str, doc: str, value: float,
            labels: Mapping[str, str]) -> Metric:
    family = kind(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family  # type: ignore[no-any-return]


class BuildInfo(Collector):
    """``conveyor_build_info{version, python}`` = 1: which release and interpreter a
    process runs, to join on in queries (``* on(instance) group_left(version)``)."""

    def collect(self) -> Iterator[Metric]:
        yield _family(GaugeMetricFamily, "conveyor_build_info",
                      "Conveyor's version and the Python running it; always 1.", 1.0,
                      {"version": __version__, "python": platform.python_version()})


def register_process_collectors(registry: CollectorRegistry) -> None:
    """prometheus_client's process (CPU, memory, open files), platform and GC collectors,
    and :class:`BuildInfo`, on ``registry`` (the global ``REGISTRY`` has the first three
    already)."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(BuildInfo())


class StreamsCollector(Collector):
    """The ordered relay's streams (conveyor.relay.ordered), one series per route,
    read at scrape time from each stream's attributes."""

    def __init__(self, streams: list[OrderedStream]) -> None:
        self.streams = streams

    def collect(self) -> Iterator[Metric]:
        relayed = CounterMetricFamily("conveyor_relay_stream_relayed",
                                      "Events an ordered stream marked relayed.",
                                      labels=["route"])
        gauges = {
            "leading": GaugeMetricFamily("conveyor_relay_stream_leading",
                                         "1 while this relay holds the stream's lock.",
                                         labels=["route"]),
            "blocked": GaugeMetricFamily("conveyor_relay_stream_blocked",
                                         "1 while the stream retries a refused or "
                                         "unconfirmed event.", labels=["route"]),
            "held": GaugeMetricFamily("conveyor_relay_stream_held_events",
                                      "Events waiting for an older transaction to end.",
                                      labels=["route"]),
            "held_s": GaugeMetricFamily("conveyor_relay_stream_held_seconds",
                                        "Age of the oldest event waiting for an older "
                                        "transaction to end.", labels=["route"]),
        }
        for stream in self.streams:
            route = [stream.pattern]
            held = stream.held or (0, 0.0)
            relayed.add_metric(route, stream.relayed)
            gauges["leading"].add_metric(route, float(stream.leading))
            gauges["blocked"].add_metric(route, float(stream.blocked_on is not None))
            gauges["held"].add_metric(route, held[0])
            gauges["held_s"].add_metric(route, held[1])
        yield relayed
        yield from gauges.values()


class WorkerCollector(Collector):
    """A worker's counters, read at scrape time (nothing per event).

    ``labels``: constant labels on every series, such as ``{"tenant": "acme"}``
    for one worker of ``worker-multi``. Defaults to none.
    """

    def __init__(self, worker: Worker, *, labels: Mapping[str, str] | None = None) -> None:
        self.worker = worker
        self.labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        yield from self.counters()
        yield from self.gauges()

    def counters(self) -> Iterator[Metric]:
        """The counters alone: what a stopped worker still has to say (a parked tenant's)."""
        w, s, lb = self.worker, self.worker.stats, self.labels
        counters = (
            ("conveyor_worker_claimed_events", "Events claimed.", s.claimed),
            ("conveyor_worker_claims", "Claim statements that returned events "
             "(claimed / claims is the batch size).", s.claims),
            ("conveyor_worker_handed_back", "Events handed back unrun at shutdown.", s.handed_back),
            ("conveyor_worker_leases_lost", "Events whose lease this worker lost.", s.lost),
            ("conveyor_worker_rescued", "Other workers' expired events rescued.", s.rescued),
            ("conveyor_worker_loop_stalls", "Times a handler blocked the event loop.",
             s.loop_stalls),
            ("conveyor_worker_notifications", "NOTIFY messages received.",
             w.listener.notifications),
            ("conveyor_worker_results_fenced", "Outcomes refused: the event was no longer "
             "this worker's.", w.completer.stale),
        )
        for name, doc, value in counters:
            yield _family(CounterMetricFamily, name, doc, value, lb)
        reconnects = CounterMetricFamily("conveyor_worker_reconnects",
                                         "Reconnects of each of the worker's connections.",
                                         labels=[*lb, "connection"])
        for managed in w.connections.all():
            reconnects.add_metric([*lb.values(), managed.role], managed.reconnects)
        yield reconnects

    def gauges(self) -> Iterator[Metric]:
        """The levels of a running worker: its loop, its events in flight, its health."""
        w, s, lb = self.worker, self.worker.stats, self.labels
        lag = loop_lag(w)
        gauges: tuple[tuple[str, str, float], ...] = (
            ("conveyor_worker_loop_stall_max_seconds", "Longest loop stall so far.",
             s.loop_stall_max_s),
            ("conveyor_worker_loop_lag_seconds", "Seconds since the event loop last ran.",
             lag or 0.0),
            ("conveyor_worker_in_flight", "Events claimed and not yet acknowledged.",
             w.in_flight),
            ("conveyor_worker_last_claim_age_seconds", "Seconds since the last claim round trip.",
             time.monotonic() - s.last_claim_at if s.last_claim_at else 0.0),
            ("conveyor_worker_healthy", "1 while /healthz answers 200.",
             1.0 if health(w).ok else 0.0),
        )
        for name, doc, level in gauges:
            yield _family(GaugeMetricFamily, name, doc, level, lb)


def bound_topics(counts: dict[tuple[str, str], int], lags: dict[str, float], most: int
                 ) -> tuple[dict[tuple[str, str], int], dict[str, float]]:
    """``counts`` and ``lags`` with at most ``most`` topics of their own, the busiest ones;
    every other topic's counts summed (and its lag maxed) under ``_other``."""
    totals: dict[str, int] = {}
    for (topic, _state), n in counts.items():
        totals[topic] = totals.get(topic, 0) + n
    if len(totals) <= most:
        return counts, lags
    kept = set(sorted(totals, key=lambda topic: (-totals[topic], topic))[:most])
    bounded: dict[tuple[str, str], int] = {}
    for (topic, state), n in counts.items():
        key = (topic if topic in kept else OTHER, state)
        bounded[key] = bounded.get(key, 0) + n
    bounded_lags: dict[str, float] = {}
    for topic, seconds in lags.items():
        name = topic if topic in kept else OTHER
        bounded_lags[name] = max(seconds, bounded_lags.get(name, 0.0))
    return bounded, bounded_lags


class DatabaseGauges(Collector):
    """Queue depths, cron schedules, pauses and flow limits read from the database on a
    timer, by one worker per schema at a time (:mod:`conveyor.metrics.controls`).

    A worker service (``Worker(services=[gauges])``, what ``--metrics-port``
    does): every ``interval`` seconds the refresher tries a session advisory lock; the
    one that holds it reads the exact counts through the partial indexes
    (Admin.status's ``status_open_counts`` and ``status_oldest_due_age``)
    under ``statement_timeout``. The others export none of these series. A
    scrape serves the last read, never a query. A pass that gets no answer
    within twice ``statement_timeout`` (a server that stopped answering, which
    its own timeout cannot end) drops its connection; the next pass opens another.

    ``interval``: seconds between reads. Defaults to 15.
    ``statement_timeout``: limit on each read, in seconds. Defaults to 5.
    ``config``: the bounds: the ``config.max_topics`` topics with the most open
    events keep series of their own, the others are summed under
    ``topic="_other"`` (their oldest lag is ``_other``'s). Defaults to
    ``MetricsConfig()`` (200).
    """

    name = "metrics"

    def __init__(self, conninfo: str, schema: str = "conveyor", *,
                 interval: float = REFRESH_INTERVAL_DEFAULT,
                 statement_timeout: float = STATEMENT_TIMEOUT_DEFAULT,
                 config: MetricsConfig | None = None) -> None:
        self.conninfo = conninfo
        self.schema = schema
        self.interval = interval
        self.statement_timeout = statement_timeout
        self.config = config or MetricsConfig()
        self._q = queries_for(schema)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self.holds_lock = False
        # Replaced whole, never mutated: a scrape thread reads one consistent snapshot.
        self._snapshot: tuple[float, dict[tuple[str, str], int], float | None,
                              dict[str, float], Controls] | None = None

    async def refresh_once(self) -> bool:
        """Read the gauges if this process holds (or now takes) the lock; True when read."""
        bound = 2 * self.statement_timeout
        if self._conn is None or self._conn.closed:
            self.holds_lock = False
            self._conn = await connect_async(
                self.conninfo, autocommit=True, application_name="conveyor-metrics",
                connect_timeout=max(2, round(bound)))
            # jit off: a count over a big backlog passes jit_above_cost, and
            # compiling it at every refresh costs more than it saves.
            await with_deadline(self._conn, self._conn.execute(
                "SELECT set_config('statement_timeout', %s, false), set_config('jit', 'off', false)",
                (str(int(self.statement_timeout * 1000)),)), bound)
        return await with_deadline(self._conn, self.run_once(self._conn), bound)

    async def run_once(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Read the gauges on ``conn`` if its session holds (or now takes) the lock;
        True when read. ``refresh_once`` does it on the refresher's own connection."""
        if not self.holds_lock:
            row = await (await conn.execute(_LOCK_SQL, {"schema": self.schema})).fetchone()
            self.holds_lock = bool(row and row[0])
            if not self.holds_lock:
                return False
        counts: dict[tuple[str, str], int] = {}
        lags: dict[str, float] = {}
        for topic, _tenant, state, n, oldest_due in await (
                await conn.execute(self._q["status_open_counts"])).fetchall():
            counts[(topic, state)] = counts.get((topic, state), 0) + n
            if oldest_due is not None:
                lags[topic] = max(oldest_due, lags.get(topic, 0.0))
        counts, lags = bound_topics(counts, lags, self.config.max_topics)
        row = await (await conn.execute(self._q["status_oldest_due_age"])).fetchone()
        controls = await read_controls(conn, self.schema, self.config.max_topics)
        self._snapshot = (time.monotonic(), counts, row[0] if row else None, lags, controls)
        return True

    async def run(self, stopping: asyncio.Event) -> None:
        """Refresh every ``interval`` until ``stopping`` is set; then let go of the lock."""
        try:
            while not stopping.is_set():
                try:
                    await self.refresh_once()
                except (psycopg.Error, DatabaseUnavailableError, TimeoutError) as exc:
                    log.warning("reading the database gauges failed: %s", exc,
                                extra={"action": "metrics_refresh_failed"})
                    await self.close()
                try:
                    await asyncio.wait_for(stopping.wait(), self.interval)
                except TimeoutError:
                    pass
        finally:
            await self.close()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        self.holds_lock = False
        if conn is not None:
            await conn.close()

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot
        if snapshot is None or not self.holds_lock:
            return
        read_at, counts, oldest, lags, controls = snapshot
        events = GaugeMetricFamily("conveyor_events", "Events by topic and state, as last read "
                                   "(pending = due now, scheduled = pending not yet due).",
                                   labels=["topic", "state"])
        for (topic, state), n in sorted(counts.items()):
            events.add_metric([topic, state], n)
        yield events
        yield _family(GaugeMetricFamily, "conveyor_oldest_due_age_seconds",
                      "Seconds the oldest due pending event has waited, as last read.",
                      oldest or 0.0, {})
        lag = GaugeMetricFamily("conveyor_topic_oldest_due_age_seconds",
                                "Seconds the oldest due pending event of each topic with due "
                                "events has waited, as last read (a relay's lag).",
                                labels=["topic"])
        for topic, seconds in sorted(lags.items()):
            lag.add_metric([topic], seconds)
        yield lag
        yield from control_families(controls)
        yield _family(GaugeMetricFamily, "conveyor_database_gauges_age_seconds",
                      "Seconds since the database gauges were read.",
                      time.monotonic() - read_at, {})
