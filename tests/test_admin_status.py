"""Admin.status / AsyncAdmin.status on a big table: exact where it matters, bounded always.

R14 ("admin counts must not count(*) the whole table"): pending, running and
failed are counted exactly through their partial indexes; succeeded and
cancelled are exact up to ``EXACT_FINISHED_LIMIT`` finished rows and estimated
beyond, flagged in ``QueueStatus.estimated_states``. The module database holds
200,000 succeeded rows, so a status call that read them would show up in the
plans and in the per-transaction table statistics checked below.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from conveyor import Admin, AsyncAdmin, EventState, Producer, QueueStatus
from conveyor import admin as admin_module
from conveyor.admin import EXACT_FINISHED_LIMIT
from conveyor.admin_status import (
    FAILED_EXACT_LIMIT,
    FAILED_TOPIC_EXACT_LIMIT,
    estimate_finished,
    estimate_params,
    failed_cap,
)
from conveyor.cli.commands import format_schedules, format_status
from conveyor.cron import Schedule
from conveyor.db.named_queries import queries_for
from conveyor.types import ScheduleInfo, TopicCount
from query_plans import plan_session, scans
from server_support import own_server

Q = queries_for("conveyor")

# A server of its own: the index-only reads counted here need VACUUM to have
# marked the filled table's pages all-visible. In the first parallel run (-n 2,
# 2026-12-03) three tests found every open row's page unmarked (140 heap fetches
# of 140) while another worker ran its tests on the same server: a VACUUM marks
# no page all-visible while a transaction anywhere on the server is older than
# its rows, and skips the index pass, leaving a page with dead line pointers
# unmarked (hence INDEX_CLEANUP ON in _vacuumed). Until 2026-12-03 the module
# ran alone in the serial tier for it.
server_url, make_db, template_db, shared_db_url = own_server("conveyor-status-")
Conn = psycopg.Connection[Any]

SUCCEEDED = 200_000
CANCELLED = 4_000
FAILED = {"big.a": 30, "big.b": 12}
PENDING = {("big.a", "t1"): 50, ("big.a", None): 20, ("big.c", "t2"): 30}
FUTURE = 40                  # pending on big.b, due tomorrow
RUNNING = 7                  # on big.c
OPEN_ROWS = sum(FAILED.values()) + sum(PENDING.values()) + FUTURE + RUNNING


def _fill(conn: Conn) -> None:
    conn.execute("SET conveyor.notify = 'off'")  # no NOTIFY for the bulk rows
    # Half the succeeded rows in the history (0025), the rest and the
    # cancelled ones live (as a key, or a worker that may not make the
    # history's days, leaves them): a status reads both, boundedly.
    conn.execute("CREATE TABLE conveyor.events_done_old PARTITION OF conveyor.events_done"
                 " FOR VALUES FROM (now() - interval '4 days') TO (now() - interval '1 day')")
    conn.execute("""
        INSERT INTO conveyor.events (topic, payload, state, attempts, run_at, finished_at, done)
        SELECT 'big.' || (ARRAY['a', 'b', 'c', 'd'])[1 + g %% 4], '{}',
               CASE WHEN g <= %(cancelled)s THEN 'cancelled' ELSE 'succeeded' END, 1,
               now() - interval '3 days', now() - interval '2 days' + g * interval '1 ms',
               CASE WHEN g > %(cancelled)s AND g %% 2 = 0 THEN true END
        FROM generate_series(1, %(finished)s) AS g""",
                 {"cancelled": CANCELLED, "finished": SUCCEEDED + CANCELLED})
    for topic, n in FAILED.items():
        conn.execute("""
            INSERT INTO conveyor.events (topic, payload, state, attempts, max_attempts,
                                         finished_at, last_error)
            SELECT %s, '{}', 'failed', 1, 1, now(), 'boom' FROM generate_series(1, %s)""",
                     (topic, n))
    for (topic, tenant), n in PENDING.items():
        conn.execute("""
            INSERT INTO conveyor.events (topic, tenant, payload, run_at)
            SELECT %s, %s, '{}', now() - interval '1 minute' FROM generate_series(1, %s)""",
                     (topic, tenant, n))
    conn.execute("""
        INSERT INTO conveyor.events (topic, payload, run_at)
        SELECT 'big.b', '{}', now() + interval '1 day' FROM generate_series(1, %s)""", (FUTURE,))
    conn.execute("""
        INSERT INTO conveyor.events (topic, payload, state, attempts, lease_owner,
                                     lease_expires_at)
        SELECT 'big.c', '{}', 'running', 1, gen_random_uuid(), now() + interval '1 hour'
        FROM generate_series(1, %s)""", (RUNNING,))


@pytest.fixture(scope="module")
def big_db(make_db: Callable[..., AbstractContextManager[str]], template_db: str) -> Iterator[str]:
    """A migrated database: 200 k succeeded, 4 k cancelled, a few open and failed rows."""
    with make_db(prefix="conveyor_status_", template=template_db) as url:
        with psycopg.connect(url, autocommit=True) as conn:
            _fill(conn)
            _vacuumed(conn)
        yield url


def _vacuumed(conn: Conn) -> None:
    """VACUUM until the table's pages are all-visible (the index-only scans' premise).

    A VACUUM marks no page all-visible while any transaction of the server older
    than the rows still runs (another test's, on a shared server): it waits for it,
    bounded, instead of measuring heap fetches that only that transaction caused.
    """
    deadline = time.monotonic() + 60
    while True:
        # INDEX_CLEANUP ON: a page with a few dead line pointers (a rolled-back
        # insert) is left so when the index pass is skipped, and is not all-visible.
        conn.execute("VACUUM (ANALYZE, INDEX_CLEANUP ON) conveyor.events")
        row = conn.execute("SELECT relallvisible, relpages FROM pg_class"
                           " WHERE oid = 'conveyor.events_live'::regclass").fetchone()
        assert row is not None
        if row[0] >= row[1] or time.monotonic() > deadline:
            return
        time.sleep(0.2)


@pytest.fixture
def big(big_db: str) -> Iterator[Conn]:
    """A connection to the big database inside a transaction rolled back afterwards."""
    with plan_session(big_db) as conn:
        yield conn


# Every partition's (0025): the live one and the history's days.
READS = ("SELECT sum(seq_scan), sum(seq_tup_read), sum(idx_tup_fetch)"
         " FROM pg_stat_xact_user_tables WHERE relid IN"
         " (SELECT relid FROM pg_partition_tree('conveyor.events') WHERE isleaf)")


def _table_reads(conn: Conn, action: Callable[[], object]) -> tuple[int, int, int]:
    """(sequential scans, rows they read, rows fetched by index) of the events table
    during ``action``. The backend's counters are read before and after inside the
    transaction, where it never flushes them, so the difference is ``action``'s."""
    before = conn.execute(READS).fetchone()
    action()
    after = conn.execute(READS).fetchone()
    assert before is not None and after is not None
    seq_scans, seq_rows, fetched = (int(a or 0) - int(b or 0) for a, b in zip(after, before,
                                                                              strict=True))
    return seq_scans, seq_rows, fetched


# ------------------------------------------------------------------ exactness

def test_open_states_are_exact_among_200k_finished_rows(big: Conn) -> None:
    status = Admin().status(big)
    assert status.counts["pending"] == sum(PENDING.values())      # due now
    assert status.counts["scheduled"] == FUTURE
    assert status.counts["running"] == RUNNING
    assert status.counts["failed"] == sum(FAILED.values())
    by_topic = {(t.topic, t.state.value): (t.count, t.scheduled) for t in status.by_topic}
    assert by_topic == {("big.a", "pending"): (70, 0), ("big.a", "failed"): (30, 0),
                        ("big.b", "pending"): (0, FUTURE), ("big.b", "failed"): (12, 0),
                        ("big.c", "pending"): (30, 0), ("big.c", "running"): (RUNNING, 0)}


def test_finished_counts_past_the_limit_are_flagged_estimates(big: Conn) -> None:
    status = Admin().status(big)
    assert status.estimated_states == ["succeeded", "cancelled"]
    assert status.to_json()["estimated_states"] == ["succeeded", "cancelled"]
    assert status.counts["succeeded"] == pytest.approx(SUCCEEDED, rel=0.05)
    # Cancelled is 2% of the rows: ANALYZE's sample of 30,000 sees it, roughly.
    assert status.counts["cancelled"] == pytest.approx(CANCELLED, rel=0.3)
    assert not {t.state for t in status.by_topic} & {EventState.SUCCEEDED, EventState.CANCELLED}


def test_open_counts_see_the_callers_uncommitted_changes(big: Conn) -> None:
    """The exact counts read the table in the caller's transaction; estimates do not move."""
    before = Admin().status(big)
    Producer().enqueue(big, "big.new")
    big.execute("UPDATE conveyor.events SET state = 'failed', finished_at = now(),"
                " lease_owner = NULL, lease_expires_at = NULL WHERE state = 'running'")
    after = Admin().status(big)
    assert after.counts["pending"] == before.counts["pending"] + 1
    assert (after.counts["running"], after.counts["failed"]) == (0, before.counts["failed"]
                                                                 + RUNNING)
    # The statistics have not seen the new row: only the exact counts moved.
    assert after.counts["succeeded"] == pytest.approx(before.counts["succeeded"], abs=1)


async def test_async_status_equals_sync_status(big_db: str) -> None:
    with psycopg.connect(big_db) as conn:
        expected = Admin().status(conn)
    async with await psycopg.AsyncConnection.connect(big_db) as aconn:
        got = await AsyncAdmin().status(aconn)
    assert got.counts == expected.counts
    # The ages were read a moment apart.
    assert [replace(t, oldest_due_s=None) for t in got.by_topic] == \
        [replace(t, oldest_due_s=None) for t in expected.by_topic]
    for a, b in zip(got.by_topic, expected.by_topic, strict=True):
        assert (a.oldest_due_s is None) == (b.oldest_due_s is None)
        assert a.oldest_due_s is None or abs(a.oldest_due_s - (b.oldest_due_s or 0)) < 5
    assert got.estimated_states == expected.estimated_states == ["succeeded", "cancelled"]


# ------------------------------------------------ bounded: the failed counts

def _fail(conn: Conn, topic: str, n: int) -> None:
    conn.execute("""
        INSERT INTO conveyor.events (topic, payload, state, attempts, max_attempts,
                                     finished_at, last_error)
        SELECT %s, '{}', 'failed', 1, 1, now(), 'boom' FROM generate_series(1, %s)""",
                 (topic, n))


def test_bounded_status_is_the_exact_one_while_failed_events_are_few(big: Conn) -> None:
    exact, bounded = Admin().status(big), Admin().status(big, bounded=True)
    assert bounded.counts == exact.counts and bounded.capped_states == []
    assert [replace(t, oldest_due_s=None) for t in bounded.by_topic] == \
        [replace(t, oldest_due_s=None) for t in exact.by_topic]
    # Up to the limit itself, every failed event is counted, in each topic too.
    _fail(big, "big.many", FAILED_EXACT_LIMIT - sum(FAILED.values()))
    status = Admin().status(big, bounded=True)
    assert status.counts["failed"] == FAILED_EXACT_LIMIT and status.capped_states == []
    failed = {t.topic: (t.count, t.capped) for t in status.by_topic if t.state == "failed"}
    assert failed["big.many"] == (FAILED_EXACT_LIMIT - sum(FAILED.values()), False)


def test_bounded_status_caps_failed_counts_past_the_limit(big: Conn) -> None:
    _fail(big, "big.many", FAILED_EXACT_LIMIT)
    _fail(big, "big.some", FAILED_TOPIC_EXACT_LIMIT + 1)
    exact, status = Admin().status(big), Admin().status(big, bounded=True)
    total = sum(FAILED.values()) + FAILED_EXACT_LIMIT + FAILED_TOPIC_EXACT_LIMIT + 1
    assert exact.counts["failed"] == total and exact.capped_states == []
    assert status.counts["failed"] == FAILED_EXACT_LIMIT
    assert status.capped_states == ["failed"] == status.to_json()["capped_states"]
    failed = {t.topic: (t.count, t.capped) for t in status.by_topic if t.state == "failed"}
    assert failed == {"big.a": (30, False), "big.b": (12, False),
                      "big.many": (FAILED_TOPIC_EXACT_LIMIT, True),
                      "big.some": (FAILED_TOPIC_EXACT_LIMIT, True)}
    # The other open states are as exact as ever.
    assert {k: status.counts[k] for k in ("pending", "scheduled", "running")} == \
        {k: exact.counts[k] for k in ("pending", "scheduled", "running")}


def test_bounded_status_estimates_finished_rows_without_the_uncounted_failed(big: Conn) -> None:
    """The succeeded estimate is the live rows less the open ones: the failed events
    past the bound are taken off by their share in the statistics, not left in."""
    _fail(big, "big.many", 2 * FAILED_EXACT_LIMIT)
    big.execute("ANALYZE conveyor.events")       # in the transaction: sees its own rows
    exact, status = Admin().status(big), Admin().status(big, bounded=True)
    assert status.capped_states == ["failed"]
    # ANALYZE samples 30,000 rows: the failed share is known to within a few %.
    assert status.counts["succeeded"] == pytest.approx(exact.counts["succeeded"], rel=0.02)
    assert status.counts["cancelled"] == pytest.approx(exact.counts["cancelled"], rel=0.02)


def test_bounded_status_reads_a_bounded_number_of_failed_entries(big: Conn) -> None:
    _fail(big, "big.many", 3 * FAILED_EXACT_LIMIT)
    reads = []
    for name, params in (("status_failed_total_bounded", {"limit": FAILED_EXACT_LIMIT}),
                         ("status_failed_bounded", {"cap": FAILED_TOPIC_EXACT_LIMIT})):
        row = big.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + Q[name], params).fetchone()
        assert row is not None
        nodes = scans(row[0][0]["Plan"])
        assert {n.get("Index Name") for n in nodes} == {"events_failed_idx"}, nodes
        reads.append(round(sum(n["Actual Rows"] * n["Actual Loops"] for n in nodes)))
    # The total: the limit and one more, of 30,042. Each topic: the entry that
    # finds it, and its failed events up to the cap and one more.
    assert reads == [FAILED_EXACT_LIMIT + 1,
                     3 + sum(FAILED.values()) + FAILED_TOPIC_EXACT_LIMIT + 1]


