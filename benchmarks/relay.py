"""The relay's throughput against a direct publish loop of the same broker client, and
its latency from commit to the broker's confirmation.

For each broker (``--brokers nats,rabbitmq,redis``), in one run, alternating
``--rounds`` times:

* **relay**: ``--events`` committed events (a 100-byte JSON payload each) are
  relayed by an in-process worker serving a ``conveyor.relay.Relay``
  (``--concurrency`` handlers, so as many publishes in flight); timed from the
  moment the topic is resumed (it is paused while the backlog is written) to
  the last event acknowledged as relayed.
* **direct**: the same number of messages, same payload and headers,
  published by the same client with the same confirmation (PubAck, publisher
  confirm, XADD reply), ``--concurrency`` in flight (asyncio.gather over
  windows); and for NATS also ``publish_async`` pipelining, the fastest the
  client offers. The strongest direct variant is the baseline.

Then ``--latency`` single events, one every 20 ms, each timed from its
COMMIT to the moment a subscriber on the broker side receives it (NATS: a
core subscription on the subject; RabbitMQ: a consumer on the bound queue;
Redis: XREAD BLOCK), with the worker listening (NOTIFY wake-ups).

    .venv/bin/python benchmarks/relay.py --database-url postgresql://root@127.0.0.1:5432/test

Brokers: NATS with JetStream on 4222, RabbitMQ on 5672, Redis on 6379. The
scratch schema ``conveyor_bench_relay`` and every stream, exchange and key
are removed at the end. ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from conveyor import AsyncAdmin, Migrator, NewEvent, Producer, ProducerConfig, Worker, WorkerConfig
from conveyor.relay import NatsPublisher, RabbitMQPublisher, RedisStreamPublisher, Relay
from conveyor.relay.core import RelayMessage

SCHEMA = "conveyor_bench_relay"
TOPIC = "bench.relay"
PAYLOAD = {"order": 123456, "customer": "c-000042", "items": [1, 2, 3], "note": "x" * 40}
NATS_URL = "nats://127.0.0.1:4222"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
REDIS_URL = "redis://127.0.0.1:6379/0"


class Broker:
    """One broker's publisher, its direct loops, its consumer for latency, its clean-up."""

    name = ""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def publisher(self) -> Any:
        raise NotImplementedError

    destination = "{topic}"

    async def direct_variants(self) -> dict[str, Callable[[list[RelayMessage], int],
                                                          Awaitable[None]]]:
        publisher = self.publisher()
        await publisher.start()
        self._direct = publisher

        async def gathered(messages: list[RelayMessage], window: int) -> None:
            for i in range(0, len(messages), window):
                await asyncio.gather(*(publisher.publish(m) for m in messages[i:i + window]))
        return {"gather": gathered}

    async def close_direct(self) -> None:
        await self._direct.aclose()

    async def receiver(self) -> tuple[Callable[[], Awaitable[None]], dict[int, float]]:
        raise NotImplementedError

    async def clean(self) -> None:
        raise NotImplementedError


class Nats(Broker):
    name = "nats"

    @property
    def stream(self) -> str:
        return f"BENCH{self.run_id}"

    @property
    def destination(self) -> str:  # type: ignore[override]
        return self.stream + ".{topic}"

    def publisher(self) -> NatsPublisher:
        return NatsPublisher(NATS_URL, stream=self.stream, subjects=[f"{self.stream}.>"])

    async def direct_variants(self) -> dict[str, Callable[[list[RelayMessage], int],
                                                          Awaitable[None]]]:
        import nats

        variants = await super().direct_variants()
        nc = await nats.connect(NATS_URL)
        js = nc.jetstream()
        self._nc = nc

        async def publish_async(messages: list[RelayMessage], window: int) -> None:
            for m in messages:
                await js.publish_async(m.destination, m.payload, stream=self.stream,
                                       headers={**m.headers, "Nats-Msg-Id": m.msg_id})
            await js.publish_async_completed()
        variants["publish_async"] = publish_async
        return variants

    async def close_direct(self) -> None:
        await super().close_direct()
        await self._nc.close()

    async def receiver(self) -> tuple[Callable[[], Awaitable[None]], dict[int, float]]:
        import nats

        seen: dict[int, float] = {}
        nc = await nats.connect(NATS_URL)

        async def on_message(msg: Any) -> None:
            seen[int(msg.headers["conveyor-event-id"])] = time.monotonic()
        await nc.subscribe(f"{self.stream}.>", cb=on_message)
        return nc.close, seen

    async def clean(self) -> None:
        import nats

        nc = await nats.connect(NATS_URL)
        try:
            await nc.jetstream().delete_stream(self.stream)
        finally:
            await nc.close()


