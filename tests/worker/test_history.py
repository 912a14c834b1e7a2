"""Finished events in the history's day partitions (0025, docs/history-partitions.md).

A worker makes today's and tomorrow's partitions as it starts; its
acknowledgements move succeeded and cancelled events there, except those an
idempotency key keeps live and the failed ones, which wait for a person; an
operator's retry moves an event back; retention drops whole days.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from conveyor import Admin, AsyncAdmin, Cancel, Event, InvalidStateError, Producer, Worker
from conveyor.db.named_queries import queries_for
from conveyor.worker.pruner import Pruner
from worker_support import enqueue, fast_config, query, router_for, running, wait_all_in


def _today() -> str:
    return datetime.now(UTC).strftime("%Y%m%d")


async def _partition_of(db: str) -> dict[int, str]:
    rows = await query(db, "SELECT id, tableoid::regclass::text AS part FROM conveyor.events")
    return {r["id"]: r["part"] for r in rows}


async def test_a_worker_moves_finished_events_into_todays_partition(db: str) -> None:
    async def handle(event: Event) -> Any:
        if event.payload.get("fail"):
            raise RuntimeError("boom")
        if event.payload.get("cancel"):
            raise Cancel("not wanted")
        return None

    worker = Worker(db, router_for("hist.*", handle), fast_config())
    async with running(worker):
        plain = await enqueue(db, "hist.a", {})
        keyed = await enqueue(db, "hist.a", {}, idempotency_key="hist-k")
        failed = await enqueue(db, "hist.a", {"fail": True}, max_attempts=1)
        cancelled = await enqueue(db, "hist.a", {"cancel": True})
        await wait_all_in(db, {"succeeded", "failed", "cancelled"}, timeout=20)
    days = {r["relname"] for r in await query(
        db, "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = 'conveyor.events_done'::regclass")}
    tomorrow = (datetime.now(UTC) + timedelta(days=1)).strftime("%Y%m%d")
    assert {f"events_done_{_today()}", f"events_done_{tomorrow}"} <= days
    where = await _partition_of(db)
    assert where[plain] == where[cancelled] == f"conveyor.events_done_{_today()}"
    assert where[keyed] == where[failed] == "conveyor.events_live"
    # The key still deduplicates against its finished event.
    with psycopg.connect(db, autocommit=True) as conn:
        assert Producer().enqueue(conn, "hist.a", {}, idempotency_key="hist-k") == keyed
        # An operator's retry brings an event back from the history, pending.
        Admin().retry(conn, cancelled)
    assert (await _partition_of(db))[cancelled] == "conveyor.events_live"
    row = (await query(db, "SELECT state, done FROM conveyor.events WHERE id = %s",
                       (cancelled,)))[0]
    assert (row["state"], row["done"]) == ("pending", None)


async def test_retention_drops_whole_days_and_deletes_no_row_of_them(db: str) -> None:
    q = queries_for("conveyor")
    old_day = (datetime.now(UTC) - timedelta(days=3)).date()
    name = f"events_done_{old_day:%Y%m%d}"
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE conveyor.{name} PARTITION OF conveyor.events_done"
                     " FOR VALUES FROM (%s) TO (%s)".replace("%s", "'{}'").format(
                         f"{old_day} 00:00+00", f"{old_day + timedelta(days=1)} 00:00+00"))
        conn.execute("INSERT INTO conveyor.events (topic, payload, state, attempts,"
                      " finished_at, done) SELECT 'hist.old', '{}', 'succeeded', 1,"
                      " %s::timestamptz + interval '1 hour', true FROM generate_series(1, 50)",
                      (f"{old_day} 00:00+00",))
        # A row finished in the live partition as long ago goes row by row.
        conn.execute("INSERT INTO conveyor.events (topic, payload, state, attempts,"
                      " finished_at) VALUES ('hist.live', '{}', 'succeeded', 1,"
                      " now() - interval '3 days')")
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        # Two days of retention: the day that ended two days ago and more goes.
        deleted = await Pruner(q, fast_config(retention=2 * 86_400.0)).prune(conn)
    assert deleted == 1     # the live row; the old day was dropped, not deleted
    gone = await query(db, "SELECT to_regclass(%s) IS NULL AS gone", (f"conveyor.{name}",))
    assert gone == [{"gone": True}]
    left = await query(db, "SELECT count(*) AS n FROM conveyor.events"
                           " WHERE topic IN ('hist.old', 'hist.live')")
    assert left == [{"n": 0}]
    # Today's day stays, and the next: made by the same pass.
    kept = await query(db, "SELECT to_regclass(%s) IS NOT NULL AS kept",
                       (f"conveyor.events_done_{_today()}",))
    assert kept == [{"kept": True}]



async def test_partitions_of_ten_minutes_are_made_24_ahead_and_a_turn_knows_when_to_renew(
        db: str) -> None:
    # 0026: a span shorter than a day makes at most 24 partitions ahead of
    # now, however far the pruner asks; its history_due is halfway to their
    # end, when a multi-tenant worker's next turn makes more.
    q = queries_for("conveyor")
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        # Not after the days an earlier test of this database made.
        await conn.execute("SELECT conveyor.history_drop(interval '-100 days')")
        assert (await AsyncAdmin().set_history_span(conn, 600)).span == 600
        pruner = Pruner(q, fast_config(retention=600.0))
        before = datetime.now(UTC)
        try:
            await pruner.keep_history(conn)
            parts = await (await conn.execute(q["history_list"])).fetchall()
        finally:    # the module's other tests expect days
            await conn.execute("SELECT conveyor.history_drop(interval '-100 days')")
            await AsyncAdmin().set_history_span(conn, 86_400)
    assert len(parts) == 25
    assert all(p[2] - p[1] == timedelta(minutes=10) for p in parts)
    assert parts[0][1] <= before < parts[0][2]
    assert pruner.history_due is not None
    halfway = before + (parts[-1][2] - before) / 2
    assert abs((pruner.history_due - halfway).total_seconds()) < 30


async def test_a_role_that_may_not_make_the_days_keeps_finished_events_live(
        db: str, caplog: pytest.LogCaptureFixture) -> None:
    role = f"conveyor_dml_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("SELECT conveyor.history_drop_days(-10 * 86400)")   # no day left
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA conveyor TO {role}")
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA conveyor"
                     f" TO {role}")
        conn.execute(f"GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA conveyor TO {role}")
    url = make_conninfo(db, user=role)
    try:
        caplog.set_level(logging.WARNING, logger="conveyor.worker.pruner")
        worker = Worker(url, router_for("dml.*", lambda event: None), fast_config())
        async with running(worker):
            event = await enqueue(url, "dml.a", {})
            await wait_all_in(db, {"succeeded"}, timeout=20)
        refused = [r for r in caplog.records if getattr(r, "action", "") == "history_refused"]
        assert len(refused) == 1 and "history_make('1 day')" in refused[0].getMessage()
        assert (await _partition_of(db))[event] == "conveyor.events_live"
    finally:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def test_an_operators_cancel_that_waited_for_a_moving_success_finds_it_succeeded(
        db: str) -> None:
    # The acknowledgement moves the row into the history while the cancel waits
    # for its lock: PostgreSQL fails the waiter (40001), which runs again.
    q = queries_for("conveyor")
    owner = str(uuid.uuid4())
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(q["history_make_days"], {"ahead": 0})
        row = conn.execute(
            "INSERT INTO conveyor.events (topic, payload, state, attempts, lease_owner,"
            " lease_expires_at) VALUES ('hist.cancel', '{}', 'running', 1, %s,"
            " now() + interval '1 minute') RETURNING id", (owner,)).fetchone()
        assert row is not None
        event = row[0]
    outcome: list[BaseException | None] = []
    with psycopg.connect(db) as acker, psycopg.connect(db) as operator:
        acker.execute(q["event_succeed_many"], {"ids": [event], "attempts": [1], "owner": owner})

        def cancel() -> None:
            try:
                Admin().cancel(operator, event)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                outcome.append(exc)
            operator.rollback()
        waiter = threading.Thread(target=cancel)
        waiter.start()
        deadline = time.monotonic() + 10
        with psycopg.connect(db, autocommit=True) as watcher:
            while not watcher.execute(
                    "SELECT count(*) > 0 FROM pg_stat_activity WHERE pid = %s"
                    " AND wait_event_type = 'Lock'", (operator.info.backend_pid,)).fetchone()[0]:
                assert time.monotonic() < deadline, "the cancel never waited for the row"
                time.sleep(0.01)
        acker.commit()
        waiter.join(timeout=10)
    assert len(outcome) == 1 and isinstance(outcome[0], InvalidStateError), outcome
    assert "succeeded" in str(outcome[0])