async def test_async_bounded_status_equals_sync(big_db: str) -> None:
    with psycopg.connect(big_db) as conn:
        _fail(conn, "big.many", FAILED_EXACT_LIMIT)
        expected = Admin().status(conn, bounded=True)
        conn.rollback()
    async with await psycopg.AsyncConnection.connect(big_db) as aconn:
        await aconn.execute("""
            INSERT INTO conveyor.events (topic, payload, state, attempts, max_attempts,
                                         finished_at, last_error)
            SELECT 'big.many', '{}', 'failed', 1, 1, now(), 'boom'
            FROM generate_series(1, %s)""", (FAILED_EXACT_LIMIT,))
        got = await AsyncAdmin().status(aconn, bounded=True)
        await aconn.rollback()
    # The estimates follow the table's size, which each rolled-back insert grows.
    open_states = ("pending", "scheduled", "running", "failed")
    assert [got.counts[k] for k in open_states] == [expected.counts[k] for k in open_states]
    assert got.capped_states == expected.capped_states == ["failed"]
    assert [(t.topic, t.state, t.count, t.capped) for t in got.by_topic] == \
        [(t.topic, t.state, t.count, t.capped) for t in expected.by_topic]


def test_failed_cap_counts_each_topic_fully_up_to_the_limit() -> None:
    assert failed_cap(0) == failed_cap(FAILED_EXACT_LIMIT) == FAILED_EXACT_LIMIT
    assert failed_cap(FAILED_EXACT_LIMIT + 1) == FAILED_TOPIC_EXACT_LIMIT


