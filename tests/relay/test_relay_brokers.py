"""The relay against the real brokers of this machine: NATS JetStream (4222),
RabbitMQ (5672) and Redis (6379). Every test names its own stream, exchange
or keys and removes them; nothing here stops or fills those servers (the
fault tests run private instances: test_relay_faults.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from conveyor import BackoffPolicy, NewEvent, PublishRejectedError, Worker
from conveyor.relay import (
    NatsPublisher,
    RabbitMQPublisher,
    RedisStreamPublisher,
    Relay,
    RelayMessage,
)
from worker_support import (
    enqueue_many,
    fast_config,
    query,
    running,
    wait_all_in,
    wait_until,
)

NATS_URL = "nats://127.0.0.1:4222"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
REDIS_URL = "redis://127.0.0.1:6379/0"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def db(fresh_db: str) -> str:
    return fresh_db


def _events(n: int, topic: str = "order.created", max_attempts: int = 5) -> list[NewEvent]:
    return [NewEvent(topic=topic, payload={"n": i, "text": "é"}, tenant=f"t{i % 3}",
                     max_attempts=max_attempts) for i in range(n)]


async def _relay_all(db: str, relay: Relay, n: int, **route_options: Any) -> dict[int, str]:
    async with relay, running(Worker(db, relay.router(**route_options), fast_config(concurrency=20))):
        return await wait_all_in(db, {"succeeded", "failed"}, timeout=20)


async def _ids(db: str) -> list[int]:
    return [r["id"] for r in await query(db, "SELECT id FROM conveyor.events ORDER BY id")]


# ------------------------------------------------------------------ NATS

async def test_nats_stores_each_event_once_with_its_headers_and_replay_adds_nothing(
        db: str) -> None:
    import nats

    name = f"T{uuid.uuid4().hex[:12]}"
    publisher = NatsPublisher(NATS_URL, stream=name, subjects=[f"{name}.>"])
    relay = Relay()
    relay.route("order.*", publisher, destination=name + ".{tenant}.{topic}")
    await enqueue_many(db, _events(30))
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        await conn.execute("UPDATE conveyor.events SET traceparent = %s WHERE id = 1",
                           (TRACEPARENT,))
    nc = await nats.connect(NATS_URL)
    try:
        states = await _relay_all(db, relay, 30)
        assert set(states.values()) == {"succeeded"}
        js = nc.jetstream()
        info = await js.stream_info(name)
        assert info.state.messages == 30 and info.config.duplicate_window == 120
        seen = {}
        for seq in range(1, 31):
            msg = await js.get_msg(name, seq)
            headers = msg.headers or {}
            seen[int(headers["Nats-Msg-Id"])] = (msg.subject, headers, json.loads(msg.data))
        assert sorted(seen) == await _ids(db)
        subject, headers, payload = seen[1]
        assert subject == f"{name}.t0.order.created"
        assert payload == {"n": 0, "text": "é"}
        assert headers["conveyor-topic"] == "order.created"
        assert headers["conveyor-tenant"] == "t0" and headers["conveyor-attempt"] == "1"
        assert headers["conveyor-event-id"] == "1" and headers["traceparent"] == TRACEPARENT
        # Every event again: the same ids inside the duplicate window store nothing.
        async with relay, await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            replayed = await relay.replay(
                conn, since=datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5))
        assert replayed == 30 and publisher.duplicates == 30
        assert (await js.stream_info(name)).state.messages == 30
    finally:
        await nc.jetstream().delete_stream(name)
        await nc.close()


async def test_nats_refuses_a_subject_outside_the_stream_and_parks_after_the_attempts(
        db: str) -> None:
    import nats

    name = f"T{uuid.uuid4().hex[:12]}"
    relay = Relay()
    relay.route("order.*", NatsPublisher(NATS_URL, stream=name, subjects=[f"{name}.>"]),
                destination="elsewhere.{topic}")
    await enqueue_many(db, _events(2, max_attempts=2))
    try:
        states = await _relay_all(db, relay, 2)
        assert set(states.values()) == {"failed"}
        rows = await query(db, "SELECT attempts, last_error FROM conveyor.events")
        assert all(r["attempts"] == 2 for r in rows)
        assert all("refused 'elsewhere.order.created'" in r["last_error"] for r in rows), rows
    finally:
        nc = await nats.connect(NATS_URL)
        await nc.jetstream().delete_stream(name)
        await nc.close()


async def test_nats_refuses_a_stream_that_forgets_ids_too_soon() -> None:
    import nats
    from nats.js.api import StreamConfig

    from conveyor import ConfigError

    name = f"T{uuid.uuid4().hex[:12]}"
    nc = await nats.connect(NATS_URL)
    try:
        await nc.jetstream().add_stream(StreamConfig(name=name, subjects=[f"{name}.>"],
                                                     duplicate_window=10))
        publisher = NatsPublisher(NATS_URL, stream=name, subjects=[f"{name}.>"])
        with pytest.raises(ConfigError, match=f"stream '{name}' remembers message ids for 10s, "
                                              "the relay needs at least 120s"):
            await publisher.start()
    finally:
        await nc.jetstream().delete_stream(name)
        await nc.close()


async def test_nats_refuses_a_stream_it_cannot_create_in_one_line() -> None:
    import nats
    from nats.js.api import StreamConfig

    from conveyor import ConfigError

    taken = f"T{uuid.uuid4().hex[:12]}"
    nc = await nats.connect(NATS_URL)
    try:
        await nc.jetstream().add_stream(StreamConfig(name=taken, subjects=[f"{taken}.>"]))
        publisher = NatsPublisher(NATS_URL, stream=f"{taken}B", subjects=[f"{taken}.>"])
        with pytest.raises(ConfigError, match=f"NATS refused stream '{taken}B': .*overlap"):
            await publisher.start()
    finally:
        await nc.jetstream().delete_stream(taken)
        await nc.close()


class FlakyFirstTry:
    """A publisher that refuses every fifth event's first attempt, then passes it on."""

    def __init__(self, inner: NatsPublisher) -> None:
        self.inner = inner
        self.name = inner.name
        self.refused: set[int] = set()

    async def start(self) -> None:
        await self.inner.start()

    async def publish(self, message: RelayMessage) -> None:
        if message.event_id % 5 == 0 and message.event_id not in self.refused:
            self.refused.add(message.event_id)
            raise PublishRejectedError("refused once, for the test")
        await self.inner.publish(message)

    def check_destination(self, destination: str) -> str | None:
        return self.inner.check_destination(destination)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_nats_per_key_stores_each_tenants_events_in_order_despite_retries(db: str) -> None:
    import nats

    name = f"T{uuid.uuid4().hex[:12]}"
    publisher = FlakyFirstTry(NatsPublisher(NATS_URL, stream=name, subjects=[f"{name}.>"]))
    relay = Relay()
    relay.route("order.*", publisher, destination=name + ".{tenant}", mode="per_key")
    await enqueue_many(db, _events(90))
    nc = await nats.connect(NATS_URL)
    try:
        async with relay, running(Worker(db, relay.router(backoff=BackoffPolicy(
                base_delay=0.05, max_delay=0.05, jitter=0)), fast_config(concurrency=20))), \
                running(Worker(db, relay.router(), fast_config(concurrency=20))):
            await wait_all_in(db, {"succeeded"}, timeout=30)
        js = nc.jetstream()
        stored: dict[str, list[int]] = {}
        for seq in range(1, 91):
            msg = await js.get_msg(name, seq)
            stored.setdefault(msg.subject, []).append(int((msg.headers or {})["Nats-Msg-Id"]))
        assert len(publisher.refused) == 18
        assert sorted(stored) == [f"{name}.t0", f"{name}.t1", f"{name}.t2"]
        for ids in stored.values():
            # The stream's order per tenant is the events' order, retries and all.
            assert ids == sorted(ids) and len(ids) == 30
    finally:
        await nc.jetstream().delete_stream(name)
        await nc.close()


