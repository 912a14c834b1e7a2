"""Fixtures of the reliability suite: a real PostgreSQL, a fault-injecting TCP proxy.

Their helpers are in ``helpers.py`` beside this file.

Every wait is bounded and every server started here is stopped in teardown.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

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


@pytest.fixture
def scratch_db(server_url: str, template_db: str) -> Iterator[str]:
    """Like fresh_db, for tests that need a second database."""
    name = f"conveyor_r_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"'.encode())
    yield make_conninfo(server_url, dbname=name)
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
