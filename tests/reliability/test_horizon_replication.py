"""The vacuum-horizon alert's replication branches, on a private primary with real standbys.

``horizon_holders`` (``src/conveyor/db/queries/workers.sql``) also looks at
two holders no single server shows: a replication slot holding an ``xmin``
(``pg_replication_slots``), and a hot standby's ``hot_standby_feedback``,
which arrives as its walsender's ``backend_xmin``. Neither has a start time,
so ``Maintenance.check_horizon`` times them from when it first saw that xmin:
a slot or a standby whose xmin keeps moving is never reported, one whose xmin
stands still for ``horizon_alert_after`` is.

Each test runs a real worker against a primary of its own (``wal_level =
logical``, see ``replication.py``) while a producer keeps enqueueing, and
first shows the alert is NOT raised before the holder exists. What PostgreSQL
itself does, checked here rather than assumed: a physical slot keeps the
``xmin`` its standby last reported after the standby is gone, and it pins
user tables; a logical slot sets only ``catalog_xmin``, which holds back the
system catalogs but not the events table, so it is no holder of this alert.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest

from conveyor import AsyncCommittingProducer, Event, Worker
from conveyor.schema.migrator import Migrator
from schema_reset import reset_database
from waiting import wait_until
from worker_support import router_for

from .helpers import fast_config, query, running
from .replication import Cluster, PrivateServer, cluster

# light: a private primary and standbys, started and stopped; the horizon it
# watches is that primary's, which no other test touches.
pytestmark = [pytest.mark.slow, pytest.mark.light]

THRESHOLD = 2.0            # horizon_alert_after; checked every quarter of it
# A standby reports its xmin every wal_receiver_status_interval (1 s at least):
# its walsender's xmin then stands still that long even when nothing is held,
# so the standby test leaves a wider margin.
STANDBY_THRESHOLD = 3.0
QUIET = 2 * THRESHOLD + 1  # how long "no alert" is watched: several checks past the threshold
ALERT_WITHIN = 15.0
FEEDBACK = {"hot_standby_feedback": "on", "wal_receiver_status_interval": "1"}
MAINTENANCE_LOGGER = "conveyor.worker.horizon"


@pytest.fixture(scope="module")
def primary() -> Iterator[Cluster]:
    """A private primary with a migrated ``queue`` database; stopped and removed afterwards."""
    with cluster() as made:
        with psycopg.connect(made.primary.url(), autocommit=True) as conn:
            conn.execute(b"CREATE DATABASE queue")
        with psycopg.connect(made.primary.url("queue"), autocommit=True) as conn:
            Migrator("conveyor").apply(conn)
        yield made


@pytest.fixture
def queue_db(primary: Cluster) -> Iterator[str]:
    """The primary's queue database, emptied; every slot dropped after the test."""
    url = primary.primary.url("queue")
    reset_database(url)
    yield url
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(b"SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                     b"WHERE active_pid IS NOT NULL")
        conn.execute(b"SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                     b"WHERE NOT active")


@pytest.fixture
def standbys(primary: Cluster) -> Iterator[list[PrivateServer]]:
    """Standbys the test makes (append them); stopped after the test even if it fails.

    The cluster removes their files with the module.
    """
    made: list[PrivateServer] = []
    yield made
    for standby in made:
        standby.stop()


def _alerts(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == MAINTENANCE_LOGGER and getattr(r, "action", None) == action]


def _worker(url: str, threshold: float, handled: list[int]) -> Worker:
    async def handle(event: Event) -> None:
        handled.append(event.id)
    return Worker(url, router_for("job.*", handle), fast_config(horizon_alert_after=threshold))


@contextlib.asynccontextmanager
async def _producing(url: str, every: float = 0.05) -> AsyncIterator[list[int]]:
    """Enqueue an event every ``every`` s until the block ends; yields the ids so far.

    Each one consumes transaction ids, so a standby's xmin moves on as long as
    nothing holds it back.
    """
    ids: list[int] = []

    async def produce() -> None:
        async with AsyncCommittingProducer(url) as producer:
            while True:
                ids.append(await producer.enqueue("job.tick", {"n": len(ids)}))
                await asyncio.sleep(every)

    task = asyncio.create_task(produce())
    try:
        yield ids
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _quiet_for(worker: Worker, caplog: pytest.LogCaptureFixture, seconds: float) -> None:
    """Watch ``seconds`` of checks and fail on any alert."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert worker.maintenance.horizon is None, worker.maintenance.horizon
        await asyncio.sleep(0.05)
    assert _alerts(caplog, "horizon_pinned") == []


async def _all_handled(url: str, ids: list[int], handled: list[int]) -> None:
    """Every event enqueued so far succeeds: the queue kept working under the pin."""
    wanted = list(ids)

    async def done() -> bool:
        rows = await query(url, "SELECT count(*) AS n FROM conveyor.events "
                                "WHERE id = ANY(%s) AND state = 'succeeded'", (wanted,))
        return bool(rows[0]["n"] == len(wanted))
    await wait_until(done, timeout=15, what=f"{len(wanted)} events succeeded")
    assert set(wanted) <= set(handled)


async def _dead_rows_left_by_vacuum(url: str) -> int:
    """Dead rows of the events table a VACUUM run now must leave (still visible to someone)."""
    await query(url, "VACUUM conveyor.events")
    rows = await query(url, "SELECT n_dead_tup AS n FROM pg_stat_user_tables "
                            "WHERE relid = 'conveyor.events_live'::regclass")
    return int(rows[0]["n"])


async def _until_alert(worker: Worker, *, raised: bool) -> None:
    async def reached() -> bool:
        return (worker.maintenance.horizon is not None) == raised
    await wait_until(reached, timeout=ALERT_WITHIN,
                     what="the horizon alert" if raised else "the alert to clear")


async def _slot(url: str, name: str) -> dict[str, Any]:
    rows = await query(url, "SELECT slot_type, xmin::text AS xmin, "
                            "catalog_xmin::text AS catalog_xmin, active "
                            "FROM pg_replication_slots WHERE slot_name = %s", (name,))
    assert rows, f"no slot {name}"
    return rows[0]


async def test_a_physical_slot_left_by_its_standby_raises_the_alert_naming_it_until_dropped(
        queue_db: str, primary: Cluster, standbys: list[PrivateServer],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=MAINTENANCE_LOGGER)
    await query(queue_db, "SELECT pg_create_physical_replication_slot('horizon_slot', true)")
    assert (await _slot(queue_db, "horizon_slot"))["xmin"] is None   # WAL kept, no xmin yet
    handled: list[int] = []
    worker = _worker(queue_db, THRESHOLD, handled)
    async with running(worker), _producing(queue_db) as ids:
        # A slot without an xmin holds back no vacuum: no alert, and no other holder.
        await _quiet_for(worker, caplog, QUIET)

        # A standby streams through the slot with hot_standby_feedback, which sets
        # the slot's xmin; then it goes away and nobody consumes the slot again.
        standby = primary.standby("slot_standby", application_name="slot-standby",
                                  slot="horizon_slot", settings=FEEDBACK)
        standbys.append(standby)
        await asyncio.to_thread(standby.start)

        async def slot_has_xmin() -> bool:
            return (await _slot(queue_db, "horizon_slot"))["xmin"] is not None
        await wait_until(slot_has_xmin, timeout=30, what="the standby's feedback in the slot")
        await asyncio.to_thread(standby.stop)
        left = await _slot(queue_db, "horizon_slot")
        assert left["active"] is False and left["xmin"] is not None
        left_at = time.monotonic()

        await _until_alert(worker, raised=True)
        holder = worker.maintenance.horizon
        assert holder is not None
        assert holder.kind == "replication slot"
        assert holder.who == "horizon_slot (physical)"
        assert holder.seconds >= THRESHOLD
        # Named within the threshold plus a few checks of the standby's going.
        assert time.monotonic() - left_at < THRESHOLD + 5
        records = _alerts(caplog, "horizon_pinned")
        assert records and all(getattr(r, "holder", None) == "horizon_slot (physical)" for r in records)
        assert "replication slot horizon_slot (physical)" in records[-1].getMessage()
        # The pin is real: the events table keeps dead rows VACUUM may not remove.
        assert (await _slot(queue_db, "horizon_slot"))["xmin"] == left["xmin"]
        assert await _dead_rows_left_by_vacuum(queue_db) > 0
        await _all_handled(queue_db, ids, handled)

        released_before = len(_alerts(caplog, "horizon_released"))
        await query(queue_db, "SELECT pg_drop_replication_slot('horizon_slot')")

        await _until_alert(worker, raised=False)
        cleared = _alerts(caplog, "horizon_released")[released_before:]
        assert len(cleared) == 1 and "horizon_slot (physical)" in cleared[0].getMessage()
    assert len(ids) > 50 and len(handled) >= len(ids) - 5


async def test_an_unconsumed_logical_slot_pins_only_the_catalogs_and_raises_no_alert(
        queue_db: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=MAINTENANCE_LOGGER)
    await query(queue_db, "SELECT pg_create_logical_replication_slot('horizon_logical', "
                          "'test_decoding')")
    slot = await _slot(queue_db, "horizon_logical")
    # Decoding needs old catalog rows, not old table rows: only catalog_xmin is set.
    assert slot["slot_type"] == "logical" and slot["active"] is False
    assert slot["xmin"] is None and slot["catalog_xmin"] is not None
    handled: list[int] = []
    worker = _worker(queue_db, THRESHOLD, handled)
    async with running(worker), _producing(queue_db) as ids:
        await _quiet_for(worker, caplog, QUIET)
        await _all_handled(queue_db, ids, handled)
        # Unconsumed all along, and still no pin on the events table: VACUUM
        # removes the dead rows of the events the worker has finished.
        assert (await _slot(queue_db, "horizon_logical"))["catalog_xmin"] == slot["catalog_xmin"]
        await _quiet_for(worker, caplog, 0.5)
    assert await _dead_rows_left_by_vacuum(queue_db) == 0
    # ... while the catalogs do keep theirs: the slot holds back what it should.
    for _ in range(10):
        await query(queue_db, "CREATE TABLE churn_catalog (id int); DROP TABLE churn_catalog")
    await query(queue_db, "VACUUM pg_class")
    rows = await query(queue_db, "SELECT n_dead_tup AS n FROM pg_stat_sys_tables "
                                 "WHERE relid = 'pg_class'::regclass")
    assert rows[0]["n"] >= 10
    assert len(ids) > 50


async def test_a_hot_standby_feedback_pin_raises_the_alert_naming_the_standby_until_it_ends(
        queue_db: str, primary: Cluster, standbys: list[PrivateServer],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=MAINTENANCE_LOGGER)
    standby = primary.standby("feedback_standby", application_name="horizon-standby",
                              settings=FEEDBACK)
    standbys.append(standby)
    await asyncio.to_thread(standby.start)

    async def walsender_xmin() -> bool:
        rows = await query(queue_db, "SELECT backend_xmin FROM pg_stat_activity "
                                     "WHERE backend_type = 'walsender' "
                                     "AND application_name = 'horizon-standby'")
        return bool(rows) and rows[0]["backend_xmin"] is not None
    await wait_until(walsender_xmin, timeout=30, what="the standby's feedback")
    handled: list[int] = []
    worker = _worker(queue_db, STANDBY_THRESHOLD, handled)
    async with running(worker), _producing(queue_db) as ids:
        # Streaming, its xmin moving on with every report: no alert.
        await _quiet_for(worker, caplog, 2 * STANDBY_THRESHOLD + 1)

        # A long report on the standby: its snapshot stays, and so does the xmin
        # the standby reports for it.
        reader = await psycopg.AsyncConnection.connect(standby.url("queue"),
                                                       application_name="standby-report")
        try:
            await reader.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
            await reader.execute("SELECT count(*) FROM conveyor.events")
            opened = time.monotonic()

            await _until_alert(worker, raised=True)
            holder = worker.maintenance.horizon
            assert holder is not None
            # Named as the standby: its application_name and its address.
            assert holder.kind == "standby", holder
            assert re.fullmatch(r"horizon-standby at (local socket|[0-9a-f.:]+) "
                                r"\(walsender pid \d+\)", holder.who), holder.who
            assert holder.seconds >= STANDBY_THRESHOLD
            assert time.monotonic() - opened < STANDBY_THRESHOLD + 5
            records = _alerts(caplog, "horizon_pinned")
            assert records and all("horizon-standby" in getattr(r, "holder", "") for r in records)
            assert await _dead_rows_left_by_vacuum(queue_db) > 0
            await _all_handled(queue_db, ids, handled)
        finally:
            await reader.close()          # the report ends

        await _until_alert(worker, raised=False)
        cleared = _alerts(caplog, "horizon_released")
        assert len(cleared) == 1 and "horizon-standby" in cleared[0].getMessage()
    assert len(ids) > 50