async def test_nats_a_full_stream_makes_events_wait_and_spends_no_attempt(db: str) -> None:
    import nats
    from nats.js.api import DiscardPolicy, StreamConfig

    name = f"T{uuid.uuid4().hex[:12]}"
    config = StreamConfig(name=name, subjects=[f"{name}.>"], max_bytes=3000,
                          discard=DiscardPolicy.NEW, duplicate_window=120)
    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    await js.add_stream(config)
    relay = Relay()
    relay.route("order.*", NatsPublisher(NATS_URL, stream=name, subjects=[f"{name}.>"]),
                destination=name + ".{topic}")
    # One attempt each: a refusal counted as a failed attempt would park the event.
    ids = await enqueue_many(db, _events(30, max_attempts=1))
    try:
        async with relay, running(Worker(db, relay.router(), fast_config(concurrency=20))):
            async def full() -> bool:
                return (await js.stream_info(name)).state.bytes > 2000 and (
                    await query(db, "SELECT count(*) AS n FROM conveyor.events"
                                    " WHERE state = 'pending' AND run_at > now()"))[0]["n"] > 0
            await wait_until(full, timeout=15, what="the stream full and events waiting")
            stored = (await js.stream_info(name)).state.messages
            assert 0 < stored < 30
            [row] = await query(db, "SELECT count(*) FILTER (WHERE state = 'failed') AS failed,"
                                    " max(attempts) FILTER (WHERE state = 'pending') AS spent"
                                    " FROM conveyor.events")
            assert row == {"failed": 0, "spent": 0}
            await js.update_stream(StreamConfig(name=name, subjects=[f"{name}.>"], max_bytes=-1,
                                                discard=DiscardPolicy.NEW, duplicate_window=120))
            states = await wait_all_in(db, {"succeeded"}, timeout=45)
        assert sorted(states) == ids
        info = await js.stream_info(name)
        got = sorted([int((await js.get_msg(name, seq)).headers["Nats-Msg-Id"])
                      for seq in range(1, info.state.last_seq + 1)])
        assert got == ids
    finally:
        await js.delete_stream(name)
        await nc.close()