def test_small_queue_counts_finished_states_exactly_per_topic(conn: Conn) -> None:
    conn.execute("DELETE FROM conveyor.events")
    conn.execute("""
        INSERT INTO conveyor.events (topic, payload, state, attempts, finished_at)
        SELECT t, '{}', s, 1, now()
        FROM (VALUES ('a', 'succeeded'), ('a', 'succeeded'), ('b', 'cancelled'),
                     ('b', 'failed')) AS v(t, s)""")
    status = Admin().status(conn)
    assert status.estimated_states == []
    assert status.counts == {"pending": 0, "scheduled": 0, "running": 0, "succeeded": 2,
                             "failed": 1, "cancelled": 1}
    assert [(t.topic, t.state.value, t.count) for t in status.by_topic] == [
        ("a", "succeeded", 2), ("b", "cancelled", 1), ("b", "failed", 1)]


def test_one_finished_row_past_the_limit_switches_to_estimates(
    conn: Conn, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(admin_module, "EXACT_FINISHED_LIMIT", 3)
    conn.execute("DELETE FROM conveyor.events")
    insert = ("INSERT INTO conveyor.events (topic, payload, state, attempts, finished_at)"
              " SELECT 'a', '{}', 'succeeded', 1, now() FROM generate_series(1, %s)")
    conn.execute(insert, (3,))
    assert Admin().status(conn).estimated_states == []
    conn.execute(insert, (1,))
    conn.execute("ANALYZE conveyor.events")     # in the transaction: sees its own rows
    status = Admin().status(conn)
    assert status.estimated_states == ["succeeded", "cancelled"]
    assert status.counts["succeeded"] == 4 and status.counts["cancelled"] == 0


# ------------------------------------------------------------ the estimate

def test_estimate_takes_open_rows_off_and_splits_by_the_state_shares() -> None:
    estimate = (10_000.0, ["succeeded", "pending", "cancelled"], [0.6, 0.2, 0.2], 0.0, 0.0)
    floor = {"succeeded": 0, "cancelled": 0}
    assert estimate_finished(estimate, 2_000, floor) == {"succeeded": 6_000, "cancelled": 2_000}


def test_estimate_adds_the_historys_rows_split_by_its_own_shares() -> None:
    estimate = (1_000.0, ["cancelled"], [1.0], 50_000.0, 500.0)
    floor = {"succeeded": 0, "cancelled": 0}
    assert estimate_finished(estimate, 0, floor) == {"succeeded": 49_500, "cancelled": 1_500}


def test_estimate_never_goes_below_what_the_sample_saw() -> None:
    estimate = (1_000.0, ["succeeded"], [1.0], 0.0, 0.0)
    floor = {"succeeded": 10, "cancelled": 400}      # cancelled rare: not in the MCV list
    assert estimate_finished(estimate, 0, floor) == {"succeeded": 1_000, "cancelled": 400}
    assert estimate_finished(estimate, 5_000, floor) == {"succeeded": 10, "cancelled": 400}


def test_estimate_without_statistics_calls_every_finished_row_succeeded() -> None:
    floor = {"succeeded": 0, "cancelled": 0}
    assert estimate_finished((500.0, None, None, 0.0, 0.0), 100, floor) == {
        "succeeded": 400, "cancelled": 0}
    assert estimate_finished(None, 100, floor) == {"succeeded": 0, "cancelled": 0}


def test_table_estimate_before_any_analyze_uses_the_live_row_counter(fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO conveyor.events (topic, payload, state, finished_at)"
                     " SELECT 'a', '{}', 'succeeded', now() FROM generate_series(1, 500)")
        conn.execute("SELECT pg_stat_force_next_flush()")
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        row = conn.execute(Q["status_table_estimate"],
                           {"schema": "conveyor", "table": Q.live_table,
                            "history": Q.history_table}).fetchone()
        assert row == (500.0, None, None, 0.0, 0.0)
        conn.execute("ANALYZE conveyor.events")
        row = conn.execute(Q["status_table_estimate"],
                           {"schema": "conveyor", "table": Q.live_table,
                            "history": Q.history_table}).fetchone()
        assert row is not None
        assert (round(row[0]), row[1], row[2]) == (500, ["succeeded"], [1.0])


# ------------------------------------------------- bounded: rows and plans

def test_status_reads_no_finished_rows_beyond_the_sample(big: Conn) -> None:
    seq_scans, seq_rows, fetched = _table_reads(big, lambda: Admin().status(big))
    # Only the history's part of the sample (0025) scans: a day, stopped at
    # the limit; the rest goes through indexes.
    assert seq_scans <= _days(big) and seq_rows <= EXACT_FINISHED_LIMIT + 1
    assert fetched <= OPEN_ROWS + EXACT_FINISHED_LIMIT + 1
    # The instrument is live: the count the old status ran reads every row.
    full_count = "SELECT topic, state, count(*) FROM conveyor.events GROUP BY topic, state"
    scans_all, rows_all, _ = _table_reads(big, lambda: big.execute(full_count))
    assert scans_all >= 2 and rows_all == SUCCEEDED + CANCELLED + OPEN_ROWS


def _days(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM pg_inherits"
                       " WHERE inhparent = 'conveyor.events_done'::regclass").fetchone()
    assert row is not None and row[0] >= 1
    return int(row[0])


async def test_async_status_reads_no_finished_rows_beyond_the_sample(big_db: str) -> None:
    async with await psycopg.AsyncConnection.connect(big_db) as aconn:
        await aconn.execute("SET LOCAL max_parallel_workers_per_gather = 0")
        before = await (await aconn.execute(READS)).fetchone()
        await AsyncAdmin().status(aconn)
        after = await (await aconn.execute(READS)).fetchone()
        await aconn.rollback()
    assert before is not None and after is not None
    assert after[1] - before[1] <= EXACT_FINISHED_LIMIT + 1   # the history's sample
    assert after[2] - before[2] <= OPEN_ROWS + EXACT_FINISHED_LIMIT + 1


STATUS_QUERIES: dict[str, dict[str, Any]] = {
    "status_open_counts": {},
    "status_open_counts_but_failed": {},
    "status_failed_total_bounded": {"limit": FAILED_EXACT_LIMIT},
    "status_failed_bounded": {"cap": FAILED_TOPIC_EXACT_LIMIT},
    "status_finished_sample": {"limit": EXACT_FINISHED_LIMIT + 1},
    "status_table_estimate": estimate_params(Q),
    "status_oldest_due_age": {},
}


def _indexes(plan: Any) -> set[str]:
    return {n["Index Name"] for n in scans(plan) if "Index Name" in n}


@pytest.mark.parametrize("name", list(STATUS_QUERIES))
def test_status_query_plan_reads_only_its_index_among_200k_finished_rows(
    big: Conn, name: str,
) -> None:
    row = big.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + Q[name],
                      STATUS_QUERIES[name] or None).fetchone()
    assert row is not None
    top = row[0][0]["Plan"]
    nodes = scans(top)
    # The sample's history part (0025) reads any `limit` rows of a day, no
    # index needed: a scan that stops there.
    assert all(n["Node Type"] != "Seq Scan" or (
        name == "status_finished_sample" and n["Relation Name"].startswith("events_done"))
        for n in nodes), nodes
    # Rows each table access produced (a bitmap's index half is not counted twice).
    rows_read = sum(n["Actual Rows"] * n["Actual Loops"] for n in nodes
                    if n["Node Type"] in ("Index Scan", "Index Only Scan", "Bitmap Heap Scan",
                                          "Seq Scan"))
    # The sample: at most `limit` live rows and `limit` of the history's.
    limit = 2 * (EXACT_FINISHED_LIMIT + 1) if name == "status_finished_sample" else OPEN_ROWS
    assert rows_read <= limit, nodes
    pages = big.execute("SELECT sum(relpages) FROM pg_class WHERE oid IN (SELECT relid"
                        " FROM pg_partition_tree('conveyor.events') WHERE isleaf)").fetchone()
    assert pages is not None
    buffers = top["Shared Hit Blocks"] + top["Shared Read Blocks"]
    # The history's part of the sample reads its rows from the heap (no index
    # holds them by finish time): a few hundred pages, not the table's.
    share = 5 if name == "status_finished_sample" else 10
    assert buffers < pages[0] // share, (buffers, pages[0])


