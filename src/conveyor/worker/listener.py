"""The dedicated LISTEN connection: turns NOTIFY hints into wake-ups.

It never shares its connection: a pooled connection would silently drop the
LISTEN when it is handed to someone else. After every (re)connect it asks for
a fetch, because notifications sent while it was away are gone. A connection
silent for ``ping_interval`` is pinged; one that does not answer within
``ping_timeout`` is treated as half-open and replaced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from psycopg import sql

from conveyor.worker.connection import (
    RECOVERABLE_ERRORS,
    ManagedConnection,
    StopRequested,
    bounded,
)

log = logging.getLogger(__name__)


class Listener:
    def __init__(self, conn: ManagedConnection, channel: str, *,
                 on_notify: Callable[[str], None], on_connected: Callable[[], None],
                 ping_interval: float, ping_timeout: float = 4.0) -> None:
        self._conn = conn
        self._channel = channel
        self._on_notify = on_notify
        self._on_connected = on_connected
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self.connected = asyncio.Event()
        self.notifications = 0

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                conn = await self._conn.get()
                await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                self.connected.set()
                self._on_connected()
                while not stopping.is_set():
                    heard = False
                    async for notify in conn.notifies(timeout=self._ping_interval):
                        heard = True
                        self.notifications += 1
                        self._on_notify(notify.payload)
                        if stopping.is_set():
                            break
                    if not heard and not stopping.is_set():
                        await bounded(conn, conn.execute("SELECT 1"), self._ping_timeout)
            except StopRequested:
                break
            except RECOVERABLE_ERRORS as exc:
                self.connected.clear()
                if stopping.is_set():
                    return
                await self._conn.discard(exc)
        self.connected.clear()
