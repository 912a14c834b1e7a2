"""Fixtures of the reliability suite: a real PostgreSQL, a fault-injecting TCP proxy.

Every wait is bounded and every server started here is stopped in teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

from conveyor import BackoffPolicy, Router, Worker, WorkerConfig

FAST_BACKOFF = BackoffPolicy(base_delay=0.01, max_delay=0.05, jitter=0.0)


class _Pipe:
    """One proxied client connection: two pumps and a black-hole switch."""

    def __init__(self, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.client = client
        self.upstream = upstream
        self.holed = False          # drop every byte both ways, close nothing
        self.tasks: list[asyncio.Task[None]] = []

    @property
    def upstream_port(self) -> int:
        """The local port of the proxy's connection to the server (= the backend's client_port)."""
        return int(self.upstream[1].get_extra_info("sockname")[1])

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   proxy: BlackHoleProxy) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
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


class BlackHoleProxy:
    """A loopback TCP proxy in front of PostgreSQL (pg-boss ``halfOpenProxy`` shape).

    ``hole(port)`` makes one connection half-open: bytes both ways are read and
    discarded, nothing is closed, so the peer's kernel keeps ACKing and
    keepalives succeed: only an application-level timeout can notice.
    ``all_holed`` does it to every connection, new ones included (they hang in
    their handshake). ``heal()`` forwards again (dropped bytes stay lost). In
    ``stall`` mode nothing is dropped: the bytes wait and go through on heal (a
    frozen network path or a paused middlebox rather than a dead one).
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.mode = "drop"          # or "stall": hold the bytes and deliver them on heal()
        self.healed = asyncio.Event()
        self.pipes: list[_Pipe] = []
        self.all_holed = False
        self.dropped_bytes = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up = await asyncio.wait_for(asyncio.open_connection(*self.target), 5)
        except (OSError, TimeoutError):
            writer.close()
            return
        pipe = _Pipe((reader, writer), up)
        self.pipes.append(pipe)
        pipe.tasks = [asyncio.create_task(pipe.pump(reader, up[1], self)),
                      asyncio.create_task(pipe.pump(up[0], writer, self))]

    def hole(self, upstream_port: int) -> _Pipe:
        for pipe in self.pipes:
            if pipe.upstream_port == upstream_port:
                pipe.holed = True
                return pipe
        raise AssertionError(f"no proxied connection with upstream port {upstream_port}")

    def black_hole_all(self, mode: str = "drop") -> None:
        self.mode = mode
        self.healed.clear()
        self.all_holed = True

    def heal(self) -> None:
        self.all_holed = False
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


@pytest.fixture
async def proxy(fresh_db: str) -> AsyncIterator[BlackHoleProxy]:
    params = conninfo_to_dict(fresh_db)
    host = str(params.get("host") or "127.0.0.1")
    if host.startswith("/"):
        pytest.skip("the proxy needs a TCP server URL")
    p = BlackHoleProxy(host, int(params.get("port") or 5432))
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


def via(url: str, proxy: BlackHoleProxy) -> str:
    return make_conninfo(url, host="127.0.0.1", port=str(proxy.port))


def fast_config(**overrides: Any) -> WorkerConfig:
    options: dict[str, Any] = {
        "concurrency": 10, "batch_size": 10, "poll_interval": 0.5, "lease_ttl": 2.0,
        "heartbeat_interval": 0.5, "rescue_interval": 0.5, "shutdown_timeout": 2.0,
        "reconnect_min": 0.05, "reconnect_max": 0.5, "listener_ping_interval": 1.0,
        "backoff": FAST_BACKOFF,
    }
    options.update(overrides)
    return WorkerConfig(**options)


async def query(url: str, statement: str, params: Any = None) -> list[dict[str, Any]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True,
                                                     row_factory=dict_row) as conn:
        cur = await conn.execute(statement, params)
        return await cur.fetchall() if cur.description else []


async def wait_until(check: Callable[[], Awaitable[bool]], *, timeout: float,
                     interval: float = 0.02, what: str = "condition") -> float:
    start = time.monotonic()
    while True:
        if await check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


async def state_counts(url: str) -> dict[str, int]:
    rows = await query(url, "SELECT state, count(*) AS n FROM conveyor.events GROUP BY state")
    return {r["state"]: r["n"] for r in rows}


@contextlib.asynccontextmanager
async def running(worker: Worker, *, stop_timeout: float = 15.0) -> AsyncIterator[asyncio.Task[None]]:
    """Run a worker as a task; stop it on exit with a deadline, cancel it past that."""
    task = asyncio.create_task(worker.run())
    try:
        waiter = asyncio.ensure_future(worker.started.wait())
        done, _ = await asyncio.wait({waiter, task}, timeout=15,
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
        assert waiter in done, "worker did not start within 15s"
        await asyncio.wait_for(worker.listener.connected.wait(), 15)
        yield task
    finally:
        worker.request_stop()
        try:
            await asyncio.wait_for(asyncio.shield(task), stop_timeout)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 5)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(worker.close(), 5)
            raise AssertionError(f"worker did not stop within {stop_timeout}s") from None
        await worker.close()


def router_for(pattern: str, handler: Any, **options: Any) -> Router:
    router = Router()
    router.add(pattern, handler, **options)
    return router


@pytest.fixture
def scratch_db(server_url: str, template_db: str) -> Iterator[str]:
    """Like fresh_db, for tests that need a second database."""
    name = f"conveyor_r_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"'.encode())
    yield make_conninfo(server_url, dbname=name)
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