@pytest.mark.parametrize("name", ["status_open_counts", "status_oldest_due_age"])
def test_open_state_reads_never_plan_the_historys_days(fresh_db: str, name: str) -> None:
    """Waiting, pending, running and failed events are never in the history (its
    CHECK): read through `events`, each of 31 days would be opened (and locked)
    at planning only for its CHECK to rule it out."""
    through_parent = Q[name].replace('"conveyor".events_live', '"conveyor".events')
    assert through_parent != Q[name]
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute(Q["history_make_days"], {"ahead": 30})
        assert _days(conn) == 31
        opened = {}
        for label, text in (("live", Q[name]), ("parent", through_parent)):
            with conn.transaction():
                conn.execute("EXPLAIN " + text)
                row = conn.execute(
                    "SELECT count(*) FROM pg_locks AS l JOIN pg_inherits AS i"
                    " ON i.inhrelid = l.relation WHERE l.pid = pg_backend_pid()"
                    " AND i.inhparent = 'conveyor.events_done'::regclass").fetchone()
                assert row is not None
                opened[label] = row[0]
    assert opened == {"live": 0, "parent": 31}


def test_waiting_count_reads_no_events_when_no_edge_is_open(fresh_db: str) -> None:
    """The waiting events are found from their open edges, whatever the live partition
    holds: with the edges' table never analyzed, a semi-join plan scanned every row of
    it (35,000 failed events) to count no waiting event."""
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO conveyor.events (topic, payload, state, attempts, max_attempts,"
                     " finished_at) SELECT 'f', '{}', 'failed', 1, 1, now()"
                     " FROM generate_series(1, 35000)")
        conn.execute("VACUUM ANALYZE conveyor.events")
    with plan_session(fresh_db) as conn:
        row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + Q["status_open_counts"]
                           ).fetchone()
    assert row is not None
    nodes = scans(row[0][0]["Plan"])
    assert all(n["Node Type"] != "Seq Scan" for n in nodes), nodes
    # Only the failed branch reads the failed events.
    assert sum(n["Actual Rows"] * n["Actual Loops"] + n.get("Rows Removed by Filter", 0)
               for n in nodes if n.get("Index Name") != "events_failed_idx") == 0, nodes


