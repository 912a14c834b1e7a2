"""Statement deadlines: no worker statement may wait on the database for ever.

A half-open connection (the peer's kernel still ACKs, nothing answers) hangs
a statement for good, and TCP keepalives cannot see it. Every statement a
worker runs is therefore bounded: past its deadline the socket is closed and
``TimeoutError`` raised, which the caller treats as a lost connection.

A statement whose caller is cancelled ends with its caller, the same way: its
socket is closed, not politely cancelled (see :class:`_EndsWithCaller`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator
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


def cut(conn: psycopg.AsyncConnection[Any]) -> None:
    """Close ``conn``'s socket without a word to the server; its owner replaces it."""
    unwatch(conn)
    conn.pgconn.finish()


class _EndsWithCaller(Generator[Any, Any, T]):
    """Awaits ``statement``; a cancellation on its way into it first cuts ``conn``.

    psycopg meets a cancellation inside a statement by asking the server to
    cancel it, on a new connection, then waiting on this one for the statement
    to end: up to 5 s each when the server is gone or half-open, and a socket
    its owner closes meanwhile stays registered in the loop. Cut before
    psycopg sees the cancellation, the connection has no statement left to
    cancel, so psycopg raises at once; and its own clean-up (taking the socket
    out of the loop) runs in the same step as the close, before any new socket
    can take the number. The server is not told: the statement runs on there
    until it ends or meets its statement_timeout, as after a deadline. An
    iterator of our own rather than a task around the statement: it costs one
    method call per wake-up (hot path, measured: see docs/benchmarks.md).
    """

    __slots__ = ("_conn", "_inner")

    def __init__(self, conn: psycopg.AsyncConnection[Any], statement: Awaitable[T]) -> None:
        self._conn = conn
        self._inner = statement.__await__()

    def __await__(self) -> Generator[Any, Any, T]:
        return self

    def __next__(self) -> Any:
        return self._inner.send(None)

    def send(self, value: Any) -> Any:
        return self._inner.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None, /) -> Any:
        exc = typ if val is None else val
        if isinstance(exc, asyncio.CancelledError) or (
                isinstance(exc, type) and issubclass(exc, asyncio.CancelledError)):
            cut(self._conn)
        if val is None and tb is None:
            return self._inner.throw(typ)
        return self._inner.throw(typ, val, tb)

    def close(self) -> None:
        self._inner.close()


async def with_deadline(conn: psycopg.AsyncConnection[Any], statement: Awaitable[T], timeout: float, *,
                  stopping: asyncio.Event | None = None, grace: float = 1.0) -> T:
    """Await a statement on ``conn`` for at most ``timeout`` seconds.

    A half-open connection (the peer's kernel still ACKs, nothing answers)
    would otherwise hang the statement forever: TCP keepalives cannot see it.
    On expiry the socket is closed outright, which fails the statement at once
    (a polite cancel would first wait on the same dead connection), and
    TimeoutError is raised for the caller to treat as a lost connection. With
    ``stopping``, a stop request shortens the wait to ``grace`` seconds, so a
    worker can always shut down. A cancelled caller takes the statement down
    with it, closing the socket the same way.
    """
    task = asyncio.ensure_future(_EndsWithCaller(conn, statement))
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
        # The caller was cancelled: take the statement down with it (its socket
        # closed as the cancellation reaches it), and retrieve its outcome so
        # asyncio does not report it as never retrieved.
        task.cancel()
        task.add_done_callback(_retrieve)
        raise
    finally:
        if stop_task is not None:
            stop_task.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - it failed because we closed its socket
        pass
    # Already closed, unless the statement ended between the wait and the
    # cancellation: dropped all the same, as the error says.
    cut(conn)
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
    round sooner. A caller cancelled from outside gets its CancelledError at
    once, and ``conn`` is closed.
    """
    task = asyncio.current_task()
    if task is None:
        return await with_deadline(conn, statement, timeout, stopping=stopping, grace=grace)
    loop = task.get_loop()
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        # The cancellation cuts the socket as it reaches the statement: closed
        # here, its number could go to a new socket before psycopg, waking,
        # takes it out of the loop.
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
        return await _EndsWithCaller(conn, statement)
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
