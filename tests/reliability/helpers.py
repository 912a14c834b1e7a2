"""Helpers of the reliability suite: a fault-injecting TCP proxy and quick worker settings.

The in-process worker helpers shared with tests/worker are in ``tests/worker_support.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

import worker_support
from conveyor import BackoffPolicy, Worker, WorkerConfig
from worker_support import query

FAST_BACKOFF = BackoffPolicy(base_delay=0.01, max_delay=0.05, jitter=0.0)


class _BackendKeySniffer:
    """Reads the backend pid from the start of a server->client byte stream.

    The proxy sees every byte, so it can tell which backend serves a proxied
    connection without relying on the upstream socket (a Unix socket has no
    client port). Before the startup packet the server may answer an
    SSLRequest or GSSENCRequest with one unframed byte: ``N`` (go on in
    clear), ``S`` or ``G`` (encrypted from here: nothing more to read). Then
    come framed messages (type, int32 length counting itself, payload) up to
    ReadyForQuery; BackendKeyData (``K``) carries the pid in its first four
    bytes, in protocol 3.0 and 3.2 alike.
    """

    MAX_STARTUP_MESSAGE = 1 << 20

    def __init__(self) -> None:
        self.pid: int | None = None
        self.encrypted = False
        self.done = False
        self._negotiating = True
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        if self.done:
            return
        self._buffer += data
        while not self.done and self._next():
            pass

    def _next(self) -> bool:
        """Consume one answer or message if the buffer holds it whole; say whether it did."""
        buffer = self._buffer
        if not buffer:
            return False
        if self._negotiating and buffer[:1] in (b"N", b"S", b"G"):
            self.encrypted = buffer[:1] != b"N"
            self.done = self.encrypted
            del buffer[:1]
            return True
        self._negotiating = False
        if len(buffer) < 5:
            return False
        kind, length = buffer[:1], int.from_bytes(buffer[1:5], "big")
        if length < 4 or length > self.MAX_STARTUP_MESSAGE:
            self.done = True            # not a startup exchange we understand
            return False
        if len(buffer) < 1 + length:
            return False
        if kind == b"K" and length >= 8:
            self.pid = int.from_bytes(buffer[5:9], "big")
        self.done = kind in (b"K", b"Z", b"E")
        del buffer[:1 + length]
        return True


class _Pipe:
    """One proxied client connection: two pumps and a black-hole switch."""

    def __init__(self, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.client = client
        self.upstream = upstream
        self.holed = False          # drop every byte both ways, close nothing
        self.sniffer = _BackendKeySniffer()
        self.tasks: list[asyncio.Task[None]] = []

    @property
    def backend_pid(self) -> int | None:
        """The pid of the server backend behind this connection (``pg_stat_activity.pid``)."""
        return self.sniffer.pid

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   proxy: BlackHoleProxy, sniffer: _BackendKeySniffer | None = None) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if sniffer is not None:
                    sniffer.feed(data)
                if sniffer is None and proxy.queries_holed and self.sniffer.pid is not None:
                    # The client's first statement after its handshake, and all after.
                    proxy.dropped_bytes += len(data)
                    continue
                if self.holed or proxy.all_holed:
                    if proxy.mode == "drop":
                        proxy.dropped_bytes += len(data)
                        continue
                    while self.holed or proxy.all_holed:   # stall: hold the bytes
                        await proxy.healed.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def close(self) -> None:
        for _, w in (self.client, self.upstream):
            with contextlib.suppress(Exception):
                w.close()
        for t in self.tasks:
            t.cancel()


def socket_path(host: str, port: int) -> str | None:
    """The Unix socket libpq would use for ``host``/``port``, or None for TCP.

    As in libpq, a host starting with ``/`` is a socket directory and one
    starting with ``@`` a directory in Linux's abstract namespace.
    """
    if host.startswith("/"):
        return os.path.join(host, f".s.PGSQL.{port}")
    if host.startswith("@"):
        return "\0" + os.path.join(host[1:], f".s.PGSQL.{port}")
    return None


class BlackHoleProxy:
    """A loopback TCP proxy in front of PostgreSQL (pg-boss ``halfOpenProxy`` shape).

    The proxy listens on 127.0.0.1 TCP and dials the server over TCP, or over
    its Unix socket when ``target_host`` is a socket directory (the embedded
    server listens on a socket only). Connections are named by their backend
    pid, read from the server's BackendKeyData as it passes through.

    ``hole(pid)`` makes one connection half-open: bytes both ways are read and
    discarded, nothing is closed, so the peer's kernel keeps ACKing and
    keepalives succeed: only an application-level timeout can notice.
    ``all_holed`` does it to every connection, new ones included (they hang in
    their handshake). ``queries_holed`` lets every new connection through its
    handshake and then drops what its client sends: a server that stops
    answering right after a connect. ``heal()`` forwards again (dropped bytes
    stay lost). In
    ``stall`` mode nothing is dropped: the bytes wait and go through on heal (a
    frozen network path or a paused middlebox rather than a dead one).
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.unix_path = socket_path(target_host, target_port)
        self.mode = "drop"          # or "stall": hold the bytes and deliver them on heal()
        self.healed = asyncio.Event()
        self.pipes: list[_Pipe] = []
        self.all_holed = False
        self.queries_holed = False
        self.dropped_bytes = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def _dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.unix_path is not None:
            return await asyncio.open_unix_connection(self.unix_path)
        return await asyncio.open_connection(*self.target)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up = await asyncio.wait_for(self._dial(), 5)
        except (OSError, TimeoutError):
            writer.close()
            return
        pipe = _Pipe((reader, writer), up)
        self.pipes.append(pipe)
        pipe.tasks = [asyncio.create_task(pipe.pump(reader, up[1], self)),
                      asyncio.create_task(pipe.pump(up[0], writer, self, pipe.sniffer))]

    def hole(self, backend_pid: int) -> _Pipe:
        """Black-hole the connection served by backend ``backend_pid`` (``pg_stat_activity.pid``)."""
        for pipe in self.pipes:
            if pipe.backend_pid == backend_pid:
                pipe.holed = True
                return pipe
        known = [pipe.backend_pid for pipe in self.pipes]
        encrypted = sum(pipe.sniffer.encrypted for pipe in self.pipes)
        raise AssertionError(f"no proxied connection to backend {backend_pid}; "
                             f"proxied backends: {known} ({encrypted} encrypted, unreadable)")

    def black_hole_all(self, mode: str = "drop") -> None:
        self.mode = mode
        self.healed.clear()
        self.all_holed = True

    def heal(self) -> None:
        self.all_holed = False
        self.queries_holed = False
        for pipe in self.pipes:
            pipe.holed = False
        self.healed.set()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for pipe in self.pipes:
            pipe.close()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)


