"""The per-event work of a drain, counted rather than timed.

Timings on a shared machine move by half from run to run; the counts here do
not (what each is worth: docs/benchmarks.md). A drain runs
``MetricsMiddleware.after`` and ``TracingMiddleware``'s hooks once per event:
the profiler counts every call into a Python function and every call of a
built-in made while a hook runs. Each event is claimed and acknowledged by
the worker's own statements: pg_walinspect counts the WAL their
transactions write (tests/wal_support.py), whatever else the server does.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from types import FrameType
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from prometheus_client import CollectorRegistry

from conveyor import NewEvent, Producer, ProducerConfig
from conveyor.db.named_queries import queries_for
from conveyor.metrics.middleware import MetricsMiddleware
from conveyor.middleware import HandlerResult, Middleware
from conveyor.patterns import sql_params
from conveyor.producer_core import prepare_one
from conveyor.retry import BackoffPolicy
from conveyor.router import Router
from conveyor.tracing import TracingMiddleware
from conveyor.types import CLAIM_COLUMNS, Event, EventState
from conveyor.worker.acks import ack
from conveyor.worker.classify import Outcome, success
from conveyor.worker.executor import Executor
from conveyor.worker.running import RunningSet
from conveyor_tools.bench import baseline
from wal_support import OwnWal

CREATED = datetime(2026, 1, 1, tzinfo=UTC)
SUCCESS = HandlerResult(EventState.SUCCEEDED, None, None, 0.0004, None, True)


def event(n: int = 1, **fields: Any) -> Event:
    return Event(id=n, topic="orders.placed", payload_text="{}", created_at=CREATED, **fields)


def counting(seen: Counter[str], counts: Callable[[], bool] = lambda: True
             ) -> Callable[[FrameType, str, Any], None]:
    """A profile function adding to ``seen`` every call into a Python function and
    every call of a built-in, by name, made while ``counts()`` says so."""
    def profile(frame: FrameType, kind: str, arg: Any) -> None:
        if kind == "call" and counts():
            seen[frame.f_code.co_name] += 1
        elif kind == "c_call" and counts():
            seen[getattr(arg, "__name__", "?")] += 1
    return profile


def calls(hook: Callable[..., object], *args: Any) -> Counter[str]:
    """The calls ``hook(*args)`` makes, by function name (built-ins too), itself not counted."""
    seen: Counter[str] = Counter()
    sys.setprofile(counting(seen))
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


def test_tracing_quiet_of_an_unsampled_attempt_only_makes_its_context_current() -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    middleware = TracingMiddleware(TracerProvider(sampler=ParentBased(ALWAYS_ON)))
    claimed = event(traceparent=f"00-{0x5A5A:032x}-{0x77:016x}-00")
    context = contextvars.copy_context()
    made = context.run(calls, middleware.quiet, claimed)
    assert not made["start_span"] and not made["should_sample"], made
    # The unsampled span, the context it is current in, and the attach: eight
    # calls, no traceparent parsed, no span started, no sampler asked.
    assert sum(made.values()) <= 8, made
    current = context.run(trace.get_current_span)
    assert current.get_span_context().trace_id == 0x5A5A


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


Q = queries_for("conveyor")
OWNER = "7f3c2a64-1d5e-4b8e-9c1a-3e2f4d5c6b7a"


def _claim_params(batch: int) -> dict[str, object]:
    return {**sql_params(["*"]), "all_tenants": True, "tenants": [], "limit": batch,
            "owner": OWNER, "lease_ttl": 30.0}


def _backlog(conn: psycopg.Connection, url: str, events: int) -> None:
    """``events`` no-op events committed and analyzed, as a drain finds them."""
    Producer().enqueue_bulk(conn, [NewEvent(topic="bench.noop", payload={"i": i})
                                   for i in range(events)])
    conn.commit()
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("VACUUM (ANALYZE) conveyor.events")


def drain_wal(conn: psycopg.Connection, batches: int, batch: int, *,
              delete_succeeded: bool = False) -> tuple[float, float]:
    """WAL bytes per event of the claims, and of the acknowledgements, of ``batches`` batches."""
    claims, acks = OwnWal(conn), OwnWal(conn)
    params = _claim_params(batch)
    for _ in range(batches):
        rows = conn.execute(Q["event_claim"], params).fetchall()
        assert len(rows) == batch
        claims.mark()
        conn.commit()
        events = [Event._from_claim_row(row[:len(CLAIM_COLUMNS)]) for row in rows]
        plan = ack(Q, OWNER, [success(e) for e in events], delete_succeeded=delete_succeeded)
        (statement,) = plan.statements
        assert len(conn.execute(*statement).fetchall()) == batch
        acks.mark()
        conn.commit()
    events = batches * batch
    return claims.bytes() / events, acks.bytes() / events


def raw_drain_wal(conn: psycopg.Connection, batches: int, batch: int, finish: str) -> float:
    """WAL bytes per event of the raw baseline's claim and finish (benchmark's baseline.py)."""
    conn.execute("CREATE SCHEMA raw")
    baseline.create_table(conn, "raw")
    baseline.copy_rows(conn, "raw", (("bench.noop", f'{{"i": {i}}}') for i in range(batches * batch)))
    conn.commit()
    wal = OwnWal(conn)
    claim, done = baseline.claim_sql("raw"), baseline.finish_sql("raw", finish)
    for _ in range(batches):
        ids = [r[0] for r in conn.execute(claim, (batch,)).fetchall()]
        wal.mark()
        conn.commit()
        conn.execute(done, (ids,))
        wal.mark()
        conn.commit()
    return wal.bytes() / (batches * batch)


def test_preparing_the_common_event_makes_at_most_twelve_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A known topic and a payload, every option at its default: the payload's
    # encoding and the row, no NewEvent and no check of an option left at its
    # default (the full checks made 26 calls). The topics known so far, of
    # this process's own: other tests may have filled the shared set to its
    # cap (KNOWN_TOPICS_MAX), past which no topic is added.
    monkeypatch.setattr("conveyor.producer_core.KNOWN_TOPICS", {"orders.placed"})
    config = ProducerConfig()
    made = calls(lambda: prepare_one(config, "orders.placed", {"n": 1}, tenant=None,
                                     idempotency_key=None, delay=0.0, priority=0,
                                     max_attempts=None, run_at=None))
    assert sum(made.values()) <= 12, made
    assert "NewEvent" not in made and "check_priority" not in made


@pytest.mark.parametrize("delete_succeeded", [False, True], ids=["mark", "delete"])
def test_a_drained_event_writes_at_most_its_measured_wal(fresh_db: str,
                                                        delete_succeeded: bool) -> None:
    with psycopg.connect(fresh_db) as conn:
        _backlog(conn, fresh_db, 1_000)
        claim, acknowledge = drain_wal(conn, 10, 100, delete_succeeded=delete_succeeded)
        raw = raw_drain_wal(conn, 10, 100, "delete" if delete_succeeded else "mark")
    print(f"\nWAL per event: claim {claim:.1f}, acknowledgement {acknowledge:.1f}, raw {raw:.1f}")
    # 2026-12-03, full-page images left out (wal_support): a claim writes
    # 418-436 bytes per event (its row lock, the new row version and its primary
    # key and events_lease_idx entries); a success marked 330-366 (the row
    # version, its primary key and events_prunable_idx entries), one deleted 54.
    # The raw loop's claim and finish of the same events: 610 bytes marked,
    # 389-408 deleted (so 1.24-1.31 and 1.13-1.21 times as much here; the target
    # is 1.1). What moves between runs is page pruning and index page splits,
    # which follow what else the server holds open; the bounds leave room for
    # that, and more than that is a new cost.
    assert claim <= 470, claim
    assert acknowledge <= (75 if delete_succeeded else 395), acknowledge
    assert (claim + acknowledge) / raw <= (1.3 if delete_succeeded else 1.36), (claim, acknowledge,
                                                                                raw)


def held_drain_wal(conn: psycopg.Connection, batches: int, batch: int, *,
                   delete_succeeded: bool = False) -> float:
    """WAL bytes per event of ``batches`` claim windows (worker/window.py): the held
    claim, the held acknowledgement and the window's commit, one transaction each."""
    wal = OwnWal(conn)
    params = _claim_params(batch)
    for _ in range(batches):
        rows = conn.execute(Q["event_claim_held"], params).fetchall()
        assert len(rows) == batch
        events = [Event._from_claim_row(row) for row in rows]
        plan = ack(Q, OWNER, [success(e) for e in events], delete_succeeded=delete_succeeded,
                   held=True)
        (statement,) = plan.statements
        assert len(conn.execute(*statement).fetchall()) == batch
        wal.mark()
        conn.commit()
    return wal.bytes() / (batches * batch)


