"""A broker that refuses a message is not an outage: each broker's refusals of one
message (for its size, its key's type) and rows the producer would have refused
are failed attempts with the broker's reason, parked after the last; their batch
mates and other tenants' per-key heads go on. And a broker that dies fails the
publishes in flight at once instead of after the confirmation timeout.

Every broker here is a private one the test starts (its own port, config and
data directory): the tests change server limits and kill servers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conveyor import AsyncAdmin, BackoffPolicy, NewEvent, Worker
from conveyor.relay import (
    NatsPublisher,
    RabbitMQPublisher,
    RedisStreamPublisher,
    Relay,
    RelayMessage,
)
from relay.test_relay_faults import NatsServer, RabbitServer, RedisServer
from waiting import wait_until
from worker_support import enqueue_many, fast_config, query, running, wait_all_in

# serial: kills private brokers; a publish in flight must fail in < 6 s.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

STREAM = "REFUSALS"
MAX_PAYLOAD = 65536
# A payload of this many bytes passes nats-py's own check (the payload alone is
# under max_payload) and is over the server's with the headers on top.
JUST_UNDER = MAX_PAYLOAD - 60


@pytest.fixture
def db(fresh_db: str) -> str:
    return fresh_db


class SmallNatsServer(NatsServer):
    """A private nats-server whose max_payload is 64 KiB."""

    def command(self) -> list[str]:
        config = self.directory.parent / "nats.conf"
        config.write_text(f"max_payload: {MAX_PAYLOAD}\n")
        return [*super().command(), "-c", str(config)]


@pytest.fixture
def small_nats(tmp_path: Path) -> Iterator[SmallNatsServer]:
    server = SmallNatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.kill()


def _blob(size: int, **fields: Any) -> dict[str, Any]:
    """A payload whose stored JSON text (jsonb: '{"blob": "..."}') is ``size`` bytes."""
    return {"blob": "x" * (size - len('{"blob": ""}')), **fields}


def _backoff() -> BackoffPolicy:
    return BackoffPolicy(base_delay=0.05, max_delay=0.05, jitter=0)


async def _stream_ids(url: str) -> list[int]:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(STREAM)
        return [int((await js.get_msg(STREAM, seq)).headers["Nats-Msg-Id"])  # type: ignore[index]
                for seq in range(info.state.first_seq, info.state.last_seq + 1)]
    finally:
        await nc.close()


async def _rows(db: str) -> dict[int, dict[str, Any]]:
    rows = await query(db, "SELECT id, state, attempts, last_error FROM conveyor.events")
    return {r["id"]: r for r in rows}


def _none_put_back(caplog: pytest.LogCaptureFixture) -> None:
    backs = [r.getMessage() for r in caplog.records
             if getattr(r, "action", None) == "relay_unavailable"]
    assert backs == [], backs[:3]


async def test_nats_a_message_over_max_payload_is_refused_parked_and_its_batch_goes_on(
        db: str, small_nats: SmallNatsServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="conveyor.relay")
    publisher = NatsPublisher(small_nats.url, stream=STREAM, subjects=["refusals.>"])
    relay = Relay()
    relay.route("big.*", publisher, destination="refusals.big.{topic}")
    relay.route("lane.*", publisher, destination="refusals.lane.{tenant}", mode="per_key")
    small = {"n": 1}
    ids = await enqueue_many(db, [
        NewEvent(topic="big.x", payload=small, max_attempts=2),
        NewEvent(topic="big.x", payload=_blob(100_000), max_attempts=2),
        NewEvent(topic="big.x", payload=small, max_attempts=2),
        NewEvent(topic="big.x", payload=_blob(JUST_UNDER), max_attempts=2),
        NewEvent(topic="big.x", payload=small, max_attempts=2),
        # acme's head is too big; globex's head is claimed in the same batch.
        NewEvent(topic="lane.x", payload=_blob(100_000), tenant="acme", max_attempts=2),
        NewEvent(topic="lane.x", payload=small, tenant="acme", max_attempts=2),
        NewEvent(topic="lane.x", payload=small, tenant="globex", max_attempts=2),
        NewEvent(topic="lane.x", payload=small, tenant="globex", max_attempts=2)])
    refused = {ids[1], ids[3], ids[5]}
    async with relay, running(Worker(db, relay.router(backoff=_backoff()),
                                     fast_config(concurrency=20))):
        await wait_all_in(db, {"succeeded", "failed"}, timeout=30)
    rows = await _rows(db)
    for i in ids:
        if i in refused:
            assert rows[i]["state"] == "failed" and rows[i]["attempts"] == 2, rows[i]
            assert "over the server's max_payload of 65536 bytes" in rows[i]["last_error"], \
                rows[i]
        else:
            assert rows[i]["state"] == "succeeded", rows[i]
    assert sorted(await _stream_ids(small_nats.url)) == sorted(set(ids) - refused)
    _none_put_back(caplog)


class _Stream:
    """An ordered stream over one route, run as a task."""

    def __init__(self, db: str, publisher: Any) -> None:
        relay = Relay()
        relay.route("order.*", publisher, destination="refusals.{topic}", mode="ordered")
        [self.stream] = relay.streams(db, poll_interval=0.05)
        self.publisher = publisher
        self.task: asyncio.Future[None] | None = None

    async def __aenter__(self) -> Any:
        self.task = asyncio.ensure_future(self.stream.run())
        return self.stream

    async def __aexit__(self, *exc: object) -> None:
        self.stream.request_stop()
        assert self.task is not None
        await asyncio.wait_for(self.task, 30)
        await self.publisher.aclose()


async def _insert(db: str, payload: Any, tenant: str | None = None,
                  topic: str = "order.x") -> int:
    """An event written by plain SQL (docs/producing.md), two attempts."""
    rows = await query(db, "INSERT INTO conveyor.events (topic, tenant, payload, max_attempts) "
                           "VALUES (%s, %s, %s, 2) RETURNING id",
                       (topic, tenant, json.dumps(payload)))
    return int(rows[0]["id"])


async def test_nats_an_ordered_stream_records_a_too_big_message_as_a_refused_attempt(
        db: str, small_nats: SmallNatsServer) -> None:
    publisher = NatsPublisher(small_nats.url, stream=STREAM, subjects=["refusals.>"])
    async with _Stream(db, publisher) as stream:
        first = await _insert(db, {"n": 1})
        big = await _insert(db, _blob(JUST_UNDER))
        last = await _insert(db, {"n": 3})

        async def recorded() -> bool:
            row = (await _rows(db))[big]
            return stream.blocked_on == big and row["attempts"] >= 1
        await wait_until(recorded, timeout=20, what="the refusal recorded on the event")
        row = (await _rows(db))[big]
        # The ordered stream's rule: the refusal is an attempt, the stream waits at it.
        assert row["state"] == "pending"
        assert "over the server's max_payload of 65536 bytes" in row["last_error"], row
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            await AsyncAdmin().cancel(conn, big)

        async def passed() -> bool:
            return stream.relayed == 2
        await wait_until(passed, timeout=40, what="the stream past the cancelled event")
    assert await _stream_ids(small_nats.url) == [first, last]


async def test_nats_killed_mid_publish_fails_it_at_once_and_the_stream_goes_on(
        db: str, nats_server: NatsServer) -> None:
    """The stall of an ordered stream when NATS dies with a publish in flight: the
    server stopped (the PubAck cannot come), then SIGKILLed and started again."""
    timeout = 12.0
    publisher = NatsPublisher(nats_server.url, stream=STREAM, subjects=["refusals.>"],
                              timeout=timeout)
    async with _Stream(db, publisher) as stream:
        await _insert(db, {"n": 1})

        async def relayed(n: int) -> bool:
            return stream.relayed == n
        await wait_until(lambda: relayed(1), timeout=20, what="the first event relayed")
        assert nats_server.process is not None
        nats_server.process.send_signal(signal.SIGSTOP)
        await _insert(db, {"n": 2})

        async def in_flight() -> bool:
            return publisher._js is not None and publisher._js.publish_async_pending() > 0
        await wait_until(in_flight, timeout=20, what="a publish in flight")
        killed = time.monotonic()
        nats_server.kill()
        nats_server.start()
        await wait_until(lambda: relayed(2), timeout=timeout + 20,
                         what="the event relayed after the restart")
        stall = time.monotonic() - killed
    print(f"\nordered stream stalled {stall:.2f}s after the NATS SIGKILL "
          f"(PubAck timeout {timeout:g}s)")
    assert stall < timeout / 2, f"stalled {stall:.2f}s, the PubAck timeout is {timeout:g}s"


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.kill()


# -------------------------------------------------------------- RabbitMQ

class SmallRabbitServer(RabbitServer):
    """A private rabbitmq-server that takes message bodies of at most 64 KiB."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        config = directory / "rabbitmq.conf"
        config.write_text(config.read_text() + f"max_message_size = {MAX_PAYLOAD}\n")


