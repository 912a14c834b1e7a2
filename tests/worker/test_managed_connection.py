"""A managed connection opens one connection however many callers ask for it at once."""

from __future__ import annotations

import asyncio

import psycopg

from conveyor.worker.connection import ManagedConnection
from worker_support import WORKER_BACKENDS


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
