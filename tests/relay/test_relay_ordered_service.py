"""An ordered stream as a worker's service: one step at a time through ``run_once``,
and stopped by the event a worker hands it."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from conveyor.relay.ordered import LOCK_RETRY
from server_support import own_server
from worker_support import query

from .test_relay_ordered import Recorder, _insert, _stream

# A server of its own: a stream reads only events older than every transaction
# open in the cluster.
server_url, make_db, template_db, shared_db_url = own_server("conveyor-ordered-")


@pytest.fixture
def db(fresh_db: str) -> str:
    return fresh_db


async def test_only_the_session_holding_the_lock_publishes_and_in_order(db: str) -> None:
    leader, other = Recorder(), Recorder()
    first, second = _stream(db, leader), _stream(db, other)
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as a, \
            await psycopg.AsyncConnection.connect(db, autocommit=True) as b:
        ids = [await _insert(a, "order.x") for _ in range(3)]
        # Bounded only for a failure: another transaction on the shared server
        # may hold the events back for a while (the stream reads past no xmin).
        deadline = asyncio.get_running_loop().time() + 60
        while first.relayed < 3 and asyncio.get_running_loop().time() < deadline:
            wait = await first.run_once(a)
            await asyncio.sleep(min(wait, 0.02))
        assert first.leading
        assert await second.run_once(b) == LOCK_RETRY
        assert not second.leading
    assert leader.ids == ids
    assert other.ids == []
    rows = await query(db, "SELECT state FROM conveyor.events ORDER BY id")
    assert [r["state"] for r in rows] == ["succeeded"] * 3


async def test_a_stream_returns_once_the_event_it_was_handed_is_set(db: str) -> None:
    stream = _stream(db, Recorder())
    stopping = asyncio.Event()
    task = asyncio.ensure_future(stream.run(stopping))
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while not stream.leading and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert stream.leading
    finally:
        stopping.set()
        await asyncio.wait_for(task, 10)
    assert not stream.leading
