"""worker-multi's metrics: every tenant database in one exposition, health across tenants."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from conveyor import Event, Producer, Router
from conveyor.metrics import metrics_app
from conveyor.metrics.tenants import TenantGauges, TenantsCollector
from conveyor.multitenant import MultiTenantConfig, MultiTenantWorker, TenantDatabase
from waiting import wait_until
from worker_support import fast_config


@pytest.fixture
def two_tenants(make_db: Callable[..., AbstractContextManager[str]],
                template_db: str) -> Iterator[dict[str, str]]:
    with make_db(prefix="conveyor_ta_", template=template_db) as a, \
            make_db(prefix="conveyor_tb_", template=template_db) as b:
        yield {"acme": a, "globex": b}


def _enqueue(url: str, topic: str, n: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        Producer().enqueue_many(conn, [(topic, {"i": i}) for i in range(n)])


def _samples(body: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    found = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            found[s.name, frozenset(s.labels.items())] = s.value
    return found


async def test_every_tenant_in_one_exposition_and_health_names_the_failing_one(
        two_tenants: dict[str, str]) -> None:
    async def ok(event: Event) -> None:
        pass

    router = Router()
    router.add("job.*", ok)
    multi = MultiTenantWorker([TenantDatabase(n, u) for n, u in two_tenants.items()], router,
                              MultiTenantConfig(worker=fast_config(query_timeout=1.0),
                                                rescan_interval=0.2))
    _enqueue(two_tenants["acme"], "job.a", 3)
    _enqueue(two_tenants["globex"], "job.b", 5)
    _enqueue(two_tenants["globex"], "later.b", 2)        # no route: stays pending
    registry = CollectorRegistry()
    gauges = TenantGauges(multi, "conveyor", interval=0.1)
    registry.register(TenantsCollector(multi, gauges.by_tenant))
    app = metrics_app(multi, registry)
    task = asyncio.create_task(multi.run())
    try:
        await asyncio.wait_for(multi.started.wait(), 20)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://m") as client:
            async def all_claimed() -> bool:
                await gauges.refresh_once()
                body = (await client.get("/metrics")).text
                got = _samples(body)
                return (got.get(("conveyor_worker_claimed_events_total",
                                 frozenset({("tenant", "acme")}))) == 3
                        and got.get(("conveyor_worker_claimed_events_total",
                                     frozenset({("tenant", "globex")}))) == 5)
            await wait_until(all_claimed, timeout=20, what="both tenants' claims counted")
            # Each read's connection is closed after it: none is held outside the budget.
            names = [psycopg.conninfo.conninfo_to_dict(u)["dbname"] for u in two_tenants.values()]

            def gauge_sessions() -> int:
                with psycopg.connect(two_tenants["acme"], autocommit=True) as c:
                    row = c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = ANY(%s)"
                                    " AND application_name = 'conveyor-metrics'",
                                    (names,)).fetchone()
                return row[0] if row else -1
            async def none_open() -> bool:
                return await asyncio.to_thread(gauge_sessions) == 0
            await wait_until(none_open, timeout=10, what="no gauge connection left open")
            body = (await client.get("/metrics")).text
            got = _samples(body)
            assert body.count("# TYPE conveyor_worker_claimed_events_total counter") == 1
            assert got["conveyor_tenant_worker_up", frozenset({("tenant", "acme")})] == 1
            assert got["conveyor_events", frozenset({("tenant", "globex"), ("topic", "later.b"),
                                                     ("state", "pending")})] == 2
            healthy = await client.get("/healthz")
            assert (healthy.status_code, healthy.text) == (200, "ok (2 tenants)\n")
            assert (await client.get("/readyz")).status_code == 200

            # globex's database stops taking connections and its sessions are cut.
            with psycopg.connect(two_tenants["acme"], autocommit=True) as admin:
                dbname = psycopg.conninfo.conninfo_to_dict(two_tenants["globex"])["dbname"]
                admin.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS false')
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,))
            try:
                async def globex_unhealthy() -> bool:
                    answer = await client.get("/healthz")
                    return answer.status_code == 503 and answer.text.startswith("globex: ")
                await wait_until(globex_unhealthy, timeout=20, what="/healthz turns 503 for globex")
                answer = (await client.get("/healthz")).text
                assert "acme" not in answer, answer
                ready = await client.get("/readyz")
                assert ready.status_code == 503 and "globex: worker not connected" in ready.text
            finally:
                with psycopg.connect(two_tenants["acme"], autocommit=True) as admin:
                    admin.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true')

            async def healthy_again() -> bool:
                return (await client.get("/healthz")).status_code == 200
            await wait_until(healthy_again, timeout=30, what="globex reconnects and is healthy")
    finally:
        multi.request_stop()
        await asyncio.wait_for(task, 30)
        stopped = asyncio.Event()
        stopped.set()
        await gauges.run(stopped)       # closes every gauge connection


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_conveyor_worker_multi_serves_every_tenant_on_its_port(two_tenants: dict[str, str],
                                                               tmp_path: Any) -> None:
    (tmp_path / "multi_app.py").write_text(
        "from conveyor import Router\n\n\nasync def noop(event):\n    pass\n\n\n"
        "router = Router()\nrouter.add('multi.*', noop)\n")
    _enqueue(two_tenants["acme"], "multi.x", 4)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    src = Path(__file__).resolve().parents[2] / "src"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join((str(src), str(tmp_path)))
    proc = subprocess.Popen(
        [sys.executable, "-c", "from conveyor.cli.main import main; raise SystemExit(main())",
         "worker-multi", "--app", "multi_app:router", "--poll-interval", "0.2",
         *(arg for name, url in two_tenants.items() for arg in ("--dsn", f"{name}={url}")),
         "--metrics-port", str(port)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        status, body = 0, ""
        while time.monotonic() < deadline and status != 200:
            time.sleep(0.2)
            with contextlib.suppress(OSError):
                status, body = _get(f"http://127.0.0.1:{port}/healthz")
        assert status == 200, proc.stderr.read() if proc.poll() is not None else (status, body)
        assert body == "ok (2 tenants)\n"
        deadline = time.monotonic() + 20
        got: dict[Any, float] = {}
        while time.monotonic() < deadline:
            got = _samples(_get(f"http://127.0.0.1:{port}/metrics")[1])
            if got.get(("conveyor_events_handled_total", frozenset({("topic", "multi.x"),
                                                             ("outcome", "succeeded")}))) == 4:
                break
            time.sleep(0.2)
        assert got[("conveyor_tenant_worker_up", frozenset({("tenant", "globex")}))] == 1
        assert got[("conveyor_worker_claimed_events_total", frozenset({("tenant", "acme")}))] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
