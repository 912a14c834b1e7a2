"""Relay.replay reads its window a slice of finish times at a time (0027).

Each slice is read in batches in (finished_at, id) order; a slice that held
little doubles the next. Whatever the slicing, every relayed event of the
window comes once, oldest first, from the live partition and the history.
"""

from __future__ import annotations

import datetime

import psycopg
import pytest

from conveyor.relay import Relay, RelayMessage
from conveyor.relay.core import REPLAY_BATCH
from worker_support import query


@pytest.fixture
def db(fresh_db: str) -> str:
    return fresh_db


class Recording:
    """A publisher that keeps each message's event id, in the order published."""

    name = "recording"

    def __init__(self) -> None:
        self.ids: list[int] = []

    async def start(self) -> None:
        pass

    async def publish(self, message: RelayMessage) -> None:
        self.ids.append(message.event_id)

    def check_destination(self, destination: str) -> str | None:
        return None

    async def aclose(self) -> None:
        pass


FILL = """
INSERT INTO conveyor.events (topic, payload, state, attempts, finished_at, done)
SELECT CASE WHEN g %% 7 = 0 THEN 'other.y' ELSE 'order.x' END, '{}', 'succeeded', 1,
       %(at)s, %(done)s
FROM generate_series(1, %(n)s) AS g
"""


async def test_replay_reads_every_event_of_its_window_once_in_finish_order(db: str) -> None:
    now = datetime.datetime.now(datetime.UTC)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        await conn.execute("SELECT conveyor.history_make(interval '0')")
        # Two batches' worth finished within 30 s two hours ago (one slice, read in
        # several batches), 500 spread over three hours, three just now in the
        # history, and some before the window.
        burst = now - datetime.timedelta(hours=2)
        await conn.execute(FILL.replace("%(at)s", "%(at)s + g * interval '20 milliseconds'"),
                           {"at": burst, "done": None, "n": 2 * REPLAY_BATCH + 100})
        await conn.execute(FILL.replace("%(at)s", "%(at)s + g * interval '21 seconds'"),
                           {"at": now - datetime.timedelta(hours=3), "done": None, "n": 500})
        await conn.execute(FILL, {"at": now - datetime.timedelta(seconds=1), "done": True,
                                  "n": 3})
        await conn.execute(FILL, {"at": now - datetime.timedelta(hours=5), "done": None,
                                  "n": 10})
    rows = await query(db, "SELECT id, finished_at, tableoid::regclass::text AS part"
                           " FROM conveyor.events WHERE topic = 'order.x'"
                           " ORDER BY finished_at, id")
    assert {r["part"] for r in rows} == {
        "conveyor.events_live", f"conveyor.events_done_{now:%Y%m%d}"}
    since = now - datetime.timedelta(hours=4)
    wanted = [r["id"] for r in rows if r["finished_at"] >= since]

    publisher = Recording()
    relay = Relay()
    relay.route("order.*", publisher)
    async with relay, await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        assert await relay.replay(conn, since=since) == len(wanted)
        assert publisher.ids == wanted
        # A window that ends an hour ago: the burst and the spread events before it.
        publisher.ids.clear()
        until = now - datetime.timedelta(hours=1)
        await relay.replay(conn, since=since, until=until)
    assert publisher.ids == [r["id"] for r in rows if since <= r["finished_at"] < until]
    assert len(publisher.ids) > 2 * REPLAY_BATCH