# -------------------------------------------------------------- RabbitMQ

@contextlib.asynccontextmanager
async def _exchange() -> AsyncIterator[tuple[Any, str]]:
    """A connection to the machine's RabbitMQ and a fresh exchange name; the
    exchange, if anything declared it, is deleted whatever the test's end."""
    import aio_pika

    name = f"conveyor-test-{uuid.uuid4().hex[:12]}"
    connection = await aio_pika.connect(AMQP_URL)
    try:
        yield connection, name
    finally:
        channel = await connection.channel()
        await channel.exchange_delete(name)
        await connection.close()


async def test_rabbitmq_confirms_persistent_messages_with_their_ids(db: str) -> None:
    import aio_pika

    async with _exchange() as (connection, exchange_name):
        channel = await connection.channel()
        exchange = await channel.declare_exchange(exchange_name, "topic", durable=True)
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(exchange, "orders.#")
        relay = Relay()
        relay.route("order.*", RabbitMQPublisher(AMQP_URL, exchange=exchange_name),
                    destination="orders.{tenant}.{topic}")
        await enqueue_many(db, _events(25))
        states = await _relay_all(db, relay, 25)
        assert set(states.values()) == {"succeeded"}
        got: dict[int, aio_pika.abc.AbstractIncomingMessage] = {}
        while (message := await queue.get(no_ack=True, fail=False)) is not None:
            got[int(message.message_id or 0)] = message
        assert sorted(got) == await _ids(db)
        first = got[1]
        assert first.routing_key == "orders.t0.order.created"
        assert first.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert first.content_type == "application/json"
        assert json.loads(first.body) == {"n": 0, "text": "é"}
        assert first.headers["conveyor-topic"] == "order.created"
        assert first.headers["conveyor-tenant"] == "t0"


async def test_rabbitmq_refuses_an_exchange_it_cannot_declare_in_one_line() -> None:
    from conveyor import ConfigError

    async with _exchange() as (connection, exchange_name):
        channel = await connection.channel()
        await channel.declare_exchange(exchange_name, "fanout", durable=True)
        publisher = RabbitMQPublisher(AMQP_URL, exchange=exchange_name)   # a topic exchange
        with pytest.raises(ConfigError, match=f"RabbitMQ refused exchange '{exchange_name}': "
                                              ".*inequivalent arg 'type'"):
            await publisher.start()
        await publisher.aclose()


