"""Metrics, /healthz and /readyz of a real in-process worker against real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client import CollectorRegistry

from conveyor import BackoffPolicy, Event, Router, Worker
from conveyor.metrics import (
    DatabaseGauges,
    MetricsMiddleware,
    MetricsServer,
    WorkerCollector,
    metrics_app,
)
from reliability.helpers import BlackHoleProxy, via
from waiting import wait_until
from worker_support import enqueue, fast_config, running

SLOW = BackoffPolicy(base_delay=60, max_delay=60, jitter=0)


async def ok(event: Event) -> None:
    pass


async def boom(event: Event) -> None:
    raise ValueError("boom")


def build(db: str, **config: Any) -> tuple[Worker, CollectorRegistry]:
    router = Router()
    router.add("mail.ok", ok)
    router.add("mail.boom", boom)
    registry = CollectorRegistry()
    worker = Worker(db, router, fast_config(backoff=SLOW, **config),
                    middleware=[MetricsMiddleware(registry=registry)])
    registry.register(WorkerCollector(worker))
    return worker, registry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_outcome_counters_move_by_topic(db: str) -> None:
    worker, registry = build(db)
    async with running(worker):
        for _ in range(3):
            await enqueue(db, "mail.ok")
        await enqueue(db, "mail.boom", max_attempts=1)
        await enqueue(db, "mail.boom", max_attempts=5)

        async def counted() -> bool:
            return worker.stats.succeeded + worker.stats.failed + worker.stats.retried == 5
        await wait_until(counted, timeout=10, what="five outcomes acknowledged")
    total = "conveyor_events_handled_total"
    assert sample(registry, total, topic="mail.ok", outcome="succeeded") == 3
    assert sample(registry, total, topic="mail.boom", outcome="failed") == 1
    assert sample(registry, total, topic="mail.boom", outcome="retried") == 1
    assert sample(registry, "conveyor_handler_duration_seconds_count", topic="mail.ok") == 3
    assert sample(registry, "conveyor_queue_wait_seconds_count", topic="mail.boom") == 2
    assert sample(registry, "conveyor_worker_claimed_events_total") == 5


class _NoHooks(MetricsMiddleware):
    """Counts whatever reaches its hooks: a worker must feed it batches instead."""

    hooked = 0

    def after(self, event: Event, result: Any) -> None:
        self.hooked += 1
        super().after(event, result)


async def test_a_worker_counts_each_acknowledged_batch_and_runs_no_hook(db: str) -> None:
    router = Router()
    router.add("mail.ok", ok)
    registry = CollectorRegistry()
    metrics = _NoHooks(registry=registry)
    worker = Worker(db, router, fast_config(), middleware=[metrics])
    async with running(worker):
        for _ in range(4):
            await enqueue(db, "mail.ok")

        async def acknowledged() -> bool:
            return worker.stats.succeeded == 4
        await wait_until(acknowledged, timeout=10, what="four successes acknowledged")
    assert metrics.hooked == 0
    total = "conveyor_events_handled_total"
    assert sample(registry, total, topic="mail.ok", outcome="succeeded") == 4
    assert sample(registry, "conveyor_handler_duration_seconds_count", topic="mail.ok") == 4
    # Enqueued moments ago: every wait is under five seconds, none negative.
    assert sample(registry, "conveyor_queue_wait_seconds_bucket", topic="mail.ok", le="5.0") == 4
    assert 0 <= sample(registry, "conveyor_queue_wait_seconds_sum", topic="mail.ok") < 20


async def test_healthz_and_readyz_follow_the_life_cycle(db: str) -> None:
    worker, registry = build(db)
    transport = httpx.ASGITransport(app=metrics_app(worker, registry))
    async with httpx.AsyncClient(transport=transport, base_url="http://w") as client:
        assert (await client.get("/readyz")).status_code == 503
        assert (await client.get("/healthz")).status_code == 503
        async with running(worker):
            # Healthy and ready from the first claim round trip on.
            async def up() -> bool:
                return ((await client.get("/healthz")).status_code == 200
                        and (await client.get("/readyz")).status_code == 200)
            await wait_until(up, timeout=5, what="/healthz and /readyz 200")
            body = (await client.get("/metrics")).text
            assert "conveyor_worker_reconnects_total" in body
            worker.request_stop()
            assert (await client.get("/readyz")).status_code == 503
        response = await client.get("/healthz")
        assert response.status_code == 503
        assert "ended" in response.text


def test_metrics_server_rejects_a_bad_port_in_one_line(db: str) -> None:
    from conveyor.errors import InvalidInputError

    worker, registry = build(db)
    with pytest.raises(InvalidInputError, match="expected the metrics port to be 0-65535, "
                                                "got 70000"):
        MetricsServer(worker, registry, port=70000)


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_healthz_is_503_while_the_loop_is_blocked_past_the_lease(db: str) -> None:
    router = Router()

    async def blocking(event: Event) -> None:
        time.sleep(1.6)   # blocks the event loop past the 1 s lease

    router.add("mail.block", blocking)
    registry = CollectorRegistry()
    worker = Worker(db, router, fast_config(lease_ttl=1.0))
    server = MetricsServer(worker, registry, port=0).start()
    url = f"http://127.0.0.1:{server.port}/healthz"
    seen: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.1):
            seen.append(_get(url))

    try:
        async def healthy() -> bool:
            return await asyncio.to_thread(_get, url) == 200

        async with running(worker):
            await wait_until(healthy, timeout=5, what="/healthz 200")
            poller = threading.Thread(target=poll)
            poller.start()
            await enqueue(db, "mail.block")

            async def handled() -> bool:
                return worker.stats.claimed == 1 and worker.in_flight == 0
            await wait_until(handled, timeout=10, what="the blocking handler ended")
            stop.set()
            poller.join()
            assert 503 in seen, seen
            await wait_until(healthy, timeout=5, what="/healthz 200 again")
    finally:
        stop.set()
        server.stop()


async def test_database_gauges_are_read_by_one_process_at_a_time(db: str) -> None:
    await enqueue(db, "mail.ok")
    await enqueue(db, "mail.ok")
    await enqueue(db, "mail.boom", delay=3600)
    first, second = DatabaseGauges(db), DatabaseGauges(db)
    try:
        read = [await first.refresh_once(), await second.refresh_once()]
        assert read == [True, False]
        assert list(second.collect()) == []
        registry = CollectorRegistry()
        registry.register(first)
        assert sample(registry, "conveyor_events", topic="mail.ok", state="pending") == 2
        assert sample(registry, "conveyor_events", topic="mail.boom", state="scheduled") == 1
        assert sample(registry, "conveyor_oldest_due_age_seconds") >= 0
        await first.close()   # the holder exits: the other takes over on a later tick

        async def taken_over() -> bool:
            return await second.refresh_once()
        await wait_until(taken_over, timeout=5, what="the second refresher takes the lock")
    finally:
        await first.close()
        await second.close()


async def test_a_refresher_whose_server_stops_answering_reads_again_once_it_answers(
        db: str) -> None:
    # The refresher's connect and reads had no client-side bound: a server that
    # stopped answering (a half-open connection, which its statement_timeout
    # cannot end) held the pass for good, and the gauges were never read again
    # after the server came back.
    await enqueue(db, "mail.ok")
    target = psycopg.conninfo.conninfo_to_dict(db)
    proxy = BlackHoleProxy(str(target.get("host") or "127.0.0.1"), int(target.get("port") or 5432))
    await proxy.start()
    gauges = DatabaseGauges(via(db, proxy), interval=0.1, statement_timeout=0.5)
    stopping = asyncio.Event()
    refreshing = asyncio.create_task(gauges.run(stopping))
    try:
        await wait_until(lambda: _now(gauges.holds_lock), timeout=10, what="a first read")
        proxy.all_holed = True
        for pipe in proxy.pipes:
            pipe.holed = True
        await enqueue(db, "mail.ok")
        await wait_until(lambda: _now(not gauges.holds_lock), timeout=10,
                         what="the unanswered pass given up on")
        proxy.heal()
        registry = CollectorRegistry()
        registry.register(gauges)

        async def read_again() -> bool:
            return (gauges.holds_lock
                    and sample(registry, "conveyor_events", topic="mail.ok", state="pending") == 2)
        await wait_until(read_again, timeout=15, what="the gauges read again after the heal")
    finally:
        stopping.set()
        await asyncio.wait_for(refreshing, 10)
        await proxy.stop()


async def _now(value: bool) -> bool:
    return value


def test_conveyor_worker_serves_metrics_on_its_port(db: str, tmp_path: Any) -> None:
    import os
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "metrics_app.py").write_text(
        "from conveyor import Router\n\n\nasync def noop(event):\n    pass\n\n\n"
        "router = Router()\nrouter.add('metrics.noop', noop)\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    src = Path(__file__).resolve().parents[2] / "src"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join((str(src), str(tmp_path)))
    proc = subprocess.Popen(
        [sys.executable, "-c", "from conveyor.cli.main import main; raise SystemExit(main())",
         "--database-url", db, "worker", "--app", "metrics_app:router",
         "--metrics-port", str(port)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        status = 0
        while time.monotonic() < deadline and status != 200:
            time.sleep(0.2)
            with contextlib.suppress(OSError):
                status = _get(f"http://127.0.0.1:{port}/healthz")
        assert status == 200, proc.stderr.read() if proc.poll() is not None else status
        assert _get(f"http://127.0.0.1:{port}/readyz") == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            body = response.read().decode()
        assert "conveyor_worker_claims_total" in body
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert f"metrics on http://127.0.0.1:{port}/metrics" in stderr


def test_conveyor_worker_refuses_a_bad_metrics_port_in_one_line(db: str) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", "from conveyor.cli.main import main; raise SystemExit(main())",
         "--database-url", db, "worker", "--app", "x:y", "--metrics-port", "99999"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "expected a port 1-65535, got '99999'" in result.stderr
    assert "Traceback" not in result.stderr


def test_without_the_extra_the_import_fails_in_one_line() -> None:
    import subprocess
    import sys

    code = ("import sys\nsys.modules['prometheus_client'] = None\n"
            "try:\n    import conveyor.metrics\nexcept ImportError as exc:\n    print(exc)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == ("conveyor.metrics needs the 'metrics' extra: "
                                     "pip install 'conveyor[metrics]'")


def test_the_histograms_and_counter_match_prometheus_clients_own() -> None:
    """MetricsMiddleware keeps its own counts; fed the same values, prometheus_client's
    Counter and Histogram (the oracle) must expose the same samples."""
    import datetime

    from prometheus_client import Counter, Histogram

    from conveyor.metrics.middleware import DURATION_BUCKETS, WAIT_BUCKETS, MetricsMiddleware
    from conveyor.middleware import HandlerResult
    from conveyor.types import Event, EventState

    ours = CollectorRegistry()
    middleware = MetricsMiddleware(registry=ours, tenant_label=True)
    oracle = CollectorRegistry()
    handled = Counter("conveyor_events_handled_total", "x", ("topic", "tenant", "outcome"),
                      registry=oracle)
    took = Histogram("conveyor_handler_duration_seconds", "x", ("topic", "tenant"),
                     buckets=DURATION_BUCKETS, registry=oracle)
    created = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=42)
    cases = [("a.x", None, EventState.SUCCEEDED, True, 0.0005),
             ("a.x", None, EventState.SUCCEEDED, True, 0.001),      # on a bound: le="0.001"
             ("a.x", "acme", EventState.PENDING, True, 0.002),
             ("a.x", "acme", EventState.PENDING, False, 7.0),
             ("b.y", None, EventState.FAILED, True, 400.0)]         # past the last bound
    for topic, tenant, state, spent, duration in cases:
        event = Event(id=1, topic=topic, payload_text="{}", tenant=tenant, created_at=created)
        middleware.after(event, HandlerResult(state, None, None, duration, None, spent))
        outcome = ("retried" if spent else "snoozed") if state is EventState.PENDING else state
        handled.labels(topic, tenant or "", str(outcome)).inc()
        took.labels(topic, tenant or "").observe(duration)

    def samples(registry: CollectorRegistry, prefix: str) -> dict[tuple[Any, ...], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in registry.collect() for s in family.samples
                if s.name.startswith(prefix) and not s.name.endswith("_created")}

    for prefix in ("conveyor_events_handled", "conveyor_handler_duration_seconds"):
        assert samples(ours, prefix) == samples(oracle, prefix), prefix
    # The queue wait: a.x's two events were created 42 s before their handlers
    # started, in the (30, 60] bucket; b.y's 400 s call started before it was created.
    def wait_le(topic: str, le: str) -> float | None:
        return ours.get_sample_value("conveyor_queue_wait_seconds_bucket",
                                     {"topic": topic, "tenant": "", "le": le})
    assert (wait_le("a.x", "30.0"), wait_le("a.x", "60.0"), wait_le("a.x", "+Inf")) == (0, 2, 2)
    assert wait_le("b.y", str(WAIT_BUCKETS[0])) == 1
