"""OpenTelemetry traces through the event row (conveyor.tracing), seen by the SDK's in-memory exporter.

The producer's ``send`` span and the context it stores, the worker's
``process`` span linked to it (through ``work_event`` and a real in-process
``Worker``), and a core install that never imports OpenTelemetry.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from conveyor import NewEvent, Producer, Router, Worker
from conveyor.db.named_queries import raw_queries
from conveyor.errors import DatabaseError
from conveyor.retry import BackoffPolicy
from conveyor.testing import work_event
from conveyor.tracing import TracingMiddleware
from worker_support import enqueue, fast_config, running, wait_all_in

REPO = Path(__file__).resolve().parents[1]
EXPORTER = InMemorySpanExporter()
NOW = BackoffPolicy(base_delay=0.0, max_delay=0.0, jitter=0.0)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The global tracer provider (an SDK one, set once per process) exporting here."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if not getattr(provider, "_conveyor_test_exporter", False):
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        provider._conveyor_test_exporter = True  # type: ignore[attr-defined]
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


def tracer() -> trace.Tracer:
    return trace.get_tracer("tests.tracing")


def named(exporter: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith(prefix)]


def traceparent_of(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def span_ids(context: trace.SpanContext | None) -> tuple[int, int]:
    assert context is not None
    return context.trace_id, context.span_id


def trace_columns(conn: psycopg.Connection[Any], topic: str) -> set[tuple[Any, Any]]:
    return set(conn.execute("SELECT traceparent, tracestate FROM conveyor.events WHERE topic = %s",
                            (topic,)).fetchall())


def one_topic(topic: str, count: int, **options: Any) -> list[NewEvent]:
    return [NewEvent(topic=topic, payload={"n": n}, **options) for n in range(count)]


# ------------------------------------------------------------------ producer

def test_enqueue_outside_a_span_stores_no_context_and_starts_no_span(
        conn: psycopg.Connection[Any], spans: InMemorySpanExporter) -> None:
    Producer().enqueue(conn, "trace.none", {})
    Producer().enqueue_bulk(conn, [("trace.none", {})] * 100)
    assert trace_columns(conn, "trace.none") == {(None, None)}
    assert spans.get_finished_spans() == ()


def test_enqueue_in_a_span_stores_the_send_spans_context(
        conn: psycopg.Connection[Any], spans: InMemorySpanExporter) -> None:
    with tracer().start_as_current_span("request") as request:
        event_id = Producer().enqueue(conn, "trace.one", {"a": 1})
    (send,) = named(spans, "send")
    assert send.name == "send trace.one" and send.kind is SpanKind.PRODUCER
    assert send.parent is not None and send.parent.span_id == request.get_span_context().span_id
    assert dict(send.attributes or {}) == {
        "messaging.system": "conveyor", "messaging.operation.type": "send",
        "messaging.operation.name": "send", "messaging.destination.name": "trace.one",
        "messaging.message.id": str(event_id)}
    assert trace_columns(conn, "trace.one") == {(traceparent_of(send), None)}


def test_the_tracestate_travels_with_the_traceparent(
        conn: psycopg.Connection[Any], spans: InMemorySpanExporter) -> None:
    remote = trace.SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, True,
                               trace.TraceFlags(1), trace.TraceState([("congo", "t61rcWkgMzE")]))
    parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    with tracer().start_as_current_span("request", context=parent):
        Producer().enqueue(conn, "trace.state", {})
    (send,) = named(spans, "send")
    assert trace_columns(conn, "trace.state") == {(traceparent_of(send), "congo=t61rcWkgMzE")}


@pytest.mark.parametrize("count", [3, 100], ids=["insert", "copy"])
def test_enqueue_many_stores_one_context_in_every_row(
        conn: psycopg.Connection[Any], spans: InMemorySpanExporter, count: int) -> None:
    with tracer().start_as_current_span("request"):
        Producer().enqueue_many(conn, one_topic("trace.many", count))
    (send,) = named(spans, "send")
    assert send.name == "send trace.many"
    assert (send.attributes or {})["messaging.batch.message_count"] == count
    assert trace_columns(conn, "trace.many") == {(traceparent_of(send), None)}


@pytest.mark.parametrize("events", [
    [("trace.bulk", {"n": n}) for n in range(100)],                         # the plain COPY
    one_topic("trace.bulk", 100, tenant="acme"),                            # COPY of checked rows
    one_topic("trace.bulk", 100, delay=5),                                  # the INSERT route
], ids=["plain", "rows", "insert"])
def test_enqueue_bulk_stores_the_context_on_every_route(
        conn: psycopg.Connection[Any], spans: InMemorySpanExporter, events: list[Any]) -> None:
    with tracer().start_as_current_span("request"):
        assert Producer().enqueue_bulk(conn, events) == 100
    (send,) = named(spans, "send")
    assert send.kind is SpanKind.PRODUCER
    assert (send.attributes or {})["messaging.batch.message_count"] == 100
    assert trace_columns(conn, "trace.bulk") == {(traceparent_of(send), None)}


def test_a_producer_built_without_tracing_stores_nothing_in_a_span(
        conn: psycopg.Connection[Any], spans: InMemorySpanExporter) -> None:
    with tracer().start_as_current_span("request"):
        Producer(tracing=False).enqueue(conn, "trace.off", {})
    assert trace_columns(conn, "trace.off") == {(None, None)}
    assert named(spans, "send") == []


def test_a_failed_enqueue_ends_its_send_span_in_error(
        conn: psycopg.Connection[Any], spans: InMemorySpanExporter) -> None:
    with pytest.raises(psycopg.errors.DivisionByZero):
        conn.execute("SELECT 1/0")
    with tracer().start_as_current_span("request"), pytest.raises(DatabaseError):
        Producer().enqueue(conn, "trace.fail", {})
    (send,) = named(spans, "send")
    assert send.status.status_code is StatusCode.ERROR
    assert (send.attributes or {})["error.type"] == "DatabaseError"
    assert [e.name for e in send.events] == ["exception"]


def test_each_traced_query_is_its_twin_with_the_trace_columns() -> None:
    def untraced(text: str) -> str:
        text = re.sub(r",\s*traceparent, tracestate\)", ")", text)
        text = re.sub(r",\s*%\(traceparent\)s::text, %\(tracestate\)s::text", "", text)
        return " ".join(line for line in text.splitlines() if not line.startswith("--")).split()

    queries = raw_queries()
    for name in ("event_insert", "event_insert_many_ids"):
        assert untraced(queries[f"{name}_traced"]) == untraced(queries[name]), name


# ------------------------------------------------------------------ consumer

def _enqueue_in_a_span(conn: psycopg.Connection[Any], spans: InMemorySpanExporter,
                       topic: str) -> ReadableSpan:
    with tracer().start_as_current_span("request"):
        Producer().enqueue(conn, topic, {})
    (send,) = named(spans, "send")
    return send


def test_the_process_span_is_a_child_of_and_linked_to_the_send_span(
        conn: psycopg.Connection[Any], spans: InMemorySpanExporter) -> None:
    send = _enqueue_in_a_span(conn, spans, "trace.work")
    seen: list[trace.Span] = []
    router = Router()
    router.add("trace.work", lambda event: seen.append(trace.get_current_span()))
    worked = work_event(conn, router, middleware=[TracingMiddleware()])
    assert worked is not None
    (process,) = named(spans, "process")
    assert process.name == "process trace.work" and process.kind is SpanKind.CONSUMER
    assert [span_ids(link.context) for link in process.links] == [span_ids(send.context)]
    assert process.parent is not None and process.parent.span_id == send.get_span_context().span_id
    assert dict(process.attributes or {}) == {
        "messaging.system": "conveyor", "messaging.operation.type": "process",
        "messaging.operation.name": "process", "messaging.destination.name": "trace.work",
        "messaging.message.id": str(worked.event.id), "conveyor.attempt": 1,
        "conveyor.outcome": "succeeded"}
    assert process.status.status_code is StatusCode.UNSET
    # The handler ran inside the process span.
    assert seen[0].get_span_context() == process.get_span_context()


def test_a_failing_handler_ends_its_span_in_error_and_the_retry_is_linked(
        conn: psycopg.Connection[Any], spans: InMemorySpanExporter) -> None:
    send = _enqueue_in_a_span(conn, spans, "trace.fail")

    def fail(event: Any) -> None:
        raise ValueError("boom")

    router = Router()
    router.add("trace.fail", fail)
    for _ in range(2):
        assert work_event(conn, router, backoff=NOW, middleware=[TracingMiddleware()]) is not None
    first, second = sorted(named(spans, "process"),
                           key=lambda s: dict(s.attributes or {})["conveyor.attempt"])
    for span in (first, second):
        assert span.status.status_code is StatusCode.ERROR
        assert (span.attributes or {})["error.type"] == "ValueError"
        assert [e.name for e in span.events] == ["exception"]
        assert [span_ids(link.context) for link in span.links] == [span_ids(send.context)]
    assert first.parent is not None and first.parent.span_id == send.get_span_context().span_id
    # A retry starts a trace of its own, linked back to the send.
    assert second.parent is None
    assert (second.attributes or {})["conveyor.attempt"] == 2
    assert second.context is not None and send.context is not None
    assert second.context.trace_id != send.context.trace_id


def test_an_untraced_event_gets_a_root_process_span_without_links(
        conn: psycopg.Connection[Any], spans: InMemorySpanExporter) -> None:
    Producer().enqueue(conn, "trace.bare", {})
    router = Router()
    router.add("trace.bare", lambda event: None)
    assert work_event(conn, router, middleware=[TracingMiddleware()]) is not None
    (process,) = named(spans, "process")
    assert process.parent is None and list(process.links) == []


async def test_a_worker_with_the_middleware_links_each_event(
        fresh_db: str, spans: InMemorySpanExporter) -> None:
    with tracer().start_as_current_span("request"):
        ids = [await enqueue(fresh_db, "trace.live", {"n": n}) for n in range(3)]
    sends = {s.attributes["messaging.message.id"]: s for s in named(spans, "send")  # type: ignore[index]
             if s.attributes}
    current: dict[int, trace.SpanContext] = {}

    async def handler(event: Any) -> None:
        current[event.id] = trace.get_current_span().get_span_context()

    router = Router()
    router.add("trace.live", handler)
    worker = Worker(fresh_db, router, fast_config(), middleware=[TracingMiddleware()])
    async with running(worker):
        await wait_all_in(fresh_db, {"succeeded"}, timeout=10)
    processes = {s.attributes["messaging.message.id"]: s  # type: ignore[index]
                 for s in named(spans, "process") if s.attributes}
    assert sorted(processes) == sorted(str(i) for i in ids)
    for event_id in ids:
        process, send = processes[str(event_id)], sends[str(event_id)]
        assert [span_ids(link.context) for link in process.links] == [span_ids(send.context)]
        assert current[event_id] == process.get_span_context()


async def test_a_batch_handler_call_ends_the_span_of_each_of_its_events() -> None:
    """A batch call enters each event's hooks in turn and leaves them in reverse: every
    event's span is ended (only the last one was), and the context is restored."""
    from conveyor.types import Event
    from conveyor.worker.executor import Executor
    from conveyor.worker.running import RunningSet

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    current: list[trace.Span] = []

    async def handle(events: list[Any]) -> None:
        current.append(trace.get_current_span())

    router = Router()
    router.add("trace.batch", handle, batch=True)
    slots = RunningSet(10)
    executor = Executor(router, slots, lambda outcome: None, handler_timeout=5.0, backoff=NOW,
                        threads=1, middleware=[TracingMiddleware(provider)])
    events = [Event(id=n, topic="trace.batch", payload_text="{}") for n in (1, 2, 3)]
    slots.take(events)
    executor.start(events)
    await asyncio.gather(*slots.unfinished_tasks())
    executor.close()
    ended = sorted((s.attributes or {})["messaging.message.id"] for s in exporter.get_finished_spans())
    assert ended == ["1", "2", "3"]
    # The batch handler runs inside the last event's span.
    assert current[0].get_span_context().span_id == max(
        exporter.get_finished_spans(),
        key=lambda s: (s.attributes or {})["messaging.message.id"]).context.span_id


