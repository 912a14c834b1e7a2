"""The ordered relay (mode="ordered"): one stream per route, in transaction order.

The Kafka Connect failure reproduced (an id cursor skips the event whose
transaction commits after a later id's) and shown not to happen here;
concurrent producers committing out of id order into real NATS JetStream; a
refused event holding its stream until cancelled; one relay leading a stream,
the next taking over when its connection is killed.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from conveyor import AsyncAdmin, PublishRejectedError
from conveyor.errors import ConfigError
from conveyor.relay import NatsPublisher, Relay, RelayMessage
from conveyor.relay.ordered import OrderedStream
from server_support import own_server
from worker_support import query

# A server of its own: a stream reads only events older than every transaction
# open in the whole cluster (pg_snapshot_xmin); another test's transaction in
# another database would hold events back, and the held-events gauge checked
# here counts them. (Until 2026-12-03 the module ran alone in the serial tier.)
server_url, make_db, template_db, shared_db_url = own_server("conveyor-ordered-")

NATS_URL = "nats://127.0.0.1:4222"
INSERT = "INSERT INTO conveyor.events (topic, payload) VALUES (%s, '{}') RETURNING id"


@pytest.fixture
def db(fresh_db: str) -> str:
    return fresh_db


class Recorder:
    """A publisher that keeps what it is given, and refuses the event ids in ``refuse``."""

    name = "recorder"

    def __init__(self) -> None:
        self.messages: list[RelayMessage] = []
        self.refuse: set[int] = set()

    async def start(self) -> None:
        pass

    async def publish(self, message: RelayMessage) -> None:
        if message.event_id in self.refuse:
            raise PublishRejectedError(f"event {message.event_id} is not welcome")
        self.messages.append(message)

    def check_destination(self, destination: str) -> str | None:
        return None

    async def aclose(self) -> None:
        pass

    @property
    def ids(self) -> list[int]:
        return [m.event_id for m in self.messages]


async def _until(check: Callable[[], Any], timeout: float = 60.0, what: str = "") -> None:
    # 60 s bounds a failure only: an ordered stream reads past the server-wide xmin,
    # which any transaction on a shared, loaded server (another test's) can hold back.
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.01)


async def _insert(conn: psycopg.AsyncConnection[Any], topic: str) -> int:
    row = await (await conn.execute(INSERT, (topic,))).fetchone()
    assert row is not None
    return int(row[0])


async def _xid_order(db: str) -> list[int]:
    rows = await query(db, "SELECT id FROM conveyor.events ORDER BY xid, id")
    return [r["id"] for r in rows]


def _stream(db: str, publisher: Any, pattern: str = "order.*") -> OrderedStream:
    """The route's stream, its trigger in place (0019) as once it has led: the events
    the tests write before starting it carry their transaction's id."""
    relay = Relay()
    relay.route(pattern, publisher, mode="ordered")
    [stream] = relay.streams(db, poll_interval=0.05)
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("SELECT conveyor.order_topics(%s)", (pattern,))
    return stream


async def test_an_id_cursor_skips_the_event_committed_late_and_the_stream_does_not(
        db: str) -> None:
    recorder = Recorder()
    stream = _stream(db, recorder)
    async with await psycopg.AsyncConnection.connect(db) as early, \
            await psycopg.AsyncConnection.connect(db, autocommit=True) as late:
        first = await _insert(early, "order.a")      # its transaction stays open
        second = await _insert(late, "order.b")      # committed at once
        assert first < second
        # Kafka Connect's incrementing mode: read what is committed past the offset.
        cursor = [r["id"] for r in await query(db, "SELECT id FROM conveyor.events "
                                                   "WHERE id > 0 ORDER BY id")]
        offset = max(cursor)
        task = asyncio.ensure_future(stream.run())
        try:
            await _until(lambda: stream.held is not None, what="the stream to wait")
            assert stream.held is not None and stream.held[0] == 1
            assert recorder.ids == []            # `second` waits for `early`
            await early.commit()
            await _until(lambda: len(recorder.ids) == 2, what="both events relayed")
            cursor += [r["id"] for r in await query(
                db, "SELECT id FROM conveyor.events WHERE id > %s ORDER BY id", (offset,))]
        finally:
            stream.request_stop()
            await asyncio.wait_for(task, 10)
    assert cursor == [second]                    # the cursor never sees `first`
    assert recorder.ids == [first, second]       # the stream publishes both, in order
    states = await query(db, "SELECT state, attempts FROM conveyor.events ORDER BY id")
    assert [(s["state"], s["attempts"]) for s in states] == [("succeeded", 1)] * 2
    assert stream.relayed == 2 and stream.held is None


