"""One dedicated async connection that reconnects with jittered backoff."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import psycopg

from conveyor.db.connect import behind_pooler_async, connect_async
from conveyor.errors import DatabaseUnavailableError, InvalidDatabaseUrlError
from conveyor.worker.backoff import Backoff
from conveyor.worker.deadline import cut, with_deadline

log = logging.getLogger(__name__)

# Errors after which the connection is presumed dead and replaced.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    DatabaseUnavailableError,
    OSError,
)
# ...and the same plus a timeout, for loops that bound their waits.
RECOVERABLE_ERRORS: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, TimeoutError)


class StopRequested(Exception):
    """Raised by :meth:`ManagedConnection.get` when the worker is stopping and gave up waiting."""


PROBE_INTERVAL = 1.0
RECOVERY_WINDOW = 15.0


async def probe_server(conninfo: str, timeout: float = 1.0) -> bool | None:
    """Whether the server's socket accepts a connection; ``None`` when it cannot be told."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return None
    host = str(params.get("host") or "")
    port = str(params.get("port") or "5432")
    if not host or "," in host or "," in port or not port.isdigit():
        return None
    try:
        if host.startswith("/"):
            opening = asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
        else:
            opening = asyncio.open_connection(host, int(port))
        _reader, writer = await asyncio.wait_for(opening, timeout)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


class CursorCache:
    """One cursor kept for a component's hot statements, remade with its connection.

    Making a cursor sets up its adaptation state each time, a large share of a
    claim's client CPU (hot path, measured: see docs/benchmarks.md). A worker
    component (the fetch loop, the completer) runs its statements one after
    the other, so one cursor serves them all; when the component's connection
    is replaced, the next ``get`` makes a new cursor and lets go of the old
    connection.
    """

    def __init__(self, *, binary: bool = False,
                 setup: Callable[[psycopg.AsyncCursor[Any]], None] | None = None) -> None:
        self._binary = binary
        self._setup = setup     # adapts each new cursor (its loaders, say)
        self._cursor: psycopg.AsyncCursor[Any] | None = None

    def get(self, conn: psycopg.AsyncConnection[Any]) -> psycopg.AsyncCursor[Any]:
        cur = self._cursor
        if cur is None or cur.connection is not conn:
            cur = self._cursor = conn.cursor(binary=self._binary)
            if self._setup is not None:
                self._setup(cur)
        return cur


class SessionMode:
    """Whether session state (settings, prepared statements) may be kept on a URL.

    Shared by a worker's connections to one URL. ``pooled`` is ``True`` when a
    pooler stands between the worker and PostgreSQL, ``False`` when it does
    not, and ``None`` until the first connection finds out: it compares the
    backend pid the server reports with the one announced at connect time,
    which a pooler (PgBouncer, and others) makes up for its own clients. In
    transaction pooling a session setting or a prepared statement would stay
    on whichever server connection ran it: settings would leak into other
    clients' sessions, and statement names would collide.
    """

    def __init__(self, pooled: bool | None = None) -> None:
        # None: not known yet (checked on the first connect); False is trusted.
        self.pooled = pooled

    async def settle(self, conn: psycopg.AsyncConnection[Any], role: str) -> None:
        if self.pooled is not None:
            return
        self.pooled = await behind_pooler_async(conn)
        if self.pooled:
            log.warning(
                "the %s connection goes through a connection pooler (the server's backend pid "
                "differs from the one announced at connect): in case it pools transactions, "
                "the worker keeps no session settings or prepared statements there; say "
                "--transaction-pooler to confirm (and --listen-url for a direct LISTEN), or "
                "--no-transaction-pooler if it pools whole sessions", role,
                extra={"action": "pooler_detected", "role": role})


class ConnectionGate(Protocol):
    """Admits the connections a worker opens only now and then (its flow claims', its
    stall watchdog's) within a budget it shares with others: a multi-tenant worker's
    per-server one (conveyor.tenancy.budget). Called from the event loop and from the
    watchdog's thread alike, so an implementation takes a lock, never the loop."""

    def try_acquire(self) -> bool: ...

    def release(self) -> None: ...