def test_status_query_plans_scan_no_events_without_an_index(big: Conn) -> None:
    """Plain EXPLAIN (the planner's choice without running): an index for every branch."""
    # Waiting events (0022) are read by id through their open edges: events_pkey.
    expected = {"status_open_counts": {"events_claim_idx", "events_lease_idx",
                                       "events_failed_idx", "events_pkey"},
                "status_finished_sample": {"events_prunable_idx"},
                "status_oldest_due_age": {"events_claim_idx"}}
    for name, indexes in expected.items():
        row = big.execute("EXPLAIN (FORMAT JSON) " + Q[name],
                          STATUS_QUERIES[name] or None).fetchone()
        assert row is not None
        plan = row[0][0]["Plan"]
        # But the history's part of the sample (0025): any rows of a day.
        assert all(n["Node Type"] != "Seq Scan" or (
            name == "status_finished_sample" and n["Relation Name"].startswith("events_done"))
            for n in scans(plan)), (name, plan)
        assert _indexes(plan) == indexes, (name, plan)


def test_retry_failed_reads_failed_rows_through_their_index(big: Conn) -> None:
    row = big.execute("EXPLAIN (FORMAT JSON) " + Q["event_retry_failed"],
                      {"topic": None}).fetchone()
    assert row is not None
    assert _indexes(row[0][0]["Plan"]) == {"events_failed_idx"}
    assert all(n["Node Type"] != "Seq Scan" for n in scans(row[0][0]["Plan"]))