async def test_concurrent_producers_out_of_id_order_reach_nats_in_xid_order(db: str) -> None:
    import nats

    name = f"T{uuid.uuid4().hex[:12]}"
    stream = _stream(db, NatsPublisher(NATS_URL, stream=name, subjects=[f"{name}.>"]))
    stream._route = type(stream._route)(stream._route.pattern, stream._route.publisher,
                                        name + ".{topic}", None, True)
    commits: list[list[int]] = []     # each committed transaction's ids, in commit order
    rolled_back: list[int] = []

    async def producer(seed: int) -> None:
        rng = random.Random(seed)
        async with await psycopg.AsyncConnection.connect(db) as conn:
            for _ in range(25):
                ids = [await _insert(conn, f"order.p{seed}") for _ in range(rng.randint(1, 3))]
                await asyncio.sleep(rng.random() * 0.02)
                if rng.random() < 0.1:
                    await conn.rollback()
                    rolled_back.extend(ids)
                else:
                    await conn.commit()
                    commits.append(ids)

    await stream._route.publisher.start()
    task = asyncio.ensure_future(stream.run())
    nc = await nats.connect(NATS_URL)
    try:
        await asyncio.gather(*(producer(seed) for seed in range(6)))
        committed = [i for ids in commits for i in ids]
        await _until(lambda: stream.relayed == len(committed), timeout=60,
                     what="every committed event relayed")
        js = nc.jetstream()
        info = await js.stream_info(name)
        published = [int((await js.get_msg(name, seq)).headers["Nats-Msg-Id"])
                     for seq in range(1, info.state.messages + 1)]
        await js.delete_stream(name)
    finally:
        stream.request_stop()
        await asyncio.wait_for(task, 10)
        await stream._route.publisher.aclose()
        await nc.close()
    # The transactions committed out of id order (else this proves nothing) ...
    assert committed != sorted(committed)
    # ... and the broker holds each committed event once, in (xid, id) order, nothing else.
    assert published == await _xid_order(db)
    assert sorted(published) == sorted(committed)
    assert not set(published) & set(rolled_back)


async def test_a_refused_event_holds_its_stream_until_it_is_cancelled(db: str) -> None:
    recorder = Recorder()
    stream = _stream(db, recorder)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        ids = [await _insert(conn, "order.x") for _ in range(3)]
        recorder.refuse.add(ids[1])
        task = asyncio.ensure_future(stream.run())
        try:
            await _until(lambda: stream.blocked_on == ids[1], what="the refusal")
            await asyncio.sleep(0.3)
            assert recorder.ids == [ids[0]]           # the third waits behind the second
            [row] = await query(db, "SELECT state, attempts, last_error FROM conveyor.events "
                                    "WHERE id = %s", (ids[1],))
            assert row["state"] == "pending" and row["attempts"] >= 1
            assert "is not welcome" in row["last_error"]
            await AsyncAdmin().cancel(conn, ids[1])
            await _until(lambda: recorder.ids == [ids[0], ids[2]], timeout=60,
                         what="the stream to pass the cancelled event")
        finally:
            stream.request_stop()
            await asyncio.wait_for(task, 10)


async def test_one_relay_leads_a_stream_and_the_next_takes_over_when_its_connection_dies(
        db: str) -> None:
    recorder = Recorder()
    streams = [_stream(db, recorder), _stream(db, recorder)]
    tasks = [asyncio.ensure_future(s.run()) for s in streams]
    try:
        await _until(lambda: any(s.leading for s in streams), what="a leader")
        await asyncio.sleep(1.5)                       # the other has tried the lock meanwhile
        assert [s.leading for s in streams].count(True) == 1
        leader = next(s for s in streams if s.leading)
        # The leader is in the worker registry as serving the route's topics: status
        # does not report them as claimed by no one.
        assert await query(db, "SELECT topics, concurrency FROM conveyor.workers") == [
            {"topics": ["order.*"], "concurrency": 1}]
        async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
            for _ in range(5):
                await _insert(conn, "order.a")
            await _until(lambda: len(recorder.ids) == 5, what="the first five")
            # Kill the leader's connection: the lock goes with it.
            await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_locks "
                               "WHERE locktype = 'advisory' AND granted")
            await _until(lambda: not leader.leading, what="the leader to lose the stream")
            for _ in range(5):
                await _insert(conn, "order.a")
            await _until(lambda: len(set(recorder.ids)) == 10, timeout=60, what="all ten")
        last = next(s for s in streams if s.leading)
    finally:
        for s in streams:
            s.request_stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 15)
    first_seen = list(dict.fromkeys(recorder.ids))
    assert first_seen == await _xid_order(db)
    assert sum(s.relayed for s in streams) == 10
    # The stopped leader took its row out of the registry (the killed one's ages out).
    rows = await query(db, "SELECT id FROM conveyor.workers WHERE id = %s",
                       (last._registration["id"],))
    assert rows == []