@pytest.mark.parametrize("delete_succeeded", [False, True], ids=["mark", "delete"])
def test_an_event_drained_in_a_claim_window_is_written_once(fresh_db: str,
                                                           delete_succeeded: bool) -> None:
    with psycopg.connect(fresh_db) as conn:
        _backlog(conn, fresh_db, 2_000)
        held = held_drain_wal(conn, 10, 100, delete_succeeded=delete_succeeded)
        claim, acknowledge = drain_wal(conn, 10, 100, delete_succeeded=delete_succeeded)
    print(f"\nWAL per event: held {held:.1f}, leased {claim + acknowledge:.1f}")
    # 2026-12-04, full-page images left out: the leased claim and success write
    # the row twice (a new version and its index entries each time), 759 bytes
    # an event marked, 474 deleted; a window locks the row (a small record) and
    # writes it once, 414 and 108 (docs/held-claims.md).
    bound = 0.3 if delete_succeeded else 0.6
    assert held <= bound * (claim + acknowledge), (held, claim, acknowledge)


def test_an_after_only_middleware_adds_few_calls_to_an_inline_handler_call() -> None:
    # A hook with no ``before`` of its own is entered without a step to run:
    # with a generator for it, metrics added 24 calls to each inline call
    # (20 now); its own after() makes seven of them.
    async def extra_calls() -> int:
        made = []
        for middleware in ((), (MetricsMiddleware(registry=CollectorRegistry()),)):
            router = Router()
            router.add("orders.placed", lambda event: None, blocking=False)
            running = RunningSet(10)
            executor = Executor(router, running, lambda outcome: None, handler_timeout=5.0,
                                backoff=BackoffPolicy(), threads=1, middleware=middleware)
            claimed = [event(n) for n in (1, 2)]
            running.take(claimed)
            executor.start(claimed[:1])       # the first call makes the series
            made.append(sum(calls(executor.start, claimed[1:]).values()))
            executor.close()
        return made[1] - made[0]
    assert asyncio.run(extra_calls()) <= 20