# ------------------------------------------------------------------ the extra

BLOCK = "import sys\nsys.modules['opentelemetry'] = None\n"


def _child(code: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_core_import_loads_no_opentelemetry() -> None:
    done = _child("import sys, conveyor, conveyor.worker, conveyor.testing, conveyor.cli.main\n"
                  "conveyor.Producer()\n"
                  "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    assert done.returncode == 0, done.stderr
    # The producer probes for the extra when built, and may load it: only the
    # imports themselves must not.
    done = _child("import sys, conveyor, conveyor.worker, conveyor.testing, conveyor.cli.main\n"
                  "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    assert done.stdout.strip() == "[]", done.stdout


def test_without_the_extra_the_producer_works_and_tracing_says_which_extra() -> None:
    done = _child(BLOCK + "from conveyor import Producer\nProducer()\n"
                  "try:\n    Producer(tracing=True)\nexcept ImportError as exc:\n    print(exc)\n"
                  "try:\n    import conveyor.tracing\nexcept ImportError as exc:\n    print(exc)\n")
    assert done.returncode == 0, done.stderr
    line = "conveyor.tracing needs the 'otel' extra: pip install 'conveyor[otel]'"
    assert done.stdout.splitlines() == [line, line]


def test_before_an_sdk_is_set_up_the_middleware_does_nothing_and_follows_it_once_it_is() -> None:
    """With only the API (the global provider a proxy) every span would be a no-op: the
    middleware skips the work; an SDK set up later (an app importing late) is followed
    from the next event on."""
    done = _child(
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from opentelemetry.sdk.trace.export import SimpleSpanProcessor\n"
        "from opentelemetry.sdk.trace.export.in_memory_span_exporter import"
        " InMemorySpanExporter\n"
        "from conveyor.middleware import HandlerResult\n"
        "from conveyor.tracing import TracingMiddleware\n"
        "from conveyor.types import Event, EventState\n"
        "tp = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'\n"
        "event = Event(id=7, topic='t.x', payload_text='{}', traceparent=tp)\n"
        "done = HandlerResult(EventState.SUCCEEDED, None, None, 0.001, None, True)\n"
        "middleware = TracingMiddleware()\n"
        "middleware.before(event)\n"
        "print(trace.get_current_span().get_span_context().is_valid)\n"
        "middleware.after(event, done)\n"
        "exporter = InMemorySpanExporter()\n"
        "provider = TracerProvider()\n"
        "provider.add_span_processor(SimpleSpanProcessor(exporter))\n"
        "trace.set_tracer_provider(provider)\n"
        "middleware.before(event)\n"
        "print(trace.get_current_span().get_span_context().trace_id == int(tp[3:35], 16))\n"
        "middleware.after(event, done)\n"
        "print([s.name for s in exporter.get_finished_spans()])\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False", "True", "['process t.x']"]


def test_once_an_sdk_is_set_up_spans_start_on_its_own_tracer() -> None:
    """A middleware built before the SDK (the CLI builds it before importing the app)
    holds the API's proxy tracer: once the SDK is found, spans start on the SDK's
    tracer itself, not through the proxy's extra call per span."""
    done = _child(
        "import sys\n"
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from conveyor.middleware import HandlerResult\n"
        "from conveyor.tracing import TracingMiddleware\n"
        "from conveyor.types import Event, EventState\n"
        "event = Event(id=7, topic='t.x', payload_text='{}')\n"
        "done = HandlerResult(EventState.SUCCEEDED, None, None, 0.001, None, True)\n"
        "middleware = TracingMiddleware()\n"
        "trace.set_tracer_provider(TracerProvider())\n"
        "middleware.before(event)\n"
        "middleware.after(event, done)\n"
        "called = set()\n"
        "sys.setprofile(lambda frame, kind, arg: kind == 'call'"
        " and called.add(frame.f_code.co_qualname))\n"
        "middleware.before(event)\n"
        "middleware.after(event, done)\n"
        "sys.setprofile(None)\n"
        "print(sorted(name for name in called if name.endswith('Tracer.start_span')))\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['Tracer.start_span']"]   # no ProxyTracer's


# ------------------------------------------------------------- head sampling

UNSAMPLED = trace.SpanContext(trace_id=0x5A5A, span_id=0x77, is_remote=False,
                              trace_flags=trace.TraceFlags(trace.TraceFlags.DEFAULT))
# W3C level 2's "random" flag, which the SDK sets on the ids it makes, and not sampled.
UNSAMPLED_RANDOM = trace.SpanContext(trace_id=0x5A5A, span_id=0x77, is_remote=False,
                                     trace_flags=trace.TraceFlags(0x02))


def test_enqueue_in_an_unsampled_span_carries_its_context_without_a_span(
        conn: psycopg.Connection[Any], spans: InMemorySpanExporter) -> None:
    with trace.use_span(trace.NonRecordingSpan(UNSAMPLED)):
        Producer().enqueue(conn, "trace.unsampled", {})
        Producer().enqueue_bulk(conn, [("trace.unsampled", {})] * 100)
    assert trace_columns(conn, "trace.unsampled") == {
        (f"00-{0x5A5A:032x}-{0x77:016x}-00", None)}
    assert spans.get_finished_spans() == ()


def _provider(sampler: Any, exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


@pytest.mark.parametrize("head", [UNSAMPLED, UNSAMPLED_RANDOM], ids=["flags-00", "flags-02"])
@pytest.mark.parametrize(("sampler", "recorded"), [
    ("parent_based", False),     # the head said no: no span, no SDK call
    ("always_on", True),         # a sampler that ignores the parent decides itself
])
def test_an_unsampled_producer_decides_the_process_span_when_the_sampler_follows_it(
        conn: psycopg.Connection[Any], sampler: str, recorded: bool,
        head: trace.SpanContext) -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    asked: list[str] = []

    class Counting(ParentBased):
        def should_sample(self, *args: Any, **kwargs: Any) -> Any:
            asked.append("asked")
            return super().should_sample(*args, **kwargs)

    exporter = InMemorySpanExporter()
    provider = _provider(Counting(ALWAYS_ON) if sampler == "parent_based" else ALWAYS_ON,
                         exporter)
    with trace.use_span(trace.NonRecordingSpan(head)):
        Producer().enqueue(conn, "trace.head", {})
    seen: list[trace.SpanContext] = []
    router = Router()
    repr_seen: list[str] = []

    def handle(event: Any) -> None:
        repr_seen.append(repr(trace.get_current_span()))
        seen.append(trace.get_current_span().get_span_context())

    router.add("trace.head", handle)
    assert work_event(conn, router, middleware=[TracingMiddleware(provider)]) is not None
    process = named(exporter, "process")
    assert len(process) == (1 if recorded else 0)
    assert seen[0].trace_id == 0x5A5A                 # the handler's calls carry the trace
    assert seen[0].trace_flags.sampled is recorded
    if sampler == "parent_based":
        assert asked == ["asked"]         # once, when the middleware was built: no span asked
        assert repr_seen[0].startswith("NonRecordingSpan(SpanContext(trace_id=0x")  # loggable


SAMPLED = trace.SpanContext(trace_id=0x6B6B, span_id=0x88, is_remote=False,
                            trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))


def test_an_unsampled_first_attempt_runs_no_hook_and_a_sampled_one_does(
        conn: psycopg.Connection[Any]) -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    hooks: list[str] = []

    class Counted(TracingMiddleware):
        def before(self, event: Any) -> None:
            hooks.append("before")
            super().before(event)

        def after(self, event: Any, result: Any) -> None:
            hooks.append("after")
            super().after(event, result)

    exporter = InMemorySpanExporter()
    middleware = Counted(_provider(ParentBased(ALWAYS_ON), exporter))
    seen: list[trace.SpanContext] = []
    router = Router()
    router.add("trace.quiet", lambda event: seen.append(trace.get_current_span().get_span_context()))
    with trace.use_span(trace.NonRecordingSpan(UNSAMPLED)):
        Producer().enqueue(conn, "trace.quiet", {})
    assert work_event(conn, router, middleware=[middleware]) is not None
    # Quiet: the producer's context current for the handler, and no hook called.
    assert hooks == []
    assert seen[0].trace_id == 0x5A5A and not seen[0].trace_flags.sampled
    with trace.use_span(trace.NonRecordingSpan(SAMPLED)):
        Producer().enqueue(conn, "trace.quiet", {})
    assert work_event(conn, router, middleware=[middleware]) is not None
    assert hooks == ["before", "after"]
    assert seen[1].trace_id == 0x6B6B and seen[1].trace_flags.sampled
    assert len(named(exporter, "process")) == 1


def test_only_a_parent_based_sampler_that_drops_unsampled_parents_is_followed() -> None:
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_ON,
        ParentBased,
        TraceIdRatioBased,
    )

    from conveyor.tracing import follows_unsampled_parents
    assert follows_unsampled_parents(TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.01))))
    assert follows_unsampled_parents(TracerProvider())   # the SDK's default sampler
    assert not follows_unsampled_parents(TracerProvider(sampler=ALWAYS_ON))
    assert not follows_unsampled_parents(TracerProvider(
        sampler=ParentBased(ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON)))
    assert not follows_unsampled_parents(trace.NoOpTracerProvider())