# --------------------------------------------------------------------- CLI

def _queue_status(estimated: list[str]) -> QueueStatus:
    return QueueStatus(
        counts={"pending": 3, "running": 0, "succeeded": 1_234_000, "failed": 2,
                "cancelled": 500},
        by_topic=[TopicCount("a.x", EventState.PENDING, 3, oldest_due_s=12.25),
                  TopicCount("a.x", EventState.FAILED, 2), TopicCount("b", EventState.FAILED, 1)],
        oldest_pending_age_s=1.5, workers=[], estimated_states=estimated)


def test_cli_marks_estimates_and_drops_their_topic_columns() -> None:
    lines = format_status(_queue_status(["succeeded", "cancelled"])).splitlines()
    assert lines[0] == ("events: pending 3  running 0  succeeded ~1234000  failed 2  "
                        "cancelled ~500")
    header = next(line for line in lines if line.startswith("topic"))
    assert header.split() == ["topic", "pending", "running", "failed", "oldest", "due"]
    assert next(line for line in lines if line.startswith("a.x")).split() == [
        "a.x", "3", "0", "2", "12.2s"]
    # A topic with nothing due has no lag to show.
    assert next(line for line in lines if line.startswith("b ")).split() == ["b", "0", "0", "1", "-"]


def test_cli_prints_exact_counts_plainly() -> None:
    lines = format_status(_queue_status([])).splitlines()
    assert "~" not in lines[0] and "succeeded 1234000" in lines[0]
    header = next(line for line in lines if line.startswith("topic"))
    assert header.split() == ["topic", "pending", "running", "succeeded", "failed", "cancelled",
                              "oldest", "due"]