def via(url: str, proxy: BlackHoleProxy) -> str:
    # In clear: the proxy reads each connection's backend pid from the stream.
    # hostaddr too, or a hostaddr in the URL would bypass the proxy.
    return make_conninfo(url, host="127.0.0.1", hostaddr="127.0.0.1", port=str(proxy.port),
                         sslmode="disable", gssencmode="disable")


def fast_config(**overrides: Any) -> WorkerConfig:
    options: dict[str, Any] = {
        "concurrency": 10, "batch_size": 10, "poll_interval": 0.5, "lease_ttl": 2.0,
        "heartbeat_interval": 0.5, "rescue_interval": 0.5, "shutdown_timeout": 2.0,
        "reconnect_min": 0.05, "reconnect_max": 0.5, "listener_ping_interval": 1.0,
        "backoff": FAST_BACKOFF,
    }
    options.update(overrides)
    return WorkerConfig(**options)


async def state_counts(url: str) -> dict[str, int]:
    """The events by state, read on a connection of the test's own (the observer).

    A connection attempt that fails is tried again: in the half-open tests the
    worker closes its black-holed sockets in the same event loop, and once
    (CI, 2026-12-02) the observer's new connection failed in psycopg's wait
    ("connection socket closed", the selector missing its descriptor). The
    observer's trouble is not the worker's: what is asserted is the counts.
    """
    for attempt in range(3):
        try:
            rows = await query(url, "SELECT state, count(*) AS n FROM conveyor.events"
                                    " GROUP BY state")
            return {r["state"]: r["n"] for r in rows}
        except psycopg.OperationalError:
            if attempt == 2:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError("unreachable")


def running(worker: Worker, *, stop_timeout: float = 15.0
            ) -> contextlib.AbstractAsyncContextManager[asyncio.Task[None]]:
    """``worker_support.running`` with the longer deadlines of servers that restart."""
    return worker_support.running(worker, stop_timeout=stop_timeout, start_timeout=15.0)