async def test_rabbitmq_refuses_a_missing_exchange_it_may_not_declare_in_one_line() -> None:
    from conveyor import ConfigError

    exchange_name = f"conveyor-test-{uuid.uuid4().hex[:12]}"
    publisher = RabbitMQPublisher(AMQP_URL, exchange=exchange_name, declare_exchange=False)
    with pytest.raises(ConfigError, match=f"RabbitMQ refused exchange '{exchange_name}': "
                                          "NOT_FOUND"):
        await publisher.start()
    await publisher.aclose()


async def test_rabbitmq_unroutable_messages_are_refused_not_dropped(db: str) -> None:
    async with _exchange() as (_, exchange_name):
        relay = Relay()
        relay.route("order.*", RabbitMQPublisher(AMQP_URL, exchange=exchange_name),
                    destination="nobody.listens")
        await enqueue_many(db, _events(3, max_attempts=1))
        states = await _relay_all(db, relay, 3)
        assert set(states.values()) == {"failed"}
        rows = await query(db, "SELECT last_error FROM conveyor.events")
        assert all("refused 'nobody.listens'" in r["last_error"] for r in rows), rows


async def test_rabbitmq_a_full_queue_nacks_and_the_events_wait_without_spending_attempts(
        db: str) -> None:
    async with _exchange() as (connection, exchange_name):
        channel = await connection.channel()
        exchange = await channel.declare_exchange(exchange_name, "topic", durable=True)
        queue = await channel.declare_queue(exclusive=True, arguments={
            "x-max-length": 5, "x-overflow": "reject-publish"})
        await queue.bind(exchange, "orders.#")
        relay = Relay()
        relay.route("order.*", RabbitMQPublisher(AMQP_URL, exchange=exchange_name),
                    destination="orders.{topic}")
        ids = await enqueue_many(db, _events(20, max_attempts=1))
        got: list[int] = []
        async with relay, running(Worker(db, relay.router(), fast_config(concurrency=20))):
            async def waiting() -> bool:
                return (await query(db, "SELECT count(*) AS n FROM conveyor.events"
                                        " WHERE state = 'pending' AND run_at > now()"))[0]["n"] > 0
            await wait_until(waiting, timeout=15, what="nacked events waiting")
            [row] = await query(db, "SELECT count(*) FILTER (WHERE state = 'failed') AS failed,"
                                    " max(attempts) FILTER (WHERE state = 'pending') AS spent,"
                                    " max(last_error) AS error FROM conveyor.events")
            assert row == {"failed": 0, "spent": 0, "error": None}
            # A consumer drains the queue; the waiting events follow.
            deadline = asyncio.get_running_loop().time() + 60
            while len(got) < 20:
                assert asyncio.get_running_loop().time() < deadline, sorted(got)
                message = await queue.get(no_ack=True, fail=False)
                if message is None:
                    await asyncio.sleep(0.1)
                else:
                    got.append(int(message.message_id or 0))
            await wait_all_in(db, {"succeeded"}, timeout=10)
        assert sorted(got) == ids


# ----------------------------------------------------------------- Redis