def test_queue_status_built_without_the_new_field_is_all_exact() -> None:
    status = QueueStatus(counts={}, by_topic=[], oldest_pending_age_s=None, workers=[])
    assert status.estimated_states == [] and status.to_json()["estimated_states"] == []


def _nodes_on(plan: Any, index: str) -> list[dict[str, Any]]:
    return [n for n in scans(plan) if n.get("Index Name") == index]


def test_pending_counts_come_from_the_claim_index_alone(big_db: str, big: Conn) -> None:
    """0009: topic and tenant are in events_claim_idx, so no pending row is read from the table."""
    # The tests before this one changed rows and rolled back: their pages are not
    # all-visible until a VACUUM makes them so again.
    with psycopg.connect(big_db, autocommit=True) as conn:
        _vacuumed(conn)
    row = big.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + Q["status_open_counts"]).fetchone()
    assert row is not None
    claim = _nodes_on(row[0][0]["Plan"], "events_claim_idx")
    assert claim and all(n["Node Type"] == "Index Only Scan" for n in claim), claim
    # Only rows on pages not yet all-visible are checked in the table (the last few here).
    pending = sum(PENDING.values()) + FUTURE
    assert sum(n["Heap Fetches"] for n in claim) <= pending // 10, claim


def test_oldest_due_age_probes_one_entry_per_priority(big: Conn) -> None:
    # Three priorities among the due events; the skip scan reads a few entries
    # per priority, never the due backlog (100 rows here, 200,000 in the benchmark).
    big.execute("UPDATE conveyor.events SET priority = 5 WHERE topic = 'big.c' AND state = 'pending'")
    big.execute("UPDATE conveyor.events SET priority = -3, run_at = now() - interval '2 hours'"
                " WHERE id = (SELECT min(id) FROM conveyor.events WHERE topic = 'big.a'"
                " AND state = 'pending')")
    row = big.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + Q["status_oldest_due_age"]).fetchone()
    assert row is not None
    nodes = scans(row[0][0]["Plan"])
    read = sum(n["Actual Rows"] * n["Actual Loops"] for n in nodes)
    assert read <= 3 * 3, nodes
    age = big.execute(Q["status_oldest_due_age"]).fetchone()
    assert age is not None and 7190 < age[0] < 7300       # the -3 priority's, two hours