async def test_rabbitmq_a_message_over_max_message_size_is_refused_and_parked(
        db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import aio_pika

    caplog.set_level(logging.WARNING, logger="conveyor.relay")
    # Not under tmp_path: the server runs as the rabbitmq user, and pytest's
    # temporary directories are private to this one.
    home = Path(tempfile.mkdtemp(prefix="conveyor-rabbitmq-"))
    home.chmod(0o755)
    server = SmallRabbitServer(home / "node")
    try:
        # In a thread: the start waits for the broker to serve a client with
        # asyncio.run(), which cannot run inside this test's event loop.
        await asyncio.to_thread(server.start)
        connection = await aio_pika.connect(server.url)
        channel = await connection.channel()
        exchange = await channel.declare_exchange("refusals", "topic", durable=True)
        queue = await channel.declare_queue("refusals", durable=True)
        await queue.bind(exchange, "#")
        publisher = RabbitMQPublisher(server.url, exchange="refusals")
        relay = Relay()
        relay.route("big.*", publisher, destination="big.{topic}")
        relay.route("lane.*", publisher, destination="lane.{tenant}", mode="per_key")
        small = {"n": 1}
        events = [NewEvent(topic="big.x", payload=small, max_attempts=2) for _ in range(4)]
        events[2] = NewEvent(topic="big.x", payload=_blob(100_000), max_attempts=2)
        events += [NewEvent(topic="lane.x", payload=_blob(100_000), tenant="acme",
                            max_attempts=2),
                   NewEvent(topic="lane.x", payload=small, tenant="acme", max_attempts=2),
                   NewEvent(topic="lane.x", payload=small, tenant="globex", max_attempts=2),
                   NewEvent(topic="lane.x", payload=small, tenant="globex", max_attempts=2)]
        ids = await enqueue_many(db, events)
        refused = {ids[2], ids[4]}
        async with relay, running(Worker(db, relay.router(backoff=_backoff()),
                                         fast_config(concurrency=20))):
            await wait_all_in(db, {"succeeded", "failed"}, timeout=30)
        rows = await _rows(db)
        for i in ids:
            if i in refused:
                assert rows[i]["state"] == "failed" and rows[i]["attempts"] == 2, rows[i]
                assert "max_message_size" in rows[i]["last_error"], rows[i]
            else:
                assert rows[i]["state"] == "succeeded", rows[i]
        got = []
        while (message := await queue.get(no_ack=True, fail=False)) is not None:
            got.append(int(message.message_id or 0))
        assert sorted(set(got)) == sorted(set(ids) - refused)
        await connection.close()
        _none_put_back(caplog)
        server.kill()

        async def server_gone() -> bool:
            return not server.processes()
        await wait_until(server_gone, timeout=10, what="the private rabbitmq-server to die")
    finally:
        server.kill()
        shutil.rmtree(home, ignore_errors=True)


# ----------------------------------------------------------------- Redis

async def test_redis_refusals_of_one_entry_are_failed_attempts_and_the_rest_go_on(
        db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import redis.asyncio

    caplog.set_level(logging.WARNING, logger="conveyor.relay")
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        server.config_set("proto-max-bulk-len", str(1024 * 1024))
        client = redis.asyncio.Redis(port=server.port)
        await client.set("refusals:big.wrong", "a string, not a stream")
        relay = Relay()
        publisher = RedisStreamPublisher(server.url)
        relay.route("big.*", publisher, destination="refusals:{topic}")
        relay.route("lane.*", publisher, destination="refusals:lane.{tenant}", mode="per_key")
        # Over the producer's payload limit: written by plain SQL, as docs/producing.md allows.
        big = _blob(1_200_000)
        ids = [await _insert(db, {"n": 1}, topic="big.x"), await _insert(db, big, topic="big.x"),
               await _insert(db, {"n": 1}, topic="big.wrong"),
               await _insert(db, {"n": 1}, topic="big.x"),
               await _insert(db, big, tenant="acme", topic="lane.x"),
               await _insert(db, {"n": 1}, tenant="acme", topic="lane.x"),
               await _insert(db, {"n": 1}, tenant="globex", topic="lane.x")]
        reasons = {ids[1]: "proto-max-bulk-len", ids[2]: "WRONGTYPE",
                   ids[4]: "proto-max-bulk-len"}
        async with relay, running(Worker(db, relay.router(backoff=_backoff()),
                                         fast_config(concurrency=20))):
            await wait_all_in(db, {"succeeded", "failed"}, timeout=30)
        rows = await _rows(db)
        for i in ids:
            if i in reasons:
                assert rows[i]["state"] == "failed" and rows[i]["attempts"] == 2, rows[i]
                assert reasons[i] in rows[i]["last_error"], rows[i]
            else:
                assert rows[i]["state"] == "succeeded", rows[i]
        stored = []
        for key in ("refusals:big.x", "refusals:lane.acme", "refusals:lane.globex"):
            stored += [int(fields[b"conveyor-event-id"])
                       for _, fields in await client.xrange(key)]
        assert sorted(stored) == sorted(set(ids) - set(reasons))
        await client.aclose()
        _none_put_back(caplog)
    finally:
        server.kill()


# ------------------------------------------------- rows the producer refuses

class Recorder:
    """A publisher that keeps every message it is given."""

    name = "recorder"

    def __init__(self) -> None:
        self.messages: list[RelayMessage] = []

    async def start(self) -> None:
        pass

    async def publish(self, message: RelayMessage) -> None:
        self.messages.append(message)

    def check_destination(self, destination: str) -> str | None:
        return None

    async def aclose(self) -> None:
        pass


async def test_a_plain_sql_row_with_a_bad_tenant_or_topic_is_parked_never_published(
        db: str) -> None:
    recorder = Recorder()
    relay = Relay()
    relay.route("order.*", recorder, destination="events.{tenant}.{topic}")
    good = await _insert(db, {}, tenant="globex")
    bad = {await _insert(db, {}, tenant="globex.order"): "invalid tenant 'globex.order'",
           await _insert(db, {}, tenant="Acme"): "invalid tenant 'Acme'",
           await _insert(db, {}, topic="order.x!"): "malformed topic 'order.x!'"}
    async with running(Worker(db, relay.router(), fast_config())):
        await wait_all_in(db, {"succeeded", "failed"}, timeout=20)
    rows = await _rows(db)
    assert rows[good]["state"] == "succeeded"
    for i, reason in bad.items():
        assert rows[i]["state"] == "failed", rows[i]
        assert reason in rows[i]["last_error"], rows[i]
    assert [m.destination for m in recorder.messages] == ["events.globex.order.x"]


async def test_an_ordered_stream_records_a_bad_tenant_and_publishes_nothing_of_it(
        db: str) -> None:
    recorder = Recorder()
    async with _Stream(db, recorder) as stream:
        bad = await _insert(db, {}, tenant="globex.order")

        async def recorded() -> bool:
            return stream.blocked_on == bad and (await _rows(db))[bad]["attempts"] >= 1
        await wait_until(recorded, timeout=20, what="the refusal recorded on the event")
    row = (await _rows(db))[bad]
    assert row["state"] == "pending" and "invalid tenant 'globex.order'" in row["last_error"]
    assert recorder.messages == []
