"""R15: NOTIFY hygiene. A notification is a hint: small, no tenant, no payload data,
few per transaction, and never from a transaction that rolled back."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from conveyor import AsyncProducer, NewEvent
from conveyor.admin import AsyncAdmin
from conveyor.db.named_queries import queries_for
from conveyor.db.wake_gate import WakeGate
from conveyor.errors import InvalidInputError
from conveyor.validation import TOPIC_MAX_LENGTH, check_topic

CHANNEL = "conveyor.events"
NOTIFY_MAX_BYTES = 128
SECRET = "canary-payload-7f3a9c"


class Ear:
    """A LISTEN session collecting every payload on the Conveyor channel, holding the
    wake gate as a waiting worker does (conveyor/db/wake_gate.py)."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.heard: list[str] = []

    async def drain(self, quiet: float = 0.5) -> list[str]:
        """Collect until ``quiet`` seconds pass without a notification."""
        while True:
            before = len(self.heard)
            async for n in self.conn.notifies(timeout=quiet):
                self.heard.append(n.payload)
            if len(self.heard) == before:
                return self.heard


@pytest.fixture
async def ear(fresh_db: str) -> AsyncIterator[Ear]:
    conn = await psycopg.AsyncConnection.connect(fresh_db, autocommit=True)
    try:
        await conn.execute(f'LISTEN "{CHANNEL}"')
        # A waiting worker holds the wake gate: producers send wake-ups only then.
        gate = WakeGate(queries_for("conveyor"))
        await gate.hold(conn)
        assert gate.whole
        yield Ear(conn)
    finally:
        await conn.close()


async def _in_tx(url: str, *, commit: bool, work: Any) -> Any:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        result = await work(conn)
        if commit:
            await conn.commit()
        else:
            await conn.rollback()
        return result


async def test_payload_is_a_small_topic_hint_without_tenant_or_payload_data(
        fresh_db: str, ear: Ear) -> None:
    producer = AsyncProducer()
    tenants = ["t1-acme", "initech", "z" * 63]

    async def work(conn: psycopg.AsyncConnection[Any]) -> None:
        for i, tenant in enumerate(tenants):
            await producer.enqueue(conn, "mail.send", {"secret": SECRET, "to": f"{tenant}@x"},
                                   tenant=tenant, idempotency_key=f"key-{SECRET}-{i}")
            await producer.enqueue(conn, "mail.later", {"secret": SECRET}, tenant=tenant,
                                   delay=3600 * (i + 1))
        await producer.enqueue_many(conn, [NewEvent(topic="bulk.x", payload={"s": SECRET},
                                                    tenant=tenants[i % 3]) for i in range(100)])
        await AsyncAdmin().retry_failed(conn)

    await _in_tx(fresh_db, commit=True, work=work)
    heard = await ear.drain()
    assert heard, "the committed events sent notifications"
    for payload in heard:
        assert len(payload.encode()) <= NOTIFY_MAX_BYTES, payload
        assert SECRET not in payload
        for tenant in tenants:
            assert tenant not in payload
        topic, _, due = payload.partition("|")
        assert topic in {"mail.send", "mail.later", "bulk.x", "*"}
        if due:
            float(due)
    print(f"\nR15 payloads heard: {sorted(set(heard), key=len)[-1]!r} is the longest "
          f"({max(len(p.encode()) for p in heard)} bytes)")