def _schedule(name: str, expression: str, tz: str, topic: str) -> ScheduleInfo:
    moment = datetime(2026, 12, 2, 5, 0, tzinfo=UTC)
    return ScheduleInfo(name=name, expression=expression, timezone=tz, topic=topic, catch_up=0.0,
                        fired_through=moment, next_fire_at=moment, last_fired_at=None, missed=0,
                        last_missed_at=None, overdue_s=0.0)


def test_status_names_a_schedule_once_when_its_name_is_the_default() -> None:
    # Newcomer review L4: "mail.digest 0 6 * * mon-fri Europe/Madrid: 0 6 * * mon-fri
    # Europe/Madrid -> mail.digest".
    default = Schedule.define("0 6 * * mon-fri", "mail.digest", tz="Europe/Madrid").name
    lines = format_schedules([_schedule(default, "0 6 * * mon-fri", "Europe/Madrid",
                                        "mail.digest"),
                              _schedule("nightly", "0 3 * * *", "UTC", "report.build")])
    assert lines[2] == ("  0 6 * * mon-fri Europe/Madrid -> mail.digest, "
                        "next 2026-12-02 05:00:00 UTC")
    assert lines[3] == "  nightly: 0 3 * * * -> report.build, next 2026-12-02 05:00:00 UTC"
