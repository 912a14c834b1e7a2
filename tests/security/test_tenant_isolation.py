"""S1: tenant isolation. A worker limited to tenant T1 never claims, runs or
completes another tenant's event, whatever the mix; idempotency keys are per
tenant; NOTIFY payloads name no tenant."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import (
    AsyncCommittingProducer,
    AsyncProducer,
    BackoffPolicy,
    Event,
    NewEvent,
    Producer,
    Router,
    Worker,
    WorkerConfig,
)
from conveyor.admin import Admin
from schema_reset import empty_schema_async

TENANTS = [None, "tenant-one", "tenant-two", "tenant-three"]
T1 = "tenant-one"
TOPICS = ["iso.a", "iso.b", "other.c"]


def _config(**kw: Any) -> WorkerConfig:
    base: dict[str, Any] = dict(concurrency=20, batch_size=20, poll_interval=0.2, lease_ttl=2.0,
                                heartbeat_interval=0.5, rescue_interval=0.5, shutdown_timeout=2.0,
                                backoff=BackoffPolicy(base_delay=0.001, max_delay=0.001, jitter=0.0))
    base.update(kw)
    return WorkerConfig(**base)


MIXES = st.lists(st.tuples(st.sampled_from(TENANTS), st.sampled_from(TOPICS),
                           st.sampled_from(["ok", "fail", "retry"]), st.integers(0, 2)),
                 min_size=1, max_size=40)


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(MIXES)
def test_tenant_limited_worker_touches_only_its_tenant(fresh_db: str, mix: list[Any]) -> None:
    asyncio.run(_check_mix(fresh_db, mix))


async def _check_mix(url: str, mix: list[Any]) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await empty_schema_async(conn)
        await conn.execute('LISTEN "conveyor.events"')
        seen: list[tuple[str | None, int]] = []

        async def handle(event: Event) -> None:
            seen.append((event.tenant, event.id))
            if event.payload["how"] == "fail":
                raise RuntimeError("boom")

        router = Router()
        router.add("iso.*", handle)
        router.add("other.*", handle)
        async with AsyncCommittingProducer(url) as producer:
            await producer.enqueue_many([
                NewEvent(topic=topic, tenant=tenant, payload={"how": how}, max_attempts=2,
                         priority=prio) for tenant, topic, how, prio in mix])
        worker = Worker(url, router, _config(tenants=(T1,)))
        try:
            for _ in range(20):
                if await worker.run_once() == 0:
                    break
        finally:
            await worker.close()
        notes = [n.payload async for n in conn.notifies(timeout=0.05)]
        rows = await (await conn.execute(
            "SELECT tenant, state, attempts, lease_owner, COALESCE(errors, '[]')"  # 0020: NULL, none
            " FROM conveyor.events")).fetchall()
    assert all(tenant == T1 for tenant, _ in seen), seen
    for tenant, state, attempts, owner, errors in rows:
        if tenant != T1:
            assert (state, attempts, owner, errors) == ("pending", 0, None, []), tenant
        else:
            assert attempts >= 1
    for payload in notes:
        assert not any(t and t in payload for t in TENANTS), payload


async def test_running_tenant_worker_among_many_tenants(fresh_db: str) -> None:
    # The full loop (LISTEN, polls, acks, heartbeats), not just run_once.
    seen: list[str | None] = []

    async def handle(event: Event) -> None:
        seen.append(event.tenant)

    router = Router()
    router.add("iso.*", handle)
    worker = Worker(fresh_db, router, _config(tenants=(T1, "tenant-three")))
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.started.wait(), 10)
        async with AsyncCommittingProducer(fresh_db) as producer:
            for i in range(200):
                await producer.enqueue("iso.a", {}, tenant=TENANTS[i % 4])

        async def done() -> bool:
            return len(seen) >= 100
        deadline = time.monotonic() + 60     # bounds a failure; a loaded machine is slow
        while not await done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 10)
        await worker.close()
    assert sorted(set(seen), key=str) == [T1, "tenant-three"]
    assert len(seen) == 100
    admin = Admin()
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        counts = admin.status(conn).counts
    assert counts["succeeded"] == 100 and counts["pending"] == 100


def test_idempotency_keys_are_per_tenant(conn: psycopg.Connection[Any]) -> None:
    p = Producer()
    key = "order-42"
    ids = {t: p.enqueue(conn, "iso.key", {"t": t}, tenant=t, idempotency_key=key) for t in TENANTS}
    assert len(set(ids.values())) == len(TENANTS), "one event per tenant for the same key"
    for t in TENANTS:
        assert p.enqueue(conn, "iso.key", {"again": True}, tenant=t, idempotency_key=key) == ids[t]
    again = p.enqueue_many(conn, [NewEvent(topic="iso.key", tenant=t, idempotency_key=key)
                                  for t in TENANTS])
    assert again == [ids[t] for t in TENANTS]
    rows = conn.execute("SELECT tenant, payload FROM conveyor.events WHERE idempotency_key = %s",
                        (key,)).fetchall()
    assert {r[0]: r[1] for r in rows} == {t: {"t": t} for t in TENANTS}


async def test_async_idempotency_keys_are_per_tenant(aconn: psycopg.AsyncConnection[Any]) -> None:
    p = AsyncProducer()
    a = await p.enqueue(aconn, "iso.key", {}, tenant="tenant-one", idempotency_key="k")
    b = await p.enqueue(aconn, "iso.key", {}, tenant="tenant-two", idempotency_key="k")
    assert a != b
    assert await p.enqueue(aconn, "iso.key", {}, tenant="tenant-one", idempotency_key="k") == a


@pytest.mark.parametrize("tenants", [(), "tenant-one", ("Tenant",), ("a" * 64,), ("t;drop",)])
def test_tenant_filter_is_validated(tenants: Any) -> None:
    from conveyor.errors import ConfigError
    with pytest.raises(ConfigError):
        WorkerConfig(tenants=tenants)


async def test_tenant_limited_worker_rescue_requeues_but_never_runs_another_tenants_event(
        fresh_db: str) -> None:
    # Rescue is deliberately tenant-blind (any live worker brings back a dead
    # worker's events). It may change a foreign row's state (running -> pending),
    # never its payload, and the event then runs only on a worker of its tenant.
    seen: list[str | None] = []

    async def handle(event: Event) -> None:
        seen.append(event.tenant)

    router = Router()
    router.add("iso.*", handle)
    async with AsyncCommittingProducer(fresh_db) as producer:
        event_id = await producer.enqueue("iso.a", {"secret": 1}, tenant="tenant-two")
    async with await psycopg.AsyncConnection.connect(fresh_db, autocommit=True) as conn:
        await conn.execute(
            "UPDATE conveyor.events SET state = 'running', attempts = 1, lease_owner = gen_random_uuid(), "
            "lease_expires_at = now() - interval '1 minute' WHERE id = %s", (event_id,))
    worker = Worker(fresh_db, router, _config(tenants=(T1,)))
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.started.wait(), 30)
        deadline = time.monotonic() + 60     # bounds a failure; a loaded machine is slow
        while not worker.stats.rescued and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 10)
        await worker.close()
    async with await psycopg.AsyncConnection.connect(fresh_db) as conn:
        row = await (await conn.execute("SELECT state, payload, tenant FROM conveyor.events "
                                        "WHERE id = %s", (event_id,))).fetchone()
    print(f"\nS1 rescue: a tenant-one worker rescued {worker.stats.rescued} tenant-two event(s)")
    assert seen == []
    assert row == ("pending", {"secret": 1}, "tenant-two")