async def test_longest_allowed_topic_still_fits_the_notify_budget(fresh_db: str, ear: Ear) -> None:
    producer = AsyncProducer()
    # The longest valid topic (fixed in 07101b8: 200 characters gave 218-byte payloads).
    long_topic = ("a" * 49 + ".") * (TOPIC_MAX_LENGTH // 50 - 1) + "a" * 49
    long_topic += "b" * (TOPIC_MAX_LENGTH - len(long_topic))
    assert len(long_topic) == TOPIC_MAX_LENGTH

    async def work(conn: psycopg.AsyncConnection[Any]) -> None:
        await producer.enqueue(conn, long_topic, {})
        await producer.enqueue(conn, long_topic, {}, delay=86400.123)

    await _in_tx(fresh_db, commit=True, work=work)
    heard = await ear.drain()
    assert len(heard) == 2
    longest = max(len(p.encode()) for p in heard)
    print(f"\nR15a: a {TOPIC_MAX_LENGTH}-character topic, delayed a day: {longest}-byte payload")
    assert longest <= NOTIFY_MAX_BYTES
    with pytest.raises(InvalidInputError):
        check_topic(long_topic + "c")


@pytest.mark.parametrize("how", ["enqueue_many", "enqueue_loop"])
async def test_ten_thousand_events_in_one_transaction_send_one_notification_per_topic(
        fresh_db: str, ear: Ear, how: str) -> None:
    producer = AsyncProducer()
    topics = [f"bulk.t{i}" for i in range(7)]
    events = [NewEvent(topic=topics[i % len(topics)], payload={"i": i}) for i in range(10_000)]

    async def work(conn: psycopg.AsyncConnection[Any]) -> None:
        if how == "enqueue_many":
            await producer.enqueue_many(conn, events)
        else:
            for e in events:
                await producer.enqueue(conn, e.topic, e.payload)

    await _in_tx(fresh_db, commit=True, work=work)
    heard = await ear.drain()
    print(f"\nR15b {how}: 10,000 events of {len(topics)} topics -> {len(heard)} notifications")
    assert len(heard) <= len(topics)
    assert set(heard) == set(topics)


async def test_ten_thousand_delayed_events_in_one_statement_send_one_notification_per_topic(
        fresh_db: str, ear: Ear) -> None:
    producer = AsyncProducer()
    rng = random.Random(5)
    events = [NewEvent(topic=f"later.t{i % 5}", delay=rng.uniform(60, 3600)) for i in range(10_000)]
    await _in_tx(fresh_db, commit=True,
                 work=lambda conn: producer.enqueue_many(conn, events))
    heard = await ear.drain()
    assert len(heard) == 5
    # Each carries the earliest due time of its topic.
    assert all("|" in p for p in heard)


async def test_delayed_events_enqueued_one_by_one_in_one_transaction_notification_count(
        fresh_db: str, ear: Ear) -> None:
    # Measurement: every delayed enqueue carries its own due time, so PostgreSQL
    # cannot fold identical notifications: one per statement reaches the queue.
    producer = AsyncProducer()

    async def work(conn: psycopg.AsyncConnection[Any]) -> None:
        for i in range(1000):
            await producer.enqueue(conn, "later.loop", {}, delay=60 + i)

    await _in_tx(fresh_db, commit=True, work=work)
    heard = await ear.drain()
    print(f"\nR15b delayed one-by-one: 1,000 delayed enqueues in one transaction -> "
          f"{len(heard)} notifications")
    assert len(heard) <= 1000


@pytest.mark.parametrize("how", ["enqueue", "enqueue_many", "copy", "delayed", "admin_retry"])
async def test_rolled_back_transaction_sends_no_notification(fresh_db: str, ear: Ear,
                                                             how: str) -> None:
    producer = AsyncProducer()

    async def work(conn: psycopg.AsyncConnection[Any]) -> None:
        if how == "enqueue":
            await producer.enqueue(conn, "rb.one", {})
        elif how == "enqueue_many":
            await producer.enqueue_many(conn, [NewEvent(topic="rb.many", delay=1) for _ in range(10)])
        elif how == "copy":
            await producer.enqueue_many(conn, [NewEvent(topic="rb.copy") for _ in range(500)])
        elif how == "delayed":
            await producer.enqueue(conn, "rb.later", {}, delay=5)
        else:
            await producer.enqueue(conn, "rb.admin", {})
            await conn.execute("UPDATE conveyor.events SET state = 'failed'")
            await AsyncAdmin().retry_failed(conn)

    await _in_tx(fresh_db, commit=False, work=work)
    heard = await ear.drain(quiet=0.7)
    assert heard == []
    async with await psycopg.AsyncConnection.connect(fresh_db) as conn:
        rows = await (await conn.execute("SELECT count(*) FROM conveyor.events")).fetchone()
    assert rows == (0,)
    # The same work committed is heard at once: the ear was listening all along.
    await _in_tx(fresh_db, commit=True, work=work)
    assert await asyncio.wait_for(ear.drain(), 5)


async def test_notify_opt_out_is_per_transaction_and_events_still_run_by_poll(
        fresh_db: str, ear: Ear) -> None:
    from conveyor import Event, Worker
    from waiting import wait_until
    from worker_support import router_for

    from .helpers import fast_config

    producer = AsyncProducer()

    async def quiet(conn: psycopg.AsyncConnection[Any]) -> int:
        await conn.execute("SELECT set_config('conveyor.notify', 'off', true)")
        return await producer.enqueue(conn, "quiet.evt", {})

    quiet_id = await _in_tx(fresh_db, commit=True, work=quiet)
    assert await ear.drain() == []
    # The setting was LOCAL: the next transaction on a new or reused connection notifies.
    async with await psycopg.AsyncConnection.connect(fresh_db) as conn:
        await quiet(conn)
        await conn.commit()
        await producer.enqueue(conn, "loud.evt", {})
        await conn.commit()
    assert await ear.drain() == ["loud.evt"]
    started: list[int] = []

    async def handle(event: Event) -> None:
        started.append(event.id)

    worker = Worker(fresh_db, router_for("quiet.*", handle), fast_config(poll_interval=1.0))
    task = asyncio.create_task(worker.run())
    try:
        async def ran() -> bool:
            return quiet_id in started
        await wait_until(ran, timeout=5, what="the quiet event to run by polling")
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 10)
        await worker.close()