async def test_redis_adds_each_event_once_and_a_replay_adds_nothing(db: str) -> None:
    import redis.asyncio

    prefix = f"conveyor-test:{uuid.uuid4().hex[:12]}"
    publisher = RedisStreamPublisher(REDIS_URL, key_prefix=prefix + ":relayed:")
    relay = Relay()
    relay.route("order.*", publisher, destination=prefix + ":{topic}")
    relay.route("invoice.*", publisher, destination=prefix + ":{topic}")
    await enqueue_many(db, _events(20) + _events(5, topic="invoice.sent"))
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    try:
        states = await _relay_all(db, relay, 25)
        assert set(states.values()) == {"succeeded"}
        orders = await client.xrange(f"{prefix}:order.created")
        invoices = await client.xrange(f"{prefix}:invoice.sent")
        assert len(orders) == 20 and len(invoices) == 5
        fields = orders[0][1]
        assert json.loads(fields[b"payload"]) == {"n": 0, "text": "é"}
        assert fields[b"conveyor-event-id"] == b"1" and fields[b"conveyor-tenant"] == b"t0"
        ids = sorted(int(f[b"conveyor-event-id"]) for _, f in orders + invoices)
        assert ids == await _ids(db)
        async with relay, await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            replayed = await relay.replay(
                conn, since=datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5))
        assert replayed == 25 and publisher.duplicates == 25
        assert await client.xlen(f"{prefix}:order.created") == 20
    finally:
        keys = [k async for k in client.scan_iter(match=prefix + ":*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


# ---------------------------------------------------------- unreachable

async def test_an_unreachable_broker_puts_events_back_without_spending_attempts(
        db: str) -> None:
    relay = Relay()
    # Nothing listens on port 1.
    relay.route("order.*", NatsPublisher("nats://127.0.0.1:1", stream="NOWHERE",
                                         subjects=["x.>"], timeout=0.5))
    [event_id] = await enqueue_many(db, _events(1))
    worker = Worker(db, relay.router(), fast_config())

    async def put_back() -> bool:
        return bool(await query(db, "SELECT 1 FROM conveyor.events WHERE id = %s"
                                    " AND state = 'pending' AND run_at > now()", (event_id,)))
    async with running(worker):
        # A condition, not the 1.5 s it slept: on a loaded machine the first
        # publish had not yet timed out by then.
        await wait_until(put_back, timeout=20, what="the event put back for later")
    [row] = await query(db, "SELECT state, attempts, run_at > now() AS later"
                            " FROM conveyor.events WHERE id = %s", (event_id,))
    assert row == {"state": "pending", "attempts": 0, "later": True}


def test_routes_refuse_bad_templates_and_publishers_with_one_line() -> None:
    from conveyor import ConfigError

    relay = Relay()
    nats_publisher = NatsPublisher(stream="S", subjects=["s.>"])
    for kwargs, message in [
        ({"destination": "x.{id}"}, "expected destination for 'a.*' to name only {topic} and "
                                    "{tenant}, got 'x.{id}'"),
        ({"destination": "x.{topic"}, "expected destination for 'a.*' to be a template like"),
        ({"destination": ""}, "to name only {topic} and {tenant}, got ''"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")
                           .replace("*", r"\*").replace(".", r"\.")):
            relay.route("a.*", nats_publisher, **kwargs)
    with pytest.raises(ConfigError, match=r"expected a publisher for 'a\.\*'"):
        relay.route("a.*", "nats://x")  # type: ignore[arg-type]
    relay.route("a.*", nats_publisher)
    with pytest.raises(ConfigError, match=r"pattern 'a\.\*' is relayed twice"):
        relay.route("a.*", nats_publisher)
    with pytest.raises(ConfigError, match="expected mode for 'b' to be one of 'unordered', "
                                          "'per_key', 'ordered', got 'sorted'"):
        relay.route("b", nats_publisher, mode="sorted")
    with pytest.raises(ConfigError, match="expected fifo_by for 'b' to be 'tenant' or"):
        relay.route("b", nats_publisher, mode="per_key", key="customer")
    with pytest.raises(ConfigError, match="expected stream to be a JetStream stream name"):
        NatsPublisher(stream="a b")
    with pytest.raises(ConfigError, match="expected exchange_type to be one of"):
        RabbitMQPublisher(exchange_type="fan")
    with pytest.raises(ConfigError, match="expected dedup_ttl to be seconds"):
        RedisStreamPublisher(dedup_ttl=0)
    assert nats_publisher.check_destination("a.b.c") is None
    assert nats_publisher.check_destination("a..b") is not None
    assert nats_publisher.check_destination("a.*") is not None
    assert nats_publisher.check_destination("a b") is not None
    assert PublishRejectedError.__mro__[1].__name__ == "RelayError"


def test_a_broker_away_doubles_the_wait_per_round_of_retries_not_per_event(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.relay import core

    now = [100.0]
    monkeypatch.setattr(core.time, "monotonic", lambda: now[0])
    away = core._Unavailable()
    first = [away.next_delay() for _ in range(200)]     # 200 publishes in flight fail at once
    assert min(first) >= 0.8 and max(first) <= 1.2 and len(set(first)) == 1
    now[0] += first[0]                                   # their retries fail again
    second = away.next_delay()
    assert 1.6 <= second <= 2.4 and away.next_delay() == second
    for _ in range(10):
        now[0] += away.delay
        away.next_delay()
    assert away.delay <= 30 * 1.2                        # capped
