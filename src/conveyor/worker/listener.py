"""The dedicated LISTEN connection: turns NOTIFY hints into wake-ups.

It never shares its connection: a pooled connection would silently drop the
LISTEN when it is handed to someone else. After every (re)connect it asks for
a fetch, because notifications sent while it was away are gone. A connection
silent for ``ping_interval`` is pinged; one that does not answer within
``ping_timeout`` is treated as half-open and replaced.

After each LISTEN the worker sends a probe notification from another session.
A listener that does not hear it within ``PROBE_TIMEOUT`` sits behind
something that does not deliver notifications (typically PgBouncer in
transaction mode, where the LISTEN stays on a server connection that goes back
to the pool): that is logged once per connection, and polling carries on.

When ``holds_gate()`` says so, this connection holds the wake gate (the
worker's fetch connection cannot: worker/wake_hold.py) for as long as it
listens, and asks for a fetch whenever it gets a slot it lacked.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg import sql

from conveyor.db.wake_gate import WakeGate
from conveyor.worker.connection import RECOVERABLE_ERRORS, ManagedConnection, StopRequested
from conveyor.worker.deadline import with_deadline

log = logging.getLogger(__name__)

# Topics cannot contain "!" or spaces, so no event notification looks like this.
PROBE_PREFIX = "!probe "
PROBE_TIMEOUT = 5.0


class Listener:
    def __init__(self, conn: ManagedConnection, channel: str, *,
                 on_notify: Callable[[str], None], on_connected: Callable[[], None],
                 ping_interval: float, ping_timeout: float = 4.0,
                 send_probe: Callable[[str], Awaitable[None]] | None = None,
                 gate: WakeGate | None = None,
                 holds_gate: Callable[[], bool] = lambda: False) -> None:
        self._conn = conn
        self._channel = channel
        self._on_notify = on_notify
        self._on_connected = on_connected
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self._send_probe = send_probe
        self._probe: str | None = None          # payload awaited since the last LISTEN
        self._probe_due = float("inf")          # loop time by which it should have come
        self._probe_task: asyncio.Task[None] | None = None
        self.gate = gate
        self._holds_gate = holds_gate
        self.connected = asyncio.Event()
        self.notifications = 0
        # None until a probe was sent; then whether this connection heard it.
        self.hears: bool | None = None

    async def run(self, stopping: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not stopping.is_set():
                try:
                    conn = await self._conn.get()
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                    await self._hold_gate(conn)     # before the fetch on_connected asks for
                    self.connected.set()
                    self._start_probe()
                    self._on_connected()
                    # Pinged once ping_interval has passed since the last traffic,
                    # so a connection that goes half-open right after a
                    # notification is noticed within ping_interval + ping_timeout.
                    last_heard = loop.time()
                    while not stopping.is_set():
                        now = loop.time()
                        wait = max(0.05, min(last_heard + self._ping_interval,
                                             self._probe_due) - now)
                        if self.gate is not None and self._holds_gate():
                            wait = self.gate.retry_in(wait)
                        async for notify in conn.notifies(timeout=wait):
                            last_heard = loop.time()
                            payload = notify.payload
                            if payload.startswith(PROBE_PREFIX):
                                if payload == self._probe:
                                    self._probe, self._probe_due, self.hears = None, float("inf"), True
                                continue   # probes (ours or other workers') wake nobody
                            self.notifications += 1
                            self._on_notify(payload)
                            if stopping.is_set():
                                break
                        self._check_probe(loop.time())
                        if await self._hold_gate(conn):
                            self._on_connected()    # a producer that sent no wake-up has ended
                        if loop.time() - last_heard >= self._ping_interval \
                                and not stopping.is_set():
                            await with_deadline(conn, conn.execute("SELECT 1"), self._ping_timeout)
                            last_heard = loop.time()
                except StopRequested:
                    break
                except RECOVERABLE_ERRORS as exc:
                    self.connected.clear()
                    if stopping.is_set():
                        return
                    await self._conn.discard(exc)
        finally:
            self.connected.clear()
            if self._probe_task is not None:
                self._probe_task.cancel()

    async def _hold_gate(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Hold the wake gate here, or let it go, as ``holds_gate()`` says; whether a
        slot was newly held."""
        if self.gate is None:
            return False
        if self._holds_gate():
            return await with_deadline(conn, self.gate.hold(conn), self._ping_timeout)
        if self.gate.held:
            await with_deadline(conn, self.gate.release(conn), self._ping_timeout)
        return False

    def _start_probe(self) -> None:
        if self._send_probe is None:
            return
        payload = PROBE_PREFIX + uuid.uuid4().hex
        # Due from now, so the listener's first wait already ends at the verdict.
        self._probe = payload
        self._probe_due = asyncio.get_running_loop().time() + PROBE_TIMEOUT
        if self._probe_task is not None:
            self._probe_task.cancel()
        self._probe_task = asyncio.get_running_loop().create_task(self._probe_once(payload))

    async def _probe_once(self, payload: str) -> None:
        assert self._send_probe is not None
        try:
            await self._send_probe(payload)
        except Exception as exc:  # noqa: BLE001 - a probe that could not be sent proves nothing
            log.debug("listener probe not sent: %s", exc)
            if self._probe == payload:
                self._probe, self._probe_due = None, float("inf")
            return
        if self._probe == payload:   # not heard yet: a slow send gets the full timeout
            self._probe_due = max(self._probe_due,
                                  asyncio.get_running_loop().time() + PROBE_TIMEOUT)

    def _check_probe(self, now: float) -> None:
        if self._probe is None or now < self._probe_due:
            return
        self._probe, self._probe_due, self.hears = None, float("inf"), False
        log.warning(
            "the LISTEN connection does not receive notifications (is a transaction pooler such "
            "as PgBouncer between the worker and PostgreSQL?); new events are found by polling "
            "only; give the worker a direct connection for LISTEN (--listen-url) or run it with "
            "--transaction-pooler", extra={"action": "listen_deaf"})
