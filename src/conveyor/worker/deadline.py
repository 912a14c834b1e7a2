"""Statement deadlines: no worker statement may wait on the database for ever.

A half-open connection (the peer's kernel still ACKs, nothing answers) hangs
a statement for good, and TCP keepalives cannot see it. Every statement a
worker runs is therefore bounded: past its deadline the socket is closed and
``TimeoutError`` raised, which the caller treats as a lost connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg

T = TypeVar("T")


def unwatch(conn: psycopg.AsyncConnection[Any]) -> None:
    """Take ``conn``'s socket out of the running event loop, before it is closed.

    A task awaiting a statement on ``conn`` has the socket registered with the
    loop's selector; psycopg removes it when the task wakes. Closed under it,
    the descriptor leaves that entry behind, and a socket opened meanwhile
    takes the same number: registering it then fails (psycopg's "connection
    socket closed" on connect). Without the entry, the waiting task wakes on
    its own interval and finds the connection closed.
    """
    try:
        fd = conn.pgconn.socket
        loop = asyncio.get_running_loop()
    except (psycopg.OperationalError, RuntimeError):
        return      # closed already, or no loop to take it out of
    loop.remove_reader(fd)
    loop.remove_writer(fd)


async def with_deadline(conn: psycopg.AsyncConnection[Any], statement: Awaitable[T], timeout: float, *,
                  stopping: asyncio.Event | None = None, grace: float = 1.0) -> T:
    """Await a statement on ``conn`` for at most ``timeout`` seconds.

    A half-open connection (the peer's kernel still ACKs, nothing answers)
    would otherwise hang the statement forever: TCP keepalives cannot see it.
    On expiry the socket is closed outright, which fails the statement at once
    (a polite cancel would first wait on the same dead connection), and
    TimeoutError is raised for the caller to treat as a lost connection. With
    ``stopping``, a stop request shortens the wait to ``grace`` seconds, so a
    worker can always shut down.
    """
    task = asyncio.ensure_future(statement)
    stop_task = None
    waiters: set[asyncio.Future[Any]] = {task}
    if stopping is not None and not stopping.is_set():
        stop_task = asyncio.ensure_future(stopping.wait())
        waiters.add(stop_task)
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task not in done and stopping is not None and stopping.is_set():
            done, _ = await asyncio.wait({task}, timeout=grace)
    except asyncio.CancelledError:
        # The caller was cancelled: take the statement down with it, and retrieve
        # its outcome so asyncio does not report it as never retrieved.
        task.cancel()
        task.add_done_callback(_retrieve)
        raise
    finally:
        if stop_task is not None:
            stop_task.cancel()
    if task in done:
        return task.result()
    unwatch(conn)
    conn.pgconn.finish()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - it failed because we closed its socket
        pass
    raise TimeoutError(f"no answer from the database within {timeout:g}s; connection dropped")


class StopFlag(asyncio.Event):
    """An :class:`asyncio.Event` that also calls back when it is set.

    Lets a timer armed by :func:`with_deadline_in_task` be shortened the moment the
    worker stops, without a task sitting in ``wait()`` for every statement.
    """

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []

    def set(self) -> None:
        if self.is_set():
            return
        super().set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once) when the flag is next set."""
        self._callbacks.append(callback)

    def remove_callback(self, callback: Callable[[], None]) -> None:
        try:
            self._callbacks.remove(callback)
        except ValueError:
            pass


async def with_deadline_in_task(conn: psycopg.AsyncConnection[Any], statement: Awaitable[T],
                       timeout: float, *, stopping: StopFlag | None = None,
                       grace: float = 1.0) -> T:
    """:func:`with_deadline` for the hot path: the statement runs in the calling task.

    Same contract (at most ``timeout`` seconds, then the socket is closed and
    TimeoutError raised; a stop shortens the wait to ``grace``), but a timer
    replaces the statement's own task and ``asyncio.wait()``: a claim or an
    acknowledgement costs about 50 us less CPU and reaches the wire one loop
    round sooner. The difference: if the caller is cancelled, psycopg first
    asks the server to cancel the statement, which waits on the connection
    (the timer still bounds that wait). Callers cancelled from outside close
    the connection first (see ``ManagedConnection.abort``).
    """
    task = asyncio.current_task()
    if task is None:
        return await with_deadline(conn, statement, timeout, stopping=stopping, grace=grace)
    loop = task.get_loop()
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        unwatch(conn)
        conn.pgconn.finish()   # fails the statement without a word to the server
        task.cancel()

    handle = loop.call_later(timeout, expire)

    def shorten() -> None:
        nonlocal handle
        if handle.when() > loop.time() + grace:
            handle.cancel()
            handle = loop.call_later(grace, expire)

    watching = stopping is not None and not stopping.is_set()
    if watching:
        assert stopping is not None
        stopping.add_callback(shorten)
    try:
        return await statement
    except asyncio.CancelledError:
        if expired and task.uncancel() == 0:
            raise TimeoutError(f"no answer from the database within {timeout:g}s; "
                               "connection dropped") from None
        raise
    finally:
        handle.cancel()
        if watching:
            assert stopping is not None
            stopping.remove_callback(shorten)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