def test_hooks_that_await_nothing_cost_a_call_no_generator_or_coroutine() -> None:
    # Each hook phase was a generator stepped by a coroutine of its own: with a
    # before and an after, two of each per call, a third of the hook path's cost.
    class Both(Middleware):
        def before(self, event: Event) -> None:
            pass

        def after(self, event: Event, result: HandlerResult) -> None:
            pass

    resumable = inspect.CO_GENERATOR | inspect.CO_COROUTINE

    async def resumable_frames(middleware: tuple[Middleware, ...]) -> int:
        async def handler(event: Event) -> None:
            pass

        router = Router()
        router.add("orders.placed", handler)
        running = RunningSet(10)
        executor = Executor(router, running, lambda outcome: None, handler_timeout=5.0,
                            backoff=BackoffPolicy(), threads=1, middleware=middleware)
        claimed = [event(n) for n in (1, 2)]
        running.take(claimed)
        made = 0

        def profile(frame: FrameType, kind: str, arg: Any) -> None:
            nonlocal made
            # Conveyor's own: not whatever asyncio or a collection runs meanwhile.
            if kind == "call" and frame.f_code.co_flags & resumable \
                    and "/conveyor/" in frame.f_code.co_filename:
                made += 1

        for one in claimed:
            sys.setprofile(profile if one is claimed[1] else None)
            executor.start([one])
            await asyncio.gather(*running.unfinished_tasks())
            sys.setprofile(None)
        executor.close()
        return made

    async def extra() -> int:
        return await resumable_frames((Both(),)) - await resumable_frames(())
    assert asyncio.run(extra()) == 0