def test_an_ordered_route_must_have_its_topics_to_itself() -> None:
    relay = Relay()
    relay.route("order.*", Recorder(), mode="ordered")
    for pattern in ("*", "order.created", "order.eu.created", "order.eu.*"):
        with pytest.raises(ConfigError, match=r"^pattern .* overlaps 'order\.\*', and an ordered"):
            relay.route(pattern, Recorder())
    relay.route("orders", Recorder())                  # no overlap: accepted
    relay.route("invoice.*", Recorder(), mode="ordered")
    with pytest.raises(ConfigError, match=r"overlaps 'invoice\.\*'"):
        relay.route("invoice.sent", Recorder(), mode="per_key")
    assert relay.claims and [r.pattern for r in relay.router().routes] == ["orders"]
    with pytest.raises(ConfigError, match="mode for 'x' to be one of 'unordered', 'per_key', "
                                          "'ordered', got 'fifo'"):
        relay.route("x", Recorder(), mode="fifo")


async def test_a_streams_state_is_in_its_metrics(db: str) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from conveyor.metrics import StreamsCollector

    recorder = Recorder()
    stream = _stream(db, recorder)
    registry = CollectorRegistry()
    registry.register(StreamsCollector([stream]))
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        ids = [await _insert(conn, "order.m") for _ in range(3)]
        recorder.refuse.add(ids[2])
        task = asyncio.ensure_future(stream.run())
        try:
            await _until(lambda: stream.blocked_on == ids[2] and stream.relayed == 2,
                         what="the refusal")
            text = generate_latest(registry).decode()
            # Read with the scrape (no await between): a transaction elsewhere on
            # the server, older than the events, can hold some back for a moment.
            held = stream.held[0] if stream.held is not None else 0
        finally:
            stream.request_stop()
            await asyncio.wait_for(task, 10)
    assert 'conveyor_relay_stream_relayed_total{route="order.*"} 2.0' in text
    assert 'conveyor_relay_stream_leading{route="order.*"} 1.0' in text
    assert 'conveyor_relay_stream_blocked{route="order.*"} 1.0' in text
    assert f'conveyor_relay_stream_held_events{{route="order.*"}} {held:.1f}' in text


async def test_a_stream_adds_its_routes_trigger_when_it_first_leads_after_any_writer_ends(
        db: str) -> None:
    recorder = Recorder()
    relay = Relay()
    relay.route("order.*", recorder, mode="ordered")
    [stream] = relay.streams(db, poll_interval=0.05)     # no trigger yet (0019)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn, \
            await psycopg.AsyncConnection.connect(db) as writer:
        before = [await _insert(conn, "order.a") for _ in range(2)]
        other = await _insert(conn, "audit.x")
        open_one = await _insert(writer, "order.a")      # a writer still open
        task = asyncio.ensure_future(stream.run())
        try:
            # The trigger waits for the writer (half a second per try, so producers
            # are never held back behind it for long); nothing is relayed meanwhile.
            await _until(lambda: stream.leading, what="the stream to take its lock")
            await asyncio.sleep(0)
            assert recorder.ids == []
            await writer.commit()
            await _until(lambda: len(recorder.ids) == 3, what="the three events relayed")
            after = await _insert(conn, "order.b")
            await _until(lambda: len(recorder.ids) == 4, what="the event written after")
        finally:
            stream.request_stop()
            await asyncio.wait_for(task, 10)
    assert recorder.ids == [*before, open_one, after]
    rows = {r["id"]: r["xid"] for r in await query(
        db, "SELECT id, xid::text AS xid FROM conveyor.events")}
    # Only the route's topics carry an xid; the one written before its trigger
    # got the xid of the transaction that created it.
    assert rows[other] is None and all(rows[i] is not None for i in (*before, open_one, after))
    assert len({rows[i] for i in before}) == 1 and int(rows[after]) > int(rows[before[0]])