class Rabbit(Broker):
    name = "rabbitmq"

    @property
    def exchange(self) -> str:
        return f"conveyor-bench-{self.run_id}"

    def publisher(self) -> RabbitMQPublisher:
        return RabbitMQPublisher(AMQP_URL, exchange=self.exchange)

    async def declare(self) -> None:
        import aio_pika

        self._conn = await aio_pika.connect(AMQP_URL)
        channel = await self._conn.channel()
        exchange = await channel.declare_exchange(self.exchange, "topic", durable=True)
        self._queue = await channel.declare_queue(f"{self.exchange}-q", durable=True)
        await self._queue.bind(exchange, "#")

    async def purge(self) -> None:
        await self._queue.purge()

    async def receiver(self) -> tuple[Callable[[], Awaitable[None]], dict[int, float]]:
        seen: dict[int, float] = {}

        async def on_message(message: Any) -> None:
            seen[int(message.message_id)] = time.monotonic()
            await message.ack()
        tag = await self._queue.consume(on_message)

        async def stop() -> None:
            await self._queue.cancel(tag)
        return stop, seen

    async def clean(self) -> None:
        channel = await self._conn.channel()
        await channel.queue_delete(f"{self.exchange}-q")
        await channel.exchange_delete(self.exchange)
        await self._conn.close()