async def calls_in_tasks(start: Callable[[], None], running: RunningSet) -> Counter[str]:
    """The calls the handlers' tasks make, by function name (built-ins too), from
    ``start()`` (where an eager task runs its first step) until every one ends;
    not this coroutine's, nor the loop's rounds around them."""
    outer = asyncio.current_task()
    seen: Counter[str] = Counter()
    sys.setprofile(counting(seen, lambda: asyncio.current_task() not in (None, outer)))
    try:
        start()
        await asyncio.gather(*running.unfinished_tasks())
    finally:
        sys.setprofile(None)
    return seen


async def second_call(sink: Callable[[Outcome], None] = lambda outcome: None,
                      **executor_args: Any) -> Counter[str]:
    """The calls of the task of the second no-op async handler call an executor
    starts (the first makes what is made once, a metrics series say)."""
    async def handler(event: Event) -> None:
        pass

    router = Router()
    router.add("orders.placed", handler)
    running = RunningSet(10)
    executor = Executor(router, running, sink, handler_timeout=5.0, backoff=BackoffPolicy(),
                        threads=1, **executor_args)
    claimed = [event(n) for n in (1, 2)]
    running.take(claimed)
    try:
        executor.start(claimed[:1])
        await asyncio.gather(*running.unfinished_tasks())
        seen = await calls_in_tasks(functools.partial(executor.start, claimed[1:]), running)
    finally:
        executor.close()
    assert seen["handler"] == 1, seen
    return seen


def test_an_after_only_middleware_adds_few_calls_to_an_async_handler_call() -> None:
    # A one-event call enters its after-only hooks through a list every call
    # shares and hands them its one result directly: metrics added 17 calls to
    # each task's run (14 now); its own after() makes seven of them.
    async def extra_calls() -> int:
        plain = await second_call()
        hooked = await second_call(middleware=[MetricsMiddleware(registry=CollectorRegistry())])
        return sum(hooked.values()) - sum(plain.values())
    assert asyncio.run(extra_calls()) <= 14


def _started_into(stamped: list[float | None], outcome: Outcome) -> None:
    stamped.append(getattr(outcome, "started", None))


def test_a_worker_times_each_call_for_its_metrics_in_three_calls() -> None:
    # A worker hands MetricsMiddleware each acknowledged batch (observe_settled)
    # and runs none of its hooks: what its tasks pay is two clock readings and
    # the stamp (the hooks' path above cost them 14 calls).
    async def extra_calls() -> int:
        untimed: list[float | None] = []
        timed: list[float | None] = []
        plain = await second_call(functools.partial(_started_into, untimed))
        stamped = await second_call(functools.partial(_started_into, timed), timed=True)
        assert untimed == [None, None] and None not in timed and len(timed) == 2, (untimed, timed)
        return sum(stamped.values()) - sum(plain.values())
    assert asyncio.run(extra_calls()) <= 3


def test_metrics_observe_a_batch_in_five_calls_an_event(metrics: MetricsMiddleware) -> None:
    # The lock once a batch; per event its count, a look-up and two bucket searches.
    now = time.monotonic()
    batch = [(event(n), Outcome(n, 1, EventState.SUCCEEDED)) for n in range(2, 102)]
    for _, outcome in batch:
        outcome.started, outcome.duration = now, 0.0004
    made = calls(metrics.observe_settled, batch)
    assert sum(made.values()) <= 4 + 5 * len(batch), made
    handled, duration, wait = metrics.collect()
    assert [(s.labels["outcome"], s.value) for s in handled.samples] == [("succeeded", 101)]
    counts = {s.name: s.value for s in duration.samples if not s.labels.get("le")}
    assert counts["conveyor_handler_duration_seconds_count"] == 101
    waits = {s.name: s.value for s in wait.samples if not s.labels.get("le")}
    assert waits["conveyor_queue_wait_seconds_sum"] > 101 * 86400   # enqueued long ago
