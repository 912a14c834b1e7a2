"""The relay's mode="per_key": a key's events are published one at a time, in order.

It is the route's fifo_by (docs/flow-control.md#per-key-order), so it shares
the per-key claim: a delayed event does not hold its key before it is due,
and a higher-priority event of a key waits while the key's current one is
being published. The publisher here records and, for one event, holds the
publish until told: the claim is under test, not a broker.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from conveyor import NewEvent, Worker
from conveyor.relay import Relay, RelayMessage
from waiting import wait_until
from worker_support import enqueue, enqueue_many, event_row, fast_config, query, running


@pytest.fixture
def db(fresh_db: str) -> str:
    return fresh_db


class HeldPublisher:
    """Records each publish's start and end (by the payload's name); holds `held` until released."""

    name = "held"

    def __init__(self, held: str = "") -> None:
        self.held = held
        self.release = asyncio.Event()
        self.spans: dict[str, list[float]] = {}

    async def start(self) -> None:
        pass

    async def publish(self, message: RelayMessage) -> None:
        name = json.loads(message.payload)
        loop = asyncio.get_running_loop()
        self.spans[name] = [loop.time()]
        if name == self.held:
            await self.release.wait()
        self.spans[name].append(loop.time())

    def check_destination(self, destination: str) -> str | None:
        return None

    async def aclose(self) -> None:
        pass

    async def published(self, *names: str) -> bool:
        return all(len(self.spans.get(n, ())) == 2 for n in names)

    async def started(self, name: str) -> bool:
        return name in self.spans


def _relay(publisher: Any) -> Relay:
    relay = Relay()
    relay.route("crm.*", publisher, mode="per_key", key="tenant")
    return relay


async def test_per_key_a_delayed_event_does_not_hold_its_key_before_it_is_due(db: str) -> None:
    await query(db, "TRUNCATE conveyor.flow_limits")
    publisher = HeldPublisher()
    relay = _relay(publisher)
    reminder = await enqueue(db, "crm.remind", "in an hour", tenant="acme", delay=3600)
    await enqueue(db, "crm.remind", "now", tenant="acme")
    await enqueue(db, "crm.remind", "globex now", tenant="globex")
    async with relay, running(Worker(db, relay.router(), fast_config(concurrency=4))):
        # Before: acme's "now" waited an hour behind the reminder.
        await wait_until(lambda: publisher.published("now", "globex now"), timeout=10,
                         what="acme's and globex's due events published")
    row = await event_row(db, reminder)
    assert (row["state"], row["attempts"]) == ("pending", 0)


async def test_per_key_a_higher_priority_event_waits_for_its_keys_publish(db: str) -> None:
    await query(db, "TRUNCATE conveyor.flow_limits")
    publisher = HeldPublisher(held="long")
    relay = _relay(publisher)
    await enqueue(db, "crm.sync", "long", tenant="acme")
    async with relay, running(Worker(db, relay.router(), fast_config(concurrency=4))):
        await wait_until(lambda: publisher.started("long"), timeout=10,
                         what="acme's first publish to start")
        # One transaction: whatever moves globex's event to the limited lane
        # moves the urgent one too (ahead of it in claim order).
        await enqueue_many(db, [
            NewEvent(topic="crm.sync", payload="urgent", tenant="acme", priority=10),
            NewEvent(topic="crm.sync", payload="globex", tenant="globex")])
        await wait_until(lambda: publisher.published("globex"), timeout=10,
                         what="globex's event published")
        # Before: the urgent event was published while acme's first still was.
        assert "urgent" not in publisher.spans, publisher.spans
        publisher.release.set()
        await wait_until(lambda: publisher.published("urgent"), timeout=10,
                         what="the urgent event published")
    assert publisher.spans["urgent"][0] >= publisher.spans["long"][1], publisher.spans