class ManagedConnection:
    """A lazily (re)opened autocommit connection owned by one worker component.

    ``get()`` returns a live connection, waiting out the backoff while the
    database is away; ``discard()`` drops a connection that failed so the next
    ``get()`` opens a new one. With a ``gate``, a connection is opened only once
    the gate admits it (and waits out the backoff while it does not); it is
    given back when the connection closes.
    """

    def __init__(self, conninfo: str, role: str, *, reconnect_min: float, reconnect_max: float,
                 stopping: asyncio.Event, settings: dict[str, str] | None = None,
                 mode: SessionMode | None = None, gate: ConnectionGate | None = None,
                 query_timeout: float = 30.0, **connect_kwargs: Any) -> None:
        self.conninfo = conninfo
        self.role = role
        self._gate = gate
        self._admitted = False
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._connecting = asyncio.Lock()
        self._backoff = Backoff.doubling(reconnect_min, reconnect_max)
        self._stopping = stopping
        self._kwargs = connect_kwargs
        # Session settings applied after every (re)connect; set this way rather
        # than through "options" so a user's own options in the URL still apply.
        self._settings = dict(settings or {})
        # The bound of the statements that set a new connection up: the server
        # may stop answering between the connect and them.
        self._query_timeout = query_timeout
        self._mode = mode or SessionMode(pooled=False)
        self.reconnects = 0
        self._ever_connected = False
        self._saw_down = False
        self._recovering_until = 0.0

    async def _set_up(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """A new connection's session: a pooler found or not, then the settings."""
        await self._mode.settle(conn, self.role)
        if self._mode.pooled:
            conn.prepare_threshold = None
        elif self._settings:
            # One round trip for all of them: a fleet reconnecting after a
            # restart, or a worker replacing a killed one, starts sooner.
            await conn.execute(
                "SELECT " + ", ".join(["set_config(%s, %s, false)"] * len(self._settings)),
                [part for item in self._settings.items() for part in item])

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    @property
    def pooled(self) -> bool | None:
        """Whether a pooler stands between this connection and PostgreSQL (None: not
        known before the first connect)."""
        return self._mode.pooled

    async def get(self, *, give_up_on_stop: bool = True) -> psycopg.AsyncConnection[Any]:
        while True:
            if self._conn is not None and not self._conn.closed:
                return self._conn
            if give_up_on_stop and self._stopping.is_set():
                raise StopRequested(f"{self.role} connection not needed: stopping")
            try:
                # One connection attempt at a time: two callers finding no
                # connection (the fetch loop and a probe, the heartbeat and the
                # listener's probe) would otherwise both connect, and the one
                # overwritten would stay open, unused, until the process exits.
                async with self._connecting:
                    if self._conn is not None and not self._conn.closed:
                        return self._conn
                    if not self._admit():
                        await self._sleep(self._backoff.next_delay(),
                                          interruptible=give_up_on_stop)
                        continue
                    try:
                        conn = await connect_async(
                            self.conninfo, autocommit=True,
                            application_name=f"conveyor-{self.role}", **self._kwargs)
                    except BaseException:
                        self._let_go()
                        raise
                    try:
                        # Under a deadline like every other statement: a server that
                        # stopped answering right after the connect (packets swallowed,
                        # nothing closed) held the connection, and every caller waiting
                        # for it, for ever (a multi-tenant worker's tenant never came
                        # back: tests/workflow/test_multitenant.py).
                        await with_deadline(conn, self._set_up(conn), self._query_timeout)
                    except BaseException:
                        await conn.close()
                        self._let_go()
                        raise
                    self._conn = conn
            except InvalidDatabaseUrlError:
                raise   # no retry can make a URL parse
            except CONNECTION_ERRORS as exc:
                delay = self._backoff.next_delay()
                log.warning("database unreachable for %s connection, retrying in %.1fs: %s",
                            self.role, delay, exc,
                            extra={"action": "reconnect_wait", "role": self.role})
                await self._wait_for_server(delay, interruptible=give_up_on_stop)
                continue
            if self._ever_connected:
                self.reconnects += 1
                log.info("%s connection re-established", self.role,
                         extra={"action": "reconnected", "role": self.role})
            self._ever_connected = True
            self._backoff.reset()
            return self._conn

    def _admit(self) -> bool:
        if self._gate is None or self._admitted:
            return True
        self._admitted = self._gate.try_acquire()
        if not self._admitted:
            log.info("no room for the %s connection in the connection budget; retrying",
                     self.role, extra={"action": "connection_deferred", "role": self.role})
        return self._admitted

    def _let_go(self) -> None:
        if self._gate is not None and self._admitted:
            self._admitted = False
            self._gate.release()

    async def _wait_for_server(self, delay: float, *, interruptible: bool = True) -> None:
        """Sleep out a backoff step, cut short when the server comes back.

        Backoff keeps a long outage from being hammered with logins, but after a
        restart it would leave the worker idle for up to ``reconnect_max``. So
        while waiting, the server's socket is probed every second (a bare TCP or
        Unix-socket connect, no login); once a probe that failed succeeds, the
        wait ends and, for a short while, so does every wait after it (the
        server may still be starting up).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + delay
        while not (interruptible and self._stopping.is_set()):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            await self._sleep(min(PROBE_INTERVAL, remaining), interruptible=interruptible)
            if loop.time() < self._recovering_until:
                return
            reachable = await probe_server(self.conninfo)
            if reachable is None:
                continue  # cannot tell where the server is: plain backoff
            if not reachable:
                self._saw_down = True
            elif self._saw_down:
                self._saw_down = False
                self._recovering_until = loop.time() + RECOVERY_WINDOW
                return

    async def _sleep(self, delay: float, *, interruptible: bool = True) -> None:
        """Sleep ``delay``; an interruptible sleep ends early when the worker stops.

        Work that must go on while stopping (acknowledgements) sleeps without
        interruption, or it would retry in a tight loop once stopping is set.
        """
        if not interruptible:
            await asyncio.sleep(delay)
            return
        try:
            await asyncio.wait_for(self._stopping.wait(), timeout=delay)
        except TimeoutError:
            pass

    async def discard(self, exc: BaseException | None = None) -> None:
        conn, self._conn = self._conn, None
        if exc is not None:
            log.warning("%s connection lost: %s", self.role,
                        (str(exc).strip().splitlines() or [type(exc).__name__])[0],
                        extra={"action": "connection_lost", "role": self.role})
        if conn is not None:
            try:
                await conn.close()
            except Exception:  # noqa: BLE001 - it is already broken; closing is best effort
                pass
        self._let_go()

    async def pause_after_failure(self, *, interruptible: bool = True) -> None:
        """Wait out one backoff step (used after an error on a connection that still looks up)."""
        await self._sleep(self._backoff.next_delay(), interruptible=interruptible)

    def abort(self) -> None:
        """Close the socket now: a statement in flight fails without waiting on the server.

        For a task about to be cancelled: with the connection gone, psycopg
        skips asking the server to cancel (which could wait on a dead server).
        Statements under a deadline do this themselves when cancelled; the
        others (a transaction's own statements) need it done for them.
        """
        if self._conn is not None and not self._conn.closed:
            cut(self._conn)

    async def close(self) -> None:
        await self.discard()
