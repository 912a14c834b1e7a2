"""Poll-only and transaction-pooler modes, the LISTEN probe, and the vacuum-horizon alert.

All against a real PostgreSQL: the "deaf" listener is a LISTEN on another
database (notifications never cross databases, as they never reach a LISTEN
parked on a pooled server connection), and the pinned horizon is a real
transaction holding a transaction id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from conveyor import ConfigError, Event, Worker
from conveyor.worker.listener import PROBE_TIMEOUT
from server_support import own_server
from worker_support import enqueue, fast_config, query, router_for, running, wait_all_in

# A server of its own: the vacuum horizon is the whole cluster's; another test's
# open transaction (the parallel tier's other processes) would be named first and
# hold it after this one's release, so the alert checked here would be theirs.
# (Until 2026-12-03 the horizon tests ran alone in the serial tier.)
server_url, make_db, template_db, shared_db_url = own_server("conveyor-horizon-")


def _noop_router() -> Any:
    async def handle(event: Event) -> None:
        return None
    return router_for("job.*", handle)


async def _backends(url: str) -> list[str]:
    rows = await query(url, "SELECT application_name FROM pg_stat_activity "
                            "WHERE datname = current_database() "
                            "AND application_name LIKE 'conveyor-%' ORDER BY 1")
    return [r["application_name"] for r in rows]


async def test_poll_only_worker_opens_no_listen_connection_and_still_finds_events(db: str) -> None:
    worker = Worker(db, _noop_router(), fast_config(listen=False, poll_interval=0.3))
    async with running(worker):
        await asyncio.wait_for(worker.started.wait(), 10)
        started = time.monotonic()
        event_id = await enqueue(db, "job.a")
        done = await wait_all_in(db, {"succeeded"}, timeout=30)
        assert done == {event_id: "succeeded"}
        # Found by the 0.3 s poll (no NOTIFY reaches it); a loaded machine may take a while.
        assert time.monotonic() - started < 10.0
        assert "conveyor-listen" not in await _backends(db)
        assert worker.listener.notifications == 0


async def test_listener_probe_confirms_a_working_listen(db: str) -> None:
    worker = Worker(db, _noop_router(), fast_config())
    async with running(worker):
        deadline = time.monotonic() + 30
        while worker.listener.hears is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert worker.listener.hears is True
        # The probe woke nobody: it is not counted as an event notification.
        assert worker.listener.notifications == 0


async def test_a_listen_that_hears_nothing_is_reported_and_polling_carries_on(
        db: str, server_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # A LISTEN in another database hears none of this database's NOTIFYs: the
    # same situation as a LISTEN parked on a pooled server connection.
    elsewhere = make_conninfo(server_url, dbname=conninfo_to_dict(server_url).get("dbname")
                              or "postgres")
    assert conninfo_to_dict(elsewhere)["dbname"] != conninfo_to_dict(db)["dbname"]
    caplog.set_level(logging.WARNING, logger="conveyor.worker.listener")
    # A 30 s ping: the verdict must come from the probe's own 5 s timeout.
    worker = Worker(db, _noop_router(), fast_config(poll_interval=0.3,
                                                    listener_ping_interval=30.0),
                    listen_conninfo=elsewhere)
    async with running(worker):
        listening = time.monotonic()
        deadline = listening + 25
        while worker.listener.hears is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert worker.listener.hears is False
        # Under the 30 s ping even on a loaded machine: the probe's timeout gave the verdict.
        assert time.monotonic() - listening < PROBE_TIMEOUT + 15
        event_id = await enqueue(db, "job.b")
        assert await wait_all_in(db, {"succeeded"}, timeout=30) == {event_id: "succeeded"}
    deaf = [r for r in caplog.records if getattr(r, "action", None) == "listen_deaf"]
    assert len(deaf) == 1
    assert "PgBouncer" in deaf[0].getMessage() and "--listen-url" in deaf[0].getMessage()


async def test_transaction_pooler_mode_keeps_no_session_state_and_does_not_listen(db: str) -> None:
    worker = Worker(db, _noop_router(), fast_config(transaction_pooler=True, poll_interval=0.3))
    assert worker.listens is False
    async with running(worker):
        event_ids = {await enqueue(db, "job.c") for _ in range(30)}
        done = await wait_all_in(db, {"succeeded"}, timeout=30)
        assert set(done) == event_ids
        assert "conveyor-listen" not in await _backends(db)
        for managed in (worker.connections.fetch, worker.connections.ack):
            conn = await managed.get()
            cur = await conn.execute("SELECT current_setting('synchronous_commit'), "
                                     "current_setting('statement_timeout'), "
                                     "(SELECT count(*) FROM pg_prepared_statements)")
            assert await cur.fetchone() == ("on", "0", 0)


async def test_direct_mode_sets_its_session_guards(db: str) -> None:
    worker = Worker(db, _noop_router(), fast_config(query_timeout=7.0))
    async with running(worker):
        await asyncio.wait_for(worker.started.wait(), 10)
        conn = await worker.connections.fetch.get()
        cur = await conn.execute("SELECT current_setting('synchronous_commit'), "
                                 "current_setting('statement_timeout'), "
                                 "current_setting('idle_in_transaction_session_timeout')")
        assert await cur.fetchone() == ("off", "7s", "1min")


async def test_transaction_pooler_with_a_direct_listen_url_still_listens(db: str) -> None:
    worker = Worker(db, _noop_router(), fast_config(transaction_pooler=True),
                    listen_conninfo=db + " ")   # a distinct string for the same server
    assert worker.listens is True
    async with running(worker):
        deadline = time.monotonic() + 30
        while worker.listener.hears is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert worker.listener.hears is True
        conn = await worker.connections.listen.get()
        cur = await conn.execute("SELECT current_setting('statement_timeout')")
        assert (await cur.fetchone())[0] != "0"   # the direct connection gets its guards


async def test_pinned_vacuum_horizon_raises_an_alert_and_its_release_clears_it(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.worker.horizon")
    worker = Worker(db, _noop_router(), fast_config(horizon_alert_after=1.0))
    holder = await psycopg.AsyncConnection.connect(db, application_name="horizon-holder")
    try:
        await holder.execute("SELECT txid_current()")   # holds an xid, idle in transaction
        async with running(worker):
            deadline = time.monotonic() + 30
            while worker.maintenance.horizon is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            pinned = worker.maintenance.horizon
            assert pinned is not None
            assert "horizon-holder" in pinned.who and pinned.kind == "session"
            assert pinned.seconds >= 1.0
            await holder.rollback()
            deadline = time.monotonic() + 30
            while worker.maintenance.horizon is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert worker.maintenance.horizon is None
    finally:
        await holder.close()
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert actions.count("horizon_pinned") == 1          # reported once, not every check
    assert actions.index("horizon_pinned") < actions.index("horizon_released")


async def test_a_short_transaction_raises_no_alert(db: str) -> None:
    worker = Worker(db, _noop_router(), fast_config(horizon_alert_after=3.0))
    holder = await psycopg.AsyncConnection.connect(db)
    try:
        async with running(worker):
            await asyncio.wait_for(worker.started.wait(), 10)
            began = time.monotonic()       # the transaction starts after this
            await holder.execute("SELECT txid_current()")
            # About two checks (every 0.75 s) during a 1.5 s hold, all under the 3 s
            # threshold. Looked at only while the hold is under 1.5 s: a loaded machine
            # may stretch a fixed sleep past the threshold, where an alert is due.
            while (held := time.monotonic() - began) < 1.5:
                assert worker.maintenance.horizon is None, \
                    f"alert after {held:.2f}s: {worker.maintenance.horizon}"
                await asyncio.sleep(0.05)
            await holder.rollback()
    finally:
        await holder.close()


@pytest.mark.parametrize("options, message", [
    ({"listen": "yes"}, "expected listen to be True or False, got 'yes'"),
    ({"transaction_pooler": 1}, "expected transaction_pooler to be True, False or None, got 1"),
    ({"horizon_alert_after": 0}, "expected horizon_alert_after to be between 0.1s and 7d, got 0"),
])
def test_bad_settings_are_refused_by_name(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        fast_config(**options)
    assert str(caught.value) == message
