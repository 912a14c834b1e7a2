"""Counts and times every handler outcome, by topic (and tenant when asked)."""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from datetime import datetime

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.metrics.config import OTHER, MetricsConfig
from conveyor.middleware import HandlerResult, Middleware
from conveyor.types import Event, EventState
from conveyor.worker.accounting import SettledObserver
from conveyor.worker.classify import Outcome

# Seconds; handlers run from milliseconds to minutes.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 300.0)
# Seconds from enqueue to start: an idle queue answers in milliseconds, a backlog in hours.
WAIT_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
                3600.0, 14400.0, 86400.0)


def _outcome(state: EventState, attempt_spent: bool) -> str:
    """``succeeded``, ``retried``, ``snoozed``, ``failed`` (parked) or ``cancelled``."""
    if state is EventState.PENDING:
        return "retried" if attempt_spent else "snoozed"
    return str(state)


# The outcome label by (state, attempt_spent), computed once: str() of the
# enum per event was a measurable share of after().
_OUTCOME_NAMES = {(state, spent): _outcome(state, spent)
                  for state in EventState for spent in (True, False)}


_SUCCEEDED = _OUTCOME_NAMES[EventState.SUCCEEDED, True]


def outcome_name(result: HandlerResult) -> str:
    """The ``outcome`` label of an attempt's result."""
    return _OUTCOME_NAMES[result.state, result.attempt_spent]


class _Series:
    """The counts of one label set: outcomes, and both histograms' buckets and sums.

    Buckets are per-bucket counts (the exposition makes them cumulative);
    the last slot is +Inf.
    """

    __slots__ = ("duration", "duration_sum", "outcomes", "wait", "wait_sum")

    def __init__(self) -> None:
        # Every outcome from the start, so counting one is an addition (an
        # outcome never seen is left out of the scrape).
        self.outcomes: dict[str, int] = dict.fromkeys(_OUTCOME_NAMES.values(), 0)
        self.duration = [0] * (len(DURATION_BUCKETS) + 1)
        self.duration_sum = 0.0
        self.wait = [0] * (len(WAIT_BUCKETS) + 1)
        self.wait_sum = 0.0


