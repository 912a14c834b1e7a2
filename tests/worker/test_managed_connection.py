"""A managed connection opens one connection however many callers ask for it at once."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import psycopg
import pytest

from conveyor.worker.connection import ManagedConnection
from reliability.helpers import BlackHoleProxy, via
from waiting import wait_until
from worker_support import WORKER_BACKENDS, query


async def test_concurrent_callers_share_one_new_connection(db: str) -> None:
    managed = ManagedConnection(db, "fetch", reconnect_min=0.05, reconnect_max=0.2,
                                stopping=asyncio.Event())
    try:
        got = await asyncio.gather(*(managed.get() for _ in range(5)))
        assert len({id(conn) for conn in got}) == 1
        with psycopg.connect(db) as admin:
            row = admin.execute(WORKER_BACKENDS).fetchone()
        # Before the lock every caller connected and four connections were left open.
        assert row == (1,)
        await got[0].close()
        again = await asyncio.gather(*(managed.get() for _ in range(3)))
        assert len({id(conn) for conn in again}) == 1 and again[0] is not got[0]
    finally:
        await managed.close()


async def _next_socket_gets(fd: int) -> list[socket.socket]:
    """Hold every free descriptor below ``fd``, so the next socket opened gets ``fd``."""
    held = []
    while (s := socket.socket()).fileno() != fd:
        held.append(s)
        assert len(held) < 1000, f"descriptor {fd} never came free"
    s.close()
    return held


async def _statement_in_flight(managed: ManagedConnection, db: str
                               ) -> tuple[int, int, asyncio.Task[Any]]:
    """A statement awaited on ``managed``'s connection: its backend, its socket, and the
    task waiting."""
    conn = await managed.get()
    pid, fd = conn.info.backend_pid, conn.pgconn.socket
    statement = asyncio.create_task(conn.execute("SELECT pg_sleep(30)"))

    async def running() -> bool:
        rows = await query(db, "SELECT 1 FROM pg_stat_activity WHERE pid = %s "
                               "AND state = 'active'", (pid,))
        return bool(rows)
    await wait_until(running, timeout=10, what="the statement to run")
    return pid, fd, statement


async def test_an_aborted_connection_lets_the_next_connect_take_its_socket_number(
        db: str) -> None:
    # At shutdown the completer's statement is cut (abort) and its task cancelled.
    # Until that task wakes, the loop's selector kept the closed socket's entry, and
    # a connect given the same number failed: "connection socket closed" (CI, a
    # cron test's connect after its worker stopped).
    managed = ManagedConnection(db, "cut", reconnect_min=0.05, reconnect_max=0.2,
                                stopping=asyncio.Event())
    pid, fd, statement = await _statement_in_flight(managed, db)
    managed.abort()
    statement.cancel()
    held = await _next_socket_gets(fd)
    try:
        other = await psycopg.AsyncConnection.connect(db, autocommit=True)
        try:
            assert other.pgconn.socket == fd              # the closed socket's number
            assert await (await other.execute("SELECT 1")).fetchone() == (1,)
        finally:
            await other.close()
    finally:
        for s in held:
            s.close()
        with contextlib.suppress(BaseException):
            await statement
        await managed.close()
        # Its client gone without a word, the server would sleep on for 30 s.
        await query(db, "SELECT pg_terminate_backend(%s)", (pid,))


async def test_a_gated_connection_waits_for_room_and_gives_it_back_when_closed(db: str) -> None:
    from conveyor.tenancy.budget import ConnectionLedger

    ledger = ConnectionLedger(limit=1)
    assert ledger.take(1)                 # the budget is full
    managed = ManagedConnection(db, "flow", reconnect_min=0.05, reconnect_max=0.1,
                                stopping=asyncio.Event(), gate=ledger)
    try:
        getting = asyncio.create_task(managed.get())
        await asyncio.sleep(0.3)
        assert not getting.done() and not managed.connected   # no room: no connection
        ledger.give(1)
        conn = await asyncio.wait_for(getting, 5)
        assert not conn.closed and ledger.in_use == 1
        await managed.discard()
        assert ledger.in_use == 0         # closed: the room is given back
    finally:
        await managed.close()
    assert ledger.in_use == 0


async def test_a_server_that_stops_answering_after_the_connect_is_given_up_on(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    # The connect succeeds, then the statement that sets the session up is
    # swallowed (nothing closed). Without a deadline on it, the connection and
    # every caller waiting for it hung for ever: a multi-tenant worker's tenant
    # whose database came back never ran again (its acknowledgements waited
    # here, its claims for their slots).
    target = psycopg.conninfo.conninfo_to_dict(db)
    proxy = BlackHoleProxy(str(target.get("host") or "127.0.0.1"), int(target.get("port") or 5432))
    await proxy.start()
    proxy.queries_holed = True
    managed = ManagedConnection(via(db, proxy), "ack", reconnect_min=0.05, reconnect_max=0.2,
                                stopping=asyncio.Event(), settings={"jit": "off"},
                                query_timeout=0.5)
    getting = asyncio.create_task(managed.get())
    try:
        await wait_until(lambda: _true("database unreachable for ack connection" in caplog.text),
                         timeout=10, what="the swallowed set-up given up on")
        assert not getting.done()      # still trying, as for any unreachable server
        proxy.heal()
        conn = await asyncio.wait_for(getting, 10)
        cur = await conn.execute("SELECT current_setting('jit')")
        assert await cur.fetchone() == ("off",)
    finally:
        getting.cancel()
        await managed.close()
        await proxy.stop()


async def _true(value: bool) -> bool:
    return value


async def test_a_connect_cancelled_midway_leaves_no_connection_behind(db: str) -> None:
    # A worker whose service failed at once stopped while its listener was still
    # connecting: the cancelled connect left its half-made connection to psycopg's
    # generator, and the run()'s error (which holds the listener task, and so the
    # frames of the cancelled connect) kept it open after the worker had stopped
    # (the second pass of CI, under Python 3.12). Cancelled at points across a
    # connect, with every cancellation kept as that error kept it.
    kept: list[BaseException] = []
    for step in range(40):
        managed = ManagedConnection(db, "midway", reconnect_min=0.05, reconnect_max=0.2,
                                    stopping=asyncio.Event())
        getting = asyncio.create_task(managed.get())
        await asyncio.sleep(step * 0.0005)     # a cancellation point, not a wait
        getting.cancel()
        try:
            await getting
        except asyncio.CancelledError as exc:
            kept.append(exc)
        await managed.close()

    async def none_left() -> bool:
        rows = await query(db, "SELECT count(*) AS n FROM pg_stat_activity "
                               "WHERE application_name = 'conveyor-midway'")
        return rows[0]["n"] == 0
    await wait_until(none_left, timeout=5, what="no connection left by a cancelled connect")
    assert any(isinstance(exc, asyncio.CancelledError) for exc in kept)
