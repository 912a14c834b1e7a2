"""Fixtures of the reliability suite: a real PostgreSQL, a fault-injecting TCP proxy.

Their helpers are in ``helpers.py`` beside this file.

Every wait is bounded and every server started here is stopped in teardown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import psycopg
import pytest

from .helpers import BlackHoleProxy, socket_path


@pytest.fixture
async def proxy(fresh_db: str) -> AsyncIterator[BlackHoleProxy]:
    # Ask libpq where the server is rather than parse the URL: it resolves the
    # defaults (PGHOST, PGPORT, the compiled-in port a socket-only URL relies on).
    async with await psycopg.AsyncConnection.connect(fresh_db, connect_timeout=10) as conn:
        info = conn.info
        host = info.host if socket_path(info.host, info.port) else (info.hostaddr or info.host)
        port = info.port
    p = BlackHoleProxy(host, port)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()
