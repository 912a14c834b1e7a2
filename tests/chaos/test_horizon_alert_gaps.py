"""Two pins of the vacuum horizon the worker's alert (``Maintenance.check_horizon``) misses.

Found while running R13 (see ``docs/reliability.md``). ``horizon_oldest``
(``src/conveyor/db/queries/workers.sql``) lists sessions of the worker's own
database whose ``xact_start`` it can read:

* a transaction holding an xid in ANOTHER database of the same cluster pins
  this database too: every snapshot taken here counts that xid as running, so
  the xmin of each session here (the one pruning a page included) stays behind
  it; the query's ``datname = current_database()`` leaves it out;
* a worker role that is neither superuser nor a member of
  ``pg_read_all_stats`` reads ``xact_start`` as NULL for other roles' sessions
  (``backend_xid`` and ``backend_xmin`` stay visible), so ``xact_start IS NOT
  NULL`` drops every holder but its own.

The first test shows the cross-database pin is real; the others show the
alert names both holders (``horizon_holders`` looks at xid holders in every
database, and times a holder whose start it cannot read from when it first
saw it). A private embedded PostgreSQL keeps the roles and the pins off any
shared server.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from conveyor.config import WorkerConfig
from conveyor.db.named_queries import Queries
from conveyor.worker.connection import ManagedConnection
from conveyor.worker.maintenance import HorizonHolder, Maintenance
from conveyor.worker.running import RunningSet
from conveyor.worker.stats import WorkerStats
from server_support import private_postgres

THRESHOLD = 1.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with private_postgres("conveyor-horizon-") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(b"CREATE DATABASE queue_db")
            conn.execute(b"CREATE DATABASE other_db")
            conn.execute(b"CREATE ROLE app_role LOGIN")
            conn.execute(b"CREATE ROLE worker_role LOGIN")
        yield url


def _url(cluster: str, db: str, user: str | None = None) -> str:
    return make_conninfo(cluster, dbname=db, **({"user": user} if user else {}))


def _check(url: str) -> HorizonHolder | None:
    """What a worker connected with ``url`` reports after two checks THRESHOLD + 0.2 s apart.

    A worker checks periodically; a holder whose start time its role may not
    read is timed from the first check that saw it.
    """
    async def run() -> HorizonHolder | None:
        config = WorkerConfig(horizon_alert_after=THRESHOLD)
        unused = ManagedConnection(url, "maintenance", reconnect_min=0.1, reconnect_max=1.0,
                                   stopping=asyncio.Event())
        m = Maintenance(unused, Queries("conveyor"), config, str(uuid.uuid4()), "test", ["*"],
                        RunningSet(1), decided=set, stats=WorkerStats())
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await m.check_horizon(conn)
            await asyncio.sleep(THRESHOLD + 0.2)
            return await m.check_horizon(conn)
    return asyncio.run(run())


def _hold_xid(url: str) -> psycopg.Connection[Any]:
    holder = psycopg.connect(url, application_name="horizon-holder")
    holder.execute(b"SELECT txid_current()")
    time.sleep(THRESHOLD + 0.5)
    return holder


def _pages_after_updates(url: str, n: int = 5000) -> int:
    """Pages of a one-row table after ``n`` updates: 1 while pruning works."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(b"DROP TABLE IF EXISTS churn")
        conn.execute(b"CREATE TABLE churn (id int PRIMARY KEY, n int) "
                     b"WITH (autovacuum_enabled = off)")
        conn.execute(b"INSERT INTO churn VALUES (1, 0)")
        for _ in range(n):
            conn.execute(b"UPDATE churn SET n = n + 1 WHERE id = 1")
        row = conn.execute(b"SELECT pg_relation_size('churn') / 8192").fetchone()
        assert row is not None
        return int(row[0])


def test_an_xid_held_in_another_database_pins_this_one(cluster: str) -> None:
    queue = _url(cluster, "queue_db")
    assert _pages_after_updates(queue) <= 2
    holder = _hold_xid(_url(cluster, "other_db"))
    try:
        assert _pages_after_updates(queue) > 10      # nothing pruned: ~22 pages
    finally:
        holder.close()


def test_the_alert_names_an_xid_held_in_another_database(cluster: str) -> None:
    holder = _hold_xid(_url(cluster, "other_db"))
    try:
        found = _check(_url(cluster, "queue_db"))
    finally:
        holder.close()
    assert found is not None and "horizon-holder" in found.who


def test_the_alert_names_another_roles_holder_for_a_privileged_worker(cluster: str) -> None:
    holder = _hold_xid(_url(cluster, "queue_db", "app_role"))
    try:
        found = _check(_url(cluster, "queue_db"))           # superuser
    finally:
        holder.close()
    assert found is not None and "horizon-holder" in found.who


def test_the_alert_names_another_roles_holder_for_a_plain_worker_role(cluster: str) -> None:
    holder = _hold_xid(_url(cluster, "queue_db", "app_role"))
    try:
        with psycopg.connect(_url(cluster, "queue_db", "worker_role"), autocommit=True) as conn:
            row = conn.execute(b"SELECT backend_xid IS NOT NULL, xact_start IS NULL "
                               b"FROM pg_stat_activity WHERE application_name = 'horizon-holder'"
                               ).fetchone()
            assert row == (True, True)          # the xid is visible, its age in time is not
        found = _check(_url(cluster, "queue_db", "worker_role"))
    finally:
        holder.close()
    assert found is not None and "horizon-holder" in found.who
