"""with_deadline_in_task: the hot path's statement timeout, on real statements that really hang.

A claim or an acknowledgement runs in the calling task under a timer instead
of a task of its own. These tests hold it to the same contract as with_deadline():
an answer in time comes back unchanged; no answer in time closes the socket
and raises TimeoutError (and leaves the calling task usable); a stop shortens
the wait; a cancellation from outside stays a cancellation, and also closes
the socket.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

from conveyor.worker.deadline import StopFlag, with_deadline_in_task


async def _connect(url: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url, autocommit=True)


async def test_an_answer_in_time_comes_back_unchanged(shared_db_url: str) -> None:
    conn = await _connect(shared_db_url)
    try:
        cur = await with_deadline_in_task(conn, conn.execute("SELECT 41 + 1"), 5.0)
        assert await cur.fetchone() == (42,)
        # The timer was disarmed: the connection is still open well after it would have fired.
        cur = await with_deadline_in_task(conn, conn.execute("SELECT 1"), 0.05)
        await asyncio.sleep(0.2)
        assert not conn.closed
        assert await (await conn.execute("SELECT 2")).fetchone() == (2,)
    finally:
        await conn.close()


async def test_no_answer_in_time_closes_the_socket_and_raises_timeout(shared_db_url: str) -> None:
    conn = await _connect(shared_db_url)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"within 0\.3s"):
            await with_deadline_in_task(conn, conn.execute("SELECT pg_sleep(30)"), 0.3)
        took = time.monotonic() - started
        # Far under the statement's 30 s: the deadline ended it, even on a loaded machine.
        assert 0.25 <= took < 15.0, took
        assert conn.closed
        # The timer's cancellation was taken back: this task goes on undisturbed.
        current = asyncio.current_task()
        assert current is not None and current.cancelling() == 0
        await asyncio.sleep(0.01)
    finally:
        await conn.close()


async def test_a_stop_shortens_the_wait_to_the_grace(shared_db_url: str) -> None:
    conn = await _connect(shared_db_url)
    stopping = StopFlag()
    try:
        asyncio.get_running_loop().call_later(0.1, stopping.set)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await with_deadline_in_task(conn, conn.execute("SELECT pg_sleep(120)"), 60.0,
                               stopping=stopping, grace=0.2)
        took = time.monotonic() - started
        # Far under the 60 s deadline: the stop shortened the wait, even on a loaded machine.
        assert 0.25 <= took < 20.0, took
        assert conn.closed
        assert stopping._callbacks == []   # nothing left registered on the flag
    finally:
        await conn.close()


async def test_statements_leave_no_callback_on_the_flag(shared_db_url: str) -> None:
    conn = await _connect(shared_db_url)
    stopping = StopFlag()
    try:
        for _ in range(5):
            await with_deadline_in_task(conn, conn.execute("SELECT 1"), 5.0, stopping=stopping)
        assert stopping._callbacks == []
        # Set later, the flag reaches no timer of a statement that already returned.
        stopping.set()
        assert not conn.closed
    finally:
        await conn.close()


async def test_a_cancellation_from_outside_stays_a_cancellation(shared_db_url: str) -> None:
    conn = await _connect(shared_db_url)
    pid = conn.info.backend_pid

    async def caller() -> str:
        try:
            await with_deadline_in_task(conn, conn.execute("SELECT pg_sleep(30)"), 0.5)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            assert current is not None and current.cancelling() == 1
            current.uncancel()
            # Past the old deadline: the timer went with the call, and cancels nothing.
            await asyncio.sleep(0.6)
            return "cancelled once"
        return "not cancelled"

    try:
        task = asyncio.ensure_future(caller())
        await asyncio.sleep(0.2)
        task.cancel()
        assert await task == "cancelled once"
        # The statement ended with its caller: its socket was cut, not politely
        # cancelled (which waits on the server), and the connection is lost.
        assert conn.closed
    finally:
        await conn.close()
        # Its client gone without a word, the server would sleep on for 30 s.
        async with await _connect(shared_db_url) as admin:
            await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


async def test_flag_calls_back_once_per_set() -> None:
    flag = StopFlag()
    calls: list[str] = []
    flag.add_callback(lambda: calls.append("a"))
    flag.add_callback(lambda: calls.append("b"))
    flag.set()
    flag.set()
    assert calls == ["a", "b"]
    assert flag.is_set()
    await asyncio.wait_for(flag.wait(), 1.0)   # still an asyncio.Event to waiters
