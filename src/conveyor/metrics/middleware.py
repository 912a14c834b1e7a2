"""Counts and times every handler outcome, by topic (and tenant when asked)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from conveyor.middleware import HandlerResult, Middleware
from conveyor.types import Event, EventState

# Seconds; handlers run from milliseconds to minutes.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 300.0)
# Seconds from enqueue to start: an idle queue answers in milliseconds, a backlog in hours.
WAIT_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
                3600.0, 14400.0, 86400.0)


def outcome_name(result: HandlerResult) -> str:
    """``succeeded``, ``retried``, ``snoozed``, ``failed`` (parked) or ``cancelled``."""
    if result.state is EventState.PENDING:
        return "retried" if result.attempt_spent else "snoozed"
    return str(result.state)


class MetricsMiddleware(Middleware):
    """Outcome counter, handler duration and queue wait histograms, labelled by topic.

    Example::

        Worker(dsn, router, middleware=[MetricsMiddleware()])

    ``registry``: where the metrics are registered. Defaults to
    prometheus_client's global ``REGISTRY``.
    ``tenant_label``: add a ``tenant`` label (empty for events without one).
    Defaults to False: a label per tenant multiplies the series.
    """

    def __init__(self, *, registry: CollectorRegistry | None = None,
                 tenant_label: bool = False) -> None:
        registry = REGISTRY if registry is None else registry
        self.tenant_label = tenant_label
        labels = ("topic", "tenant") if tenant_label else ("topic",)
        self._outcomes = Counter("conveyor_events_handled_total",
                                 "Handler outcomes, by topic and outcome.",
                                 (*labels, "outcome"), registry=registry)
        self._duration = Histogram("conveyor_handler_duration_seconds",
                                   "Seconds one handler call took.", labels,
                                   buckets=DURATION_BUCKETS, registry=registry)
        self._wait = Histogram("conveyor_queue_wait_seconds",
                               "Seconds from the event's enqueue to its handler's start.",
                               labels, buckets=WAIT_BUCKETS, registry=registry)
        # The children by label values: prometheus_client's labels() takes a lock
        # and builds a tuple on every call; this is one dict lookup per outcome.
        self._children: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}

    def after(self, event: Event, result: HandlerResult) -> None:
        values: tuple[str, ...] = ((event.topic, event.tenant or "") if self.tenant_label
                                   else (event.topic,))
        key = (*values, result.state, result.attempt_spent)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self._outcomes.labels(*values, outcome_name(result)),
                self._duration.labels(*values), self._wait.labels(*values))
        outcomes, duration, wait = children
        outcomes.inc()
        duration.observe(result.duration)
        created = event.created_at
        if created is not None:
            started = time.time() - result.duration
            wait.observe(max(0.0, started - created.timestamp()))
