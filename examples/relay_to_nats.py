"""Relay committed events into NATS JetStream: one route unordered, one as an ordered stream.

Needs a NATS server with JetStream (``nats-server -js``) and the extra
``conveyor[nats]``. Run it against any PostgreSQL::

    python examples/relay_to_nats.py postgresql://app@localhost/app [nats://127.0.0.1:4222]

With no database URL (and no CONVEYOR_DATABASE_URL) it starts the embedded
PostgreSQL. It creates Conveyor's schema if missing, then:

1. commits three ``order.*`` events and three ``ledger.*`` events;
2. relays them for a moment, as ``conveyor relay --app examples.relay_to_nats:relay``
   would: orders side by side, ledger entries one at a time in the order of
   the transactions that wrote them;
3. prints what the stream ``EXAMPLE_EVENTS`` holds, then deletes it.

The same ``relay`` object is what ``conveyor relay --app`` serves in production.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import psycopg

from conveyor import Admin, Migrator, Producer, Worker, WorkerConfig
from conveyor.relay import NatsPublisher, Relay

NATS_URL = sys.argv[2] if len(sys.argv) > 2 else "nats://127.0.0.1:4222"
STREAM = "EXAMPLE_EVENTS"

relay = Relay()
nats = NatsPublisher(NATS_URL, stream=STREAM, subjects=["example.>"])
relay.route("order.*", nats, destination="example.orders.{topic}")
relay.route("ledger.*", nats, destination="example.ledger.{topic}", mode="ordered")


def write(url: str) -> None:
    producer = Producer()
    with psycopg.connect(url) as conn:
        Migrator().apply(conn)
        conn.commit()
        for n in range(3):
            # Each business transaction writes its events with its own change.
            producer.enqueue(conn, "order.created", {"order": n}, tenant="acme")
            producer.enqueue(conn, "ledger.posted", {"entry": n, "cents": 100 * (n + 1)})
            conn.commit()


async def relay_for_a_moment(url: str) -> None:
    async with relay:
        worker = Worker(url, relay.router(), WorkerConfig(shutdown_timeout=5))
        streams = relay.streams(url)
        tasks = [asyncio.ensure_future(t.run()) for t in (worker, *streams)]
        with psycopg.connect(url, autocommit=True) as conn:
            while Admin().status(conn).counts.get("succeeded", 0) < 6:
                await asyncio.sleep(0.1)
        worker.request_stop()
        for stream in streams:
            stream.request_stop()
        await asyncio.gather(*tasks)


async def show_and_delete() -> list[tuple[str, Any]]:
    import nats as nats_client

    nc = await nats_client.connect(NATS_URL)
    try:
        js = nc.jetstream()
        info = await js.stream_info(STREAM)
        held = []
        for seq in range(1, info.state.messages + 1):
            msg = await js.get_msg(STREAM, seq)
            held.append((msg.subject, msg.data.decode()))
        await js.delete_stream(STREAM)
        return held
    finally:
        await nc.close()


def main(url: str) -> None:
    write(url)
    asyncio.run(relay_for_a_moment(url))
    for subject, data in asyncio.run(show_and_delete()):
        print(f"{subject:<32} {data}")


def database_url() -> tuple[str, Any]:
    """The URL from argv or CONVEYOR_DATABASE_URL, else the embedded server's."""
    if len(sys.argv) > 1:
        return sys.argv[1], None
    if os.environ.get("CONVEYOR_DATABASE_URL"):
        return os.environ["CONVEYOR_DATABASE_URL"], None
    from conveyor.embedded import EmbeddedPostgres

    server = EmbeddedPostgres()
    return server.start(), server


if __name__ == "__main__":
    url, embedded = database_url()
    try:
        main(url)
    finally:
        if embedded is not None:
            embedded.stop()
