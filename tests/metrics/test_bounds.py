"""The metrics stay bounded whatever the topics: a cap on label sets with an ``_other``
bucket, totals kept right, and a scrape that stays small (adversary finding N8)."""

from __future__ import annotations

import datetime
import time
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from conveyor.errors import ConfigError
from conveyor.metrics import DatabaseGauges, MetricsConfig, MetricsMiddleware
from conveyor.metrics.config import MAX_TOPICS_DEFAULT
from conveyor.middleware import HandlerResult
from conveyor.types import Event, EventState

CREATED = datetime.datetime.now(datetime.UTC)
SUCCEEDED = HandlerResult(EventState.SUCCEEDED, None, None, 0.002, None, True)


class _TimedLock:
    """A lock that records how long each hold lasted."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.holds: list[float] = []
        self._at = 0.0

    def __enter__(self) -> None:
        self.lock.acquire()
        self._at = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.holds.append(time.perf_counter() - self._at)
        self.lock.release()


def _label_sets(registry: CollectorRegistry, name: str, *labels: str) -> set[tuple[str, ...]]:
    return {tuple(s.labels[label] for label in labels)
            for family in registry.collect() for s in family.samples if s.name == name}


def _total(registry: CollectorRegistry, name: str) -> float:
    return sum(s.value for family in registry.collect() for s in family.samples
               if s.name == name)


@pytest.mark.parametrize(("n", "tenant_label"), [(100_000, False), (200_000, True)])
def test_the_middleware_keeps_a_bounded_number_of_series_whatever_the_topics(
        n: int, tenant_label: bool) -> None:
    registry = CollectorRegistry()
    middleware = MetricsMiddleware(registry=registry, tenant_label=tenant_label)
    for i in range(n):
        event = Event(id=i, topic=f"user.notify.u{i}", payload_text="{}",
                      tenant=f"t{i % 997}" if tenant_label else None, created_at=CREATED)
        middleware.after(event, SUCCEEDED)
    # The scrape's copy holds the lock after() takes on the worker's loop: it
    # must stay short (3.6 s at 200,000 pairs before the cap; 0.3 ms with it).
    timed = _TimedLock(middleware._lock)
    middleware._lock = timed  # type: ignore[assignment]
    list(middleware.collect())
    assert max(timed.holds) < 0.25, timed.holds
    labels = ("topic", "tenant") if tenant_label else ("topic",)
    handled = _label_sets(registry, "conveyor_events_handled_total", *labels)
    assert len(handled) == MAX_TOPICS_DEFAULT + 1
    assert ("_other",) * len(labels) in handled
    assert _total(registry, "conveyor_events_handled_total") == n
    assert _total(registry, "conveyor_handler_duration_seconds_count") == n
    assert _total(registry, "conveyor_queue_wait_seconds_count") == n
    assert len(generate_latest(registry)) < 1024 * 1024


def test_the_middleware_counts_known_topics_after_the_cap_is_reached() -> None:
    registry = CollectorRegistry()
    middleware = MetricsMiddleware(registry=registry, config=MetricsConfig(max_topics=2))
    for topic in ("a", "b", "c", "a", "d"):
        middleware.after(Event(id=1, topic=topic, payload_text="{}", created_at=CREATED),
                         SUCCEEDED)

    def handled(topic: str) -> float | None:
        return registry.get_sample_value("conveyor_events_handled_total",
                                         {"topic": topic, "outcome": "succeeded"})
    assert (handled("a"), handled("b"), handled("_other"), handled("c")) == (2, 1, 2, None)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_topics", 0, "expected max_topics to be an integer between 1 and 10000, got 0"),
    ("max_topics", 2.5, "expected max_topics to be an integer between 1 and 10000, got 2.5"),
    ("max_connections", True, "expected max_connections to be an integer between 1 and 1000, "
                              "got True"),
    ("request_timeout", float("nan"), "expected request_timeout to be a number of seconds "
                                      "between 0.1 and 3600, got nan"),
    ("request_timeout", "5", "expected request_timeout to be a number of seconds between 0.1 "
                             "and 3600, got '5'"),
])
def test_metrics_config_refuses_a_bound_out_of_range_in_one_line(field: str, value: Any,
                                                                 message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        MetricsConfig(**{field: value})
    assert str(caught.value) == message


async def test_database_gauges_keep_the_busiest_topics_and_sum_the_rest(db: str) -> None:
    n = 100_000
    with psycopg.connect(db, autocommit=True) as conn:
        # One pending event per topic, plus a busy topic that must keep its own series.
        conn.execute("INSERT INTO conveyor.events (topic, payload, run_at) "
                     "SELECT 'user.notify.u' || i, '{}', now() - interval '1 minute' "
                     "FROM generate_series(1, %s) AS i", (n,))
        conn.execute("INSERT INTO conveyor.events (topic, payload) "
                     "SELECT 'busy.topic', '{}' FROM generate_series(1, 5)")
    gauges = DatabaseGauges(db)
    try:
        assert await gauges.refresh_once()
        registry = CollectorRegistry()
        registry.register(gauges)
        events = _label_sets(registry, "conveyor_events", "topic", "state")
        assert len(events) == MAX_TOPICS_DEFAULT + 1
        assert ("busy.topic", "pending") in events
        assert ("_other", "pending") in events
        assert _total(registry, "conveyor_events") == n + 5
        lags = _label_sets(registry, "conveyor_topic_oldest_due_age_seconds", "topic")
        assert len(lags) == MAX_TOPICS_DEFAULT + 1
        assert registry.get_sample_value("conveyor_topic_oldest_due_age_seconds",
                                         {"topic": "_other"}) >= 59  # type: ignore[operator]
        assert len(generate_latest(registry)) < 100 * 1024
    finally:
        await gauges.close()