class RedisStreams(Broker):
    name = "redis"

    @property
    def prefix(self) -> str:
        return f"conveyor-bench:{self.run_id}"

    @property
    def destination(self) -> str:  # type: ignore[override]
        return self.prefix + ":{topic}"

    def publisher(self) -> RedisStreamPublisher:
        return RedisStreamPublisher(REDIS_URL, key_prefix=self.prefix + ":relayed:",
                                    dedup_ttl=600)

    async def receiver(self) -> tuple[Callable[[], Awaitable[None]], dict[int, float]]:
        import redis.asyncio

        seen: dict[int, float] = {}
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        key = f"{self.prefix}:{TOPIC}"
        last = (await client.xinfo_stream(key))["last-generated-id"] if await client.exists(key) \
            else "0-0"
        stopping = asyncio.Event()

        async def read() -> None:
            nonlocal last
            while not stopping.is_set():
                got = await client.xread({key: last}, block=100)
                for _, entries in got:
                    for entry_id, fields in entries:
                        seen[int(fields[b"conveyor-event-id"])] = time.monotonic()
                        last = entry_id
        task = asyncio.create_task(read())

        async def stop() -> None:
            stopping.set()
            await task
            await client.aclose()
        return stop, seen

    async def clean(self) -> None:
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(REDIS_URL)
        keys = [k async for k in client.scan_iter(match=self.prefix + ":*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


BROKERS: dict[str, type[Broker]] = {"nats": Nats, "rabbitmq": Rabbit, "redis": RedisStreams}


def _reset(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        Migrator(SCHEMA).apply(conn)


def _enqueue(url: str, n: int) -> None:
    with psycopg.connect(url) as conn:
        Producer(ProducerConfig(schema=SCHEMA)).enqueue_bulk(
            conn, [NewEvent(topic=TOPIC, payload=PAYLOAD, tenant="acme") for _ in range(n)])


async def _relay_drain(url: str, relay: Relay, n: int, concurrency: int) -> float:
    admin = AsyncAdmin(SCHEMA)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await admin.pause(conn, TOPIC, reason="benchmark: writing the backlog")
    await asyncio.to_thread(_enqueue, url, n)
    config = WorkerConfig(schema=SCHEMA, concurrency=concurrency, batch_size=100,
                          poll_interval=0.5)
    async with _serving(url, relay, config), \
            await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await asyncio.sleep(0.3)
        await admin.resume(conn, TOPIC)
        started = time.monotonic()
        # Whether any event is unfinished, through the pending and running rows'
        # partial indexes: counting the table every few ms would take CPU from
        # the relay being measured.
        unfinished = sql.SQL(
            "SELECT EXISTS (SELECT 1 FROM {0}.events WHERE state = 'pending')"
            " OR EXISTS (SELECT 1 FROM {0}.events WHERE state = 'running')").format(
                sql.Identifier(SCHEMA))
        while True:
            row = await (await conn.execute(unfinished)).fetchone()
            if row == (False,):
                break
            await asyncio.sleep(0.01)
        took = time.monotonic() - started
        await conn.execute(sql.SQL("TRUNCATE {}.events").format(sql.Identifier(SCHEMA)))
    return n / took


@contextlib.asynccontextmanager
async def _serving(url: str, relay: Relay, config: WorkerConfig) -> AsyncIterator[None]:
    """The relay running: a worker for its routes, or its ordered streams (--mode ordered)."""
    if relay.claims:
        worker = Worker(url, relay.router(), config)
        task = asyncio.create_task(worker.run())
        await worker.started.wait()
        await asyncio.wait_for(worker.listener.connected.wait(), 10)
        try:
            yield
        finally:
            worker.request_stop()
            await task
        return
    streams = relay.streams(url, schema=SCHEMA, batch_size=config.batch_size,
                            poll_interval=config.poll_interval)
    tasks = [asyncio.create_task(stream.run()) for stream in streams]
    while not all(stream.leading for stream in streams):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)    # its LISTEN is in place
    try:
        yield
    finally:
        for stream in streams:
            stream.request_stop()
        await asyncio.gather(*tasks)


def _messages(n: int, broker: Broker, relay: Relay) -> list[RelayMessage]:
    from conveyor.types import Event

    route = relay.routes[0]
    text = json.dumps(PAYLOAD)
    return [relay.message(route, Event(id=10_000_000 + i, topic=TOPIC, payload_text=text,
                                       tenant="acme")) for i in range(n)]


async def _latency(url: str, broker: Broker, relay: Relay, count: int) -> list[float]:
    stop, seen = await broker.receiver()
    committed: dict[int, float] = {}
    producer = Producer(ProducerConfig(schema=SCHEMA))
    async with _serving(url, relay, WorkerConfig(schema=SCHEMA, poll_interval=5)):
        with psycopg.connect(url) as conn:
            for _ in range(count):
                event_id = producer.enqueue(conn, TOPIC, PAYLOAD, tenant="acme")
                conn.commit()
                committed[event_id] = time.monotonic()
                await asyncio.sleep(0.02)
        deadline = time.monotonic() + 10
        while len([i for i in committed if i in seen]) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    await stop()
    return sorted((seen[i] - committed[i]) * 1000 for i in committed if i in seen)


async def _one_broker(url: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    broker = BROKERS[name](uuid.uuid4().hex[:10])
    if isinstance(broker, Rabbit):
        await broker.declare()
    relay = Relay()
    relay.route(TOPIC, broker.publisher(), destination=broker.destination, mode=args.mode)
    rounds: list[dict[str, Any]] = []
    try:
        await relay.start()
        variants = await broker.direct_variants()
        if args.mode == "ordered":
            # The ordered stream's own shape: one message, its confirmation, the next.
            publisher = broker._direct

            async def one_at_a_time(messages: list[RelayMessage], window: int) -> None:
                for m in messages:
                    await publisher.publish(m)
            variants["one at a time"] = one_at_a_time
        for _ in range(args.rounds):
            relayed = await _relay_drain(url, relay, args.events, args.concurrency)
            direct: dict[str, float] = {}
            for variant, publish in variants.items():
                messages = _messages(args.events, broker, relay)
                if isinstance(broker, RedisStreams):
                    # Fresh ids: the dedup keys of the relay's events are still there.
                    messages = [RelayMessage(m.event_id, f"direct-{uuid.uuid4().hex}", m.topic,
                                             m.tenant, m.attempt, m.destination, m.payload,
                                             m.headers) for m in messages]
                started = time.monotonic()
                await publish(messages, args.concurrency)
                direct[variant] = args.events / (time.monotonic() - started)
            if isinstance(broker, Rabbit):
                await broker.purge()
            best = max(direct, key=lambda v: direct[v])
            rounds.append({"relay_per_s": round(relayed), "direct_per_s":
                           {k: round(v) for k, v in direct.items()},
                           "strongest_direct": best, "ratio": round(relayed / direct[best], 3)})
            same = ""
            if "one at a time" in direct:
                rounds[-1]["ratio_one_at_a_time"] = round(relayed / direct["one at a time"], 3)
                same = f", x{relayed / direct['one at a time']:.2f} of one at a time"
            print(f"{name}: relay {relayed:,.0f}/s, direct "
                  + ", ".join(f"{k} {v:,.0f}/s" for k, v in direct.items())
                  + f" -> x{relayed / direct[best]:.2f} of {best}{same}", flush=True)
        await broker.close_direct()
        latencies = await _latency(url, broker, relay, args.latency)
    finally:
        await relay.aclose()
        await broker.clean()
    result = {"rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds),
              "latency_ms": {"count": len(latencies),
                             "p50": round(latencies[len(latencies) // 2], 2),
                             "p99": round(latencies[max(0, int(len(latencies) * 0.99) - 1)], 2)}}
    print(f"{name}: median x{result['median_ratio']:.2f}; commit -> received p50 "
          f"{result['latency_ms']['p50']} ms, p99 {result['latency_ms']['p99']} ms "
          f"({len(latencies)} events)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="postgresql://root@127.0.0.1:5432/test")
    parser.add_argument("--brokers", default="nats,rabbitmq,redis")
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", type=int, default=200)
    parser.add_argument("--mode", choices=("unordered", "ordered"), default="unordered",
                        help="the route's mode; ordered runs the route's stream, no worker")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures: dict[str, Any] = {"events": args.events, "concurrency": args.concurrency,
                               "mode": args.mode}
    for name in args.brokers.split(","):
        _reset(args.database_url)
        figures[name] = asyncio.run(_one_broker(args.database_url, name.strip(), args))
    with psycopg.connect(args.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
