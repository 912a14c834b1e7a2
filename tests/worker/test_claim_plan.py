"""A worker's claims walk the claim index in order, whatever the statistics say.

Statistics taken while no event was pending (an empty table, or one of
finished events), then a burst arrives before autovacuum analyzes again:
planned for those figures, a claim of 100 read and sorted the whole backlog
(this file failed so for the plain claim, the flow claim and the flow sort;
lanes.sql's lane_set_aside shares the flow sort's fix). A claim window's
statements, sent with their values in the text, are planned anew each time:
its outcomes read every pending row so, too. Each statement runs
on the worker's own session for it, in a transaction rolled back, and the
transaction's own counts say how many rows it fetched.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from claim_support import claim_params
from conveyor.db.named_queries import queries_for
from conveyor.patterns import sql_params
from conveyor.types import EventState
from conveyor.worker.acks import ack
from conveyor.worker.classify import Outcome
from conveyor.worker.connection import ManagedConnection
from conveyor.worker.sessions import WorkerConnections
from query_plans import plan_session
from worker_support import fast_config

Q = queries_for("conveyor")
BACKLOG = 20_000
# A few fetches per row of a batch of 100 (the claim's 100, each found again by
# id for its UPDATE: 200; the sort's front, its locks and its UPDATE: 404); a
# plan that reads the backlog fetches all 20,000 first.
MOST_FETCHED = 1_000


def _burst(db: str, history: int, *, limited: bool = False) -> None:
    with psycopg.connect(db, autocommit=True) as admin:
        admin.execute("INSERT INTO conveyor.events (topic, payload, state, finished_at) "
                      "SELECT 'plan.done', '{}', 'succeeded', now() "
                      "FROM generate_series(1, %s)", (history,))
        admin.execute("ANALYZE conveyor.events")
        admin.execute("INSERT INTO conveyor.events (topic, payload, limited) "
                      "SELECT 'plan.job', '{}', %s FROM generate_series(1, %s)",
                      (limited, BACKLOG))


async def _fetched(managed: ManagedConnection, query: str, params: dict[str, Any] | None, *,
                   counter: str = "idx_tup_fetch") -> int:
    """Rows of the events table ``query`` read on ``managed``'s session, rolled back: those
    fetched through an index (``idx_tup_fetch``), or those a scan of the whole table read
    (``seq_tup_read``)."""
    conn = await managed.get()
    async with conn.transaction(force_rollback=True):
        await conn.execute(query, params)
        cur = await conn.execute(sql.SQL("SELECT {} FROM pg_stat_xact_user_tables "
                                         "WHERE relid = 'conveyor.events_live'::regclass"
                                         ).format(sql.Identifier(counter)))
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("history", [0, BACKLOG], ids=["empty", "all_finished"])
async def test_a_claim_after_a_burst_on_stale_statistics_reads_one_batch(
        db: str, history: int) -> None:
    _burst(db, history)
    connections = WorkerConnections(db, fast_config(), asyncio.Event())
    try:
        fetched = await _fetched(connections.fetch, Q["event_claim"], claim_params(limit=100))
        assert fetched <= MOST_FETCHED, f"the claim fetched {fetched} rows for 100 events"
    finally:
        await connections.close()


@pytest.mark.parametrize("query", ["event_claim", "event_claim_unpaused", "flow_claim"])
def test_a_claim_writes_the_live_partition_not_the_parent(db: str, query: str) -> None:
    # Pending rows are live (0025): through the partitioned parent the same
    # claim cost 7-12 % more (benchmarks/sql_costs.py, "claim on events").
    _burst(db, 0)
    params = {**claim_params(limit=100), **sql_params(["plan.*"], prefix="limit_")}
    with plan_session(db) as conn:
        plan = conn.execute(b"EXPLAIN (FORMAT JSON) " + Q[query].encode(), params).fetchone()
        assert plan is not None
        top = plan[0][0]["Plan"]
        assert (top["Node Type"], top["Relation Name"]) == ("ModifyTable", "events_live")


async def test_the_flow_claim_and_sort_after_a_burst_read_one_batch(db: str) -> None:
    connections = WorkerConnections(db, fast_config(), asyncio.Event())
    try:
        _burst(db, 0, limited=True)
        flow = connections.flow_connection()
        fetched = await _fetched(flow, Q["flow_claim"], {
            **claim_params(limit=100), **sql_params(["plan.*"], prefix="limit_")})
        assert fetched <= MOST_FETCHED, f"the flow claim fetched {fetched} rows for 100 events"
        # The sort reads the open lane's front: a second burst, not yet sorted.
        _burst(db, 0)
        fetched = await _fetched(flow, Q["flow_sort"], {
            **sql_params(["plan.*"], prefix="limit_"), "window": 100})
        assert fetched <= MOST_FETCHED, f"the flow sort fetched {fetched} rows for 100 events"
    finally:
        await connections.close()


async def test_a_fifo_claim_that_must_sort_compiles_nothing(db: str) -> None:
    # A fifo_by claim picks each key's head (DISTINCT ON): a sort no index
    # replaces. With sorts priced out, its cost passed jit_above_cost before
    # PostgreSQL 18, and every such claim was compiled first (70 ms quiet,
    # 11 s for 20 events of one key under a loaded CI).
    with psycopg.connect(db, autocommit=True) as admin:
        admin.execute("INSERT INTO conveyor.events (topic, payload, limited, tenant) "
                      "SELECT 'plan.job', '{}', true, 't' || mod(n, 3) "
                      "FROM generate_series(1, 200) AS n")
    connections = WorkerConnections(db, fast_config(), asyncio.Event())
    try:
        conn = await connections.flow_connection().get()
        params = {**claim_params(limit=10), **sql_params(["plan.*"], prefix="limit_"),
                  "fifo_tenant": True, "fifo_path": []}
        async with conn.transaction(force_rollback=True):
            cur = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + Q["flow_claim_fifo"],
                                     params)
            row = await cur.fetchone()
        assert row is not None
        plan = row[0][0]
        assert "JIT" not in plan, f"the fifo claim was compiled: {plan['JIT']}"
    finally:
        await connections.close()


LIMITED = sql_params(["plan.*"], prefix="limit_")
# Each statement that updates a batch it locked first, with the parameters of
# a batch (or a window) of 1000, and whether the burst is in the limited lane.
BATCH_WRITES = {
    "claim": ("fetch", "event_claim", {}, False),
    "flow claim": ("flow", "flow_claim", LIMITED, True),
    "claim moving to the flow lane": ("fetch", "event_claim_flow",
                                      {**sql_params(["plan.*"], prefix="except_"),
                                       **sql_params([], prefix="fifo_")}, False),
    "flow sort": ("flow", "flow_sort", {**LIMITED, "window": 1000}, False),
    "flow unsort": ("flow", "flow_unsort",
                    {**sql_params(["other.*"], prefix="limit_"), "batch": 1000}, True),
    "lane bring back": ("fetch", "lane_bring_back", {"batch": 1000}, None),
    "rescue": ("maintenance", "event_rescue_expired", {}, False),
}


@pytest.mark.parametrize("name", list(BATCH_WRITES))
async def test_a_batch_of_a_thousand_is_found_again_by_id_not_by_reading_the_table(
        db: str, name: str) -> None:
    # A claim's UPDATE joined the rows it had locked to the table: for a batch
    # of 1000 (the best settings of `conveyor bench`) on fresh statistics the
    # planner hashed the whole table, 20,000 rows read for every claim; so did
    # the moves to the flow lane, the flow unsort and the rescue; the lanes'
    # bring back read and sorted the whole aside lane for each batch.
    role, query, extra, limited = BATCH_WRITES[name]
    with psycopg.connect(db, autocommit=True) as admin:
        admin.execute("INSERT INTO conveyor.events (topic, payload, limited) "
                      "SELECT 'plan.job', '{}', %s FROM generate_series(1, %s)",
                      (limited, BACKLOG))
        if name == "rescue":
            admin.execute("UPDATE conveyor.events SET state = 'running', "
                          "lease_owner = gen_random_uuid(), lease_expires_at = now() - "
                          "interval '1 minute', attempts = 1")
        admin.execute("ANALYZE conveyor.events")
    connections = WorkerConnections(db, fast_config(), asyncio.Event())
    try:
        managed = (connections.flow_connection() if role == "flow"
                   else getattr(connections, role))
        read = await _fetched(managed, Q[query], {**claim_params(limit=1000), **extra},
                              counter="seq_tup_read")
        # The unsort finds its batch by reading the table until it has it: 1000 rows.
        assert read <= 1000, f"the {name} of 1000 read {read} rows of the table end to end"
    finally:
        await connections.close()


# A window's outcomes (windows.sql), for 100 events of a burst: successes
# written or deleted, and a retry (the settle statement).
HELD_OUTCOMES = {
    "success": (False, EventState.SUCCEEDED),
    "success, retention 0": (True, EventState.SUCCEEDED),
    "retry": (False, EventState.PENDING),
}


@pytest.mark.parametrize("name", list(HELD_OUTCOMES))
async def test_a_windows_outcomes_after_a_burst_are_found_by_id(db: str, name: str) -> None:
    # A window sends its statements with their values in the text, so each is
    # planned anew on the statistics of the moment: taken on an empty table,
    # they joined the batch to a scan of every pending row, for every window
    # (a windowed drain of 100,000 events at a third of the leased one).
    delete, state = HELD_OUTCOMES[name]
    _burst(db, 0)
    outcomes = [Outcome(n, 1, state, delay=1.0 if state is EventState.PENDING else None,
                        error="boom" if state is EventState.PENDING else None)
                for n in range(5_001, 5_101)]
    (query, params), = ack(Q, "7f3c2a64-1d5e-4b8e-9c1a-3e2f4d5c6b7a", outcomes,
                           delete_succeeded=delete, held=True).statements
    connections = WorkerConnections(db, fast_config(claim_window=0.1), asyncio.Event())
    try:
        assert connections.window is not None
        conn = await connections.window.get()
        text = psycopg.AsyncClientCursor(conn).mogrify(query, params)
        fetched = await _fetched(connections.window, text, None)
        assert fetched <= 2 * len(outcomes), f"{name}: {fetched} rows fetched for 100 outcomes"
    finally:
        await connections.close()


@pytest.mark.parametrize("history", [0, BACKLOG], ids=["empty", "all_finished"])
async def test_a_windows_claim_after_a_burst_reads_one_batch(db: str, history: int) -> None:
    # The held claim goes out as text too (with its BEGIN), planned each time.
    _burst(db, history)
    connections = WorkerConnections(db, fast_config(claim_window=0.1), asyncio.Event())
    try:
        assert connections.window is not None
        conn = await connections.window.get()
        text = psycopg.AsyncClientCursor(conn).mogrify(Q["event_claim_held"],
                                                      claim_params(limit=100))
        fetched = await _fetched(connections.window, text, None)
        assert fetched <= MOST_FETCHED, f"the held claim fetched {fetched} rows for 100 events"
    finally:
        await connections.close()


async def test_a_batch_that_met_lost_windows_is_leased_by_id_after_a_burst(db: str) -> None:
    # event_claim_crashed, the lease of a batch whose events lost windows
    # before (a worker killed during a burst): it read every pending row too.
    _burst(db, 0)
    ids = list(range(5_001, 5_101))
    connections = WorkerConnections(db, fast_config(claim_window=0.1), asyncio.Event())
    try:
        assert connections.window is not None
        fetched = await _fetched(connections.window, Q["event_claim_crashed"], {
            "ids": ids, "crashes": [1] * len(ids), "window_no": 1,
            "owner": uuid.UUID("7f3c2a64-1d5e-4b8e-9c1a-3e2f4d5c6b7a"), "lease_ttl": 30.0})
        assert fetched <= MOST_FETCHED, f"the lease fetched {fetched} rows for 100 events"
    finally:
        await connections.close()
