"""The per-event work of the observability hooks, counted rather than timed.

A drain runs ``MetricsMiddleware.after`` and ``TracingMiddleware``'s hooks
once per event, so their cost is a share of every event's. Timings on a
shared machine move by half from run to run; the calls a hook makes do not
(what each is worth: docs/benchmarks.md). The profiler counts every call into
a Python function and every call of a built-in made while the hook runs.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from types import FrameType
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from prometheus_client import CollectorRegistry

from conveyor.metrics.middleware import MetricsMiddleware
from conveyor.middleware import HandlerResult
from conveyor.tracing import TracingMiddleware
from conveyor.types import Event, EventState

CREATED = datetime(2026, 1, 1, tzinfo=UTC)
SUCCESS = HandlerResult(EventState.SUCCEEDED, None, None, 0.0004, None, True)


def event(n: int = 1, **fields: Any) -> Event:
    return Event(id=n, topic="orders.placed", payload_text="{}", created_at=CREATED, **fields)


def calls(hook: Callable[..., object], *args: Any) -> Counter[str]:
    """The calls ``hook(*args)`` makes, by function name (built-ins too), itself not counted."""
    seen: Counter[str] = Counter()

    def profile(frame: FrameType, kind: str, arg: Any) -> None:
        if kind == "call":
            seen[frame.f_code.co_name] += 1
        elif kind == "c_call":
            seen[getattr(arg, "__name__", "?")] += 1

    sys.setprofile(profile)
    try:
        hook(*args)
    finally:
        sys.setprofile(None)
    seen[hook.__name__] -= 1
    seen["setprofile"] -= 1   # the profiler's own removal is reported as a call
    return +seen


@pytest.fixture
def metrics() -> Iterator[MetricsMiddleware]:
    middleware = MetricsMiddleware(registry=CollectorRegistry())
    middleware.after(event(), SUCCESS)   # the topic's series exists from here on
    yield middleware


def test_metrics_after_makes_at_most_seven_calls_per_success(metrics: MetricsMiddleware) -> None:
    # The clock, the lock's two halves, two look-ups and two bucket searches;
    # it made nine (an outcome-name helper, max(), datetime.timestamp()).
    made = calls(metrics.after, event(2), SUCCESS)
    assert sum(made.values()) <= 7, made


def test_metrics_after_reads_one_enqueue_time_once_for_events_that_share_it(
        metrics: MetricsMiddleware) -> None:
    made = Counter[str]()
    for n in range(3, 13):
        made += calls(metrics.after, event(n), SUCCESS)
    assert made["timestamp"] == 0, made
    later = datetime(2026, 1, 2, tzinfo=UTC)
    made = Counter()
    for n in range(13, 23):
        made += calls(metrics.after, Event(id=n, topic="orders.placed", payload_text="{}",
                                           created_at=later), SUCCESS)
    assert made["timestamp"] == 1, made


def test_metrics_counts_each_success_once_with_its_queue_wait(metrics: MetricsMiddleware) -> None:
    for n in range(2, 12):
        metrics.after(event(n), SUCCESS)
    handled, _duration, wait = metrics.collect()
    assert [(s.labels["outcome"], s.value) for s in handled.samples] == [("succeeded", 11)]
    waits = {s.name: s.value for s in wait.samples if not s.labels.get("le")}
    assert waits["conveyor_queue_wait_seconds_count"] == 11
    # Enqueued at CREATED, long ago: the whole wait lands in +Inf's bucket.
    assert waits["conveyor_queue_wait_seconds_sum"] > 11 * 86400


def test_tracing_after_of_an_unsampled_attempt_only_restores_the_context() -> None:
    middleware = TracingMiddleware(TracerProvider(sampler=ALWAYS_OFF))
    claimed = event()
    middleware.before(claimed)
    made = calls(middleware.after, claimed, SUCCESS)
    assert not made["set_attribute"] and not made["end"], made
    # ContextVar get and set, is_recording, and the detach (three calls in it).
    assert sum(made.values()) <= 6, made


def test_tracing_records_a_sampled_attempt_in_full() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    middleware = TracingMiddleware(provider)
    claimed = event(7, tenant="acme")
    middleware.before(claimed)
    middleware.after(claimed, SUCCESS)
    (span,) = exporter.get_finished_spans()
    assert span.name == "process orders.placed"
    assert span.parent is None and not span.links
    assert dict(span.attributes or {}) == {
        "messaging.system": "conveyor", "messaging.operation.type": "process",
        "messaging.operation.name": "process", "messaging.destination.name": "orders.placed",
        "messaging.message.id": "7", "conveyor.attempt": 1, "conveyor.tenant": "acme",
        "conveyor.outcome": "succeeded"}