class MetricsMiddleware(Middleware, Collector, SettledObserver):
    """Outcome counter, handler duration and queue wait histograms, labelled by topic.

    Example::

        Worker(dsn, router, middleware=[MetricsMiddleware()])

    ``registry``: where the metrics are registered. Defaults to
    prometheus_client's global ``REGISTRY``.
    ``tenant_label``: add a ``tenant`` label (empty for events without one).
    Defaults to False: a label per tenant multiplies the series.
    ``config``: the bounds; the first ``config.max_topics`` topics (or
    topic-and-tenant pairs) seen get series of their own, every later one is
    counted under ``topic="_other"`` (and ``tenant="_other"``), so a producer
    that builds topics from data cannot grow the worker's memory or its scrape.
    Defaults to ``MetricsConfig()`` (200).

    The counts are kept here, under one lock, and exported as prometheus_client
    metric families at scrape time: a Counter and two Histograms updated per
    event cost twice as much (three locks, a label look-up, a linear bucket
    scan; docs/benchmarks.md, "Behind choices in the code"). A worker counts
    each acknowledged batch's outcomes at once (:meth:`observe_settled`)
    and runs neither hook; so an outcome whose acknowledgement the database
    refused (a lost lease: the event is another worker's) is not counted.
    """

    def __init__(self, *, registry: CollectorRegistry | None = None,
                 tenant_label: bool = False, config: MetricsConfig | None = None) -> None:
        self.tenant_label = tenant_label
        self.config = config or MetricsConfig()
        self._labels = ("topic", "tenant") if tenant_label else ("topic",)
        self._other = (OTHER,) * len(self._labels)
        self._series: dict[tuple[str, ...], _Series] = {}
        # after() runs on the worker's event loop; the lock is for the scrape,
        # which reads from the metrics server's thread.
        self._lock = threading.Lock()
        # The last enqueue time seen, and its epoch seconds: the events of one
        # enqueue transaction share it (now()), and datetime.timestamp() was
        # the dearest step of after().
        self._created: datetime | int | None = None
        self._created_epoch = 0.0
        (REGISTRY if registry is None else registry).register(self)

    def after(self, event: Event, result: HandlerResult) -> None:
        outcome = (_SUCCEEDED if result.state is EventState.SUCCEEDED
                   else _OUTCOME_NAMES[result.state, result.attempt_spent])
        duration = result.duration
        with self._lock:
            self._count(event, outcome, duration, time.time() - duration)

    def observe_settled(self, settled: Sequence[tuple[Event, Outcome]]) -> None:
        """A worker's written outcomes, a batch at a time (instead of ``after``: see
        :class:`~conveyor.worker.accounting.SettledObserver`); each call's start
        on the wall clock from its monotonic one."""
        wall = time.time() - time.monotonic()
        count = self._count
        with self._lock:
            for event, outcome in settled:
                name = (_SUCCEEDED if outcome.state is EventState.SUCCEEDED
                        else _OUTCOME_NAMES[outcome.state, not outcome.refund])
                count(event, name, outcome.duration, outcome.started + wall)

    def _count(self, event: Event, outcome: str, duration: float, started: float) -> None:
        """One attempt, under the lock: its outcome, its duration and its wait from
        enqueue to ``started`` (epoch seconds)."""
        key = (event.topic, event.tenant or "") if self.tenant_label else (event.topic,)
        series = self._series.get(key)
        if series is None:
            series = self._new_series(key)
        series.outcomes[outcome] += 1
        series.duration[bisect_left(DURATION_BUCKETS, duration)] += 1
        series.duration_sum += duration
        # Read as the claim gave it (Event.created_at would make a datetime);
        # the events of one enqueue share it, so its epoch is worked out once.
        created = event._created
        if created is not None:
            if created != self._created:
                self._created, self._created_epoch = created, event._created_epoch() or 0.0
            wait = started - self._created_epoch
            if wait < 0.0:
                wait = 0.0
            series.wait[bisect_left(WAIT_BUCKETS, wait)] += 1
            series.wait_sum += wait

    def _new_series(self, key: tuple[str, ...]) -> _Series:
        """The series of a label set not seen before: its own below the cap, else ``_other``'s
        (which counts toward the cap: max_topics + 1 label sets at most)."""
        if len(self._series) >= self.config.max_topics:
            key = self._other
            series = self._series.get(key)
            if series is not None:
                return series
        series = self._series[key] = _Series()
        return series

    def collect(self) -> Iterator[Metric]:
        # Bounded (max_topics + 1 label sets), so the copy that after() waits
        # for is short; the families are built after the lock is let go.
        with self._lock:
            snapshot = [(key, dict(s.outcomes), list(s.duration), s.duration_sum,
                         list(s.wait), s.wait_sum) for key, s in self._series.items()]
        handled = CounterMetricFamily("conveyor_events_handled",
                                      "Handler outcomes, by topic and outcome.",
                                      labels=[*self._labels, "outcome"])
        duration = HistogramMetricFamily("conveyor_handler_duration_seconds",
                                         "Seconds one handler call took.", labels=self._labels)
        wait = HistogramMetricFamily("conveyor_queue_wait_seconds",
                                     "Seconds from the event's enqueue to its handler's start.",
                                     labels=self._labels)
        for key, outcomes, durations, duration_sum, waits, wait_sum in snapshot:
            for outcome, count in sorted(outcomes.items()):
                if count:
                    handled.add_metric([*key, outcome], count)
            duration.add_metric(list(key), _cumulative(DURATION_BUCKETS, durations),
                                duration_sum)
            wait.add_metric(list(key), _cumulative(WAIT_BUCKETS, waits), wait_sum)
        yield handled
        yield duration
        yield wait


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """``(le, count of observations <= le)`` per bucket, +Inf last, as the exposition wants."""
    total, buckets = 0, []
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        total += count
        # The label text prometheus_client's own histograms write ("0.005", "1.0", "+Inf").
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(total)))
    return buckets

