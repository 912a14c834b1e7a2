"""R13/R14: the claim stays fast on a big table and under a pinned vacuum horizon.

R14 (the plan says 10 M finished rows; 1 M here to fit CI time): 1,000,000
finished + 40,000 pending + 100,000 future rows. The claim of 1 and of 100
events must take < 100 ms, by EXPLAIN ANALYZE and by the wall clock of the
real query. R13: an idle-in-transaction session holding an xid pins the
horizon while events flow at a steady rate; claim p95 and dead tuples are
measured (and reported with the command). Admin.status on the same table
counts pending, running and failed exactly, estimates the rest, and reads no
finished row beyond its capped sample (the 10 M version: benchmarks/big_table.py).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import psycopg
import pytest

from claim_support import claim_params
from conveyor import AsyncCommittingProducer, Event, EventFilter, NewEvent, Worker
from conveyor.admin import EXACT_FINISHED_LIMIT, Admin
from conveyor.db.named_queries import queries_for
from worker_support import router_for

from .helpers import fast_config

pytestmark = [pytest.mark.slow]

FINISHED = 1_000_000
PENDING = 40_000
FUTURE = 100_000
CLAIM_LIMIT_MS = 100.0

FILL = f"""
INSERT INTO conveyor.events (topic, payload, state, attempts, run_at, created_at, updated_at,
                             finished_at, tenant)
SELECT 'big.' || (g % 20), '{{"n": 1}}', CASE WHEN g % 10 = 0 THEN 'failed' ELSE 'succeeded' END,
       1, now() - interval '2 days', now() - interval '2 days', now() - interval '2 days',
       now() - interval '1 day', 't' || (g % 50)
FROM generate_series(1, {FINISHED}) AS g;
INSERT INTO conveyor.events (topic, payload, run_at, tenant)
SELECT 'big.' || (g % 20), '{{"n": 2}}', now() - interval '1 hour', 't' || (g % 50)
FROM generate_series(1, {PENDING}) AS g;
INSERT INTO conveyor.events (topic, payload, run_at, tenant)
SELECT 'big.' || (g % 20), '{{"n": 3}}', now() + interval '1 day' + g * interval '1 second',
       't' || (g % 50)
FROM generate_series(1, {FUTURE}) AS g;
"""


def _claim_params(limit: int, **filt: Any) -> dict[str, Any]:
    return claim_params(limit=limit, owner="00000000-0000-0000-0000-000000000001", **filt)


def _measure_claim(conn: psycopg.Connection[Any], params: dict[str, Any],
                   runs: int = 15) -> dict[str, float]:
    sql = queries_for("conveyor")["event_claim"]
    walls, execs, rows_seen = [], [], 0
    for _ in range(runs):
        with conn.transaction(force_rollback=True):
            start = time.perf_counter()
            rows = conn.execute(sql, params).fetchall()
            walls.append((time.perf_counter() - start) * 1000)
            rows_seen = len(rows)
        with conn.transaction(force_rollback=True):
            plan = conn.execute(b"EXPLAIN (ANALYZE, FORMAT JSON) " + sql.encode()
                                if isinstance(sql, str) else b"EXPLAIN (ANALYZE, FORMAT JSON) " + sql,
                                params).fetchone()
            assert plan is not None
            execs.append(float(plan[0][0]["Execution Time"]))
    return {"rows": rows_seen, "wall_ms_median": statistics.median(walls),
            "wall_ms_max": max(walls), "explain_ms_median": statistics.median(execs),
            "explain_ms_max": max(execs)}


FULL_COUNT = "SELECT topic, state, count(*) FROM conveyor.events GROUP BY topic, state"

# Admin.events pages on the big table (docs/admin.md): a rare tenant's failed
# events sit among the finished rows, so a listing of failed or cancelled
# events of that tenant (or topic) that lost its partial index would read half
# the table. The error text only filters: its page reads the
# failed rows newest first until 50 match, here every failed row newer than
# the rare ones (about 50,000), so its time is printed, not bounded.
RARE_FAILED = 100
PAGE_LIMIT_MS = 100.0
LISTINGS = {
    "first page": EventFilter(),
    "failed": EventFilter(states=("failed",)),
    "failed, one topic": EventFilter(states=("failed",), topic="big.10"),
    "topic prefix": EventFilter(topic="big.*"),
    "one tenant": EventFilter(tenant="t7"),
    "rare tenant": EventFilter(states=("failed", "cancelled"), tenant="rare"),
    "rare topic": EventFilter(states=("failed", "cancelled"), topic="rare.topic"),
    "pending, newer than 2 h": EventFilter(states=("pending",), newer_than=7200),
    "failed, error text": EventFilter(states=("failed",), error="smtp 421"),
}


def _measure_pages(conn: psycopg.Connection[Any], runs: int = 5) -> dict[str, dict[str, Any]]:
    """Wall time of the first page and of the page after it, for each listing."""
    admin = Admin()
    out: dict[str, dict[str, Any]] = {}
    for name, filt in LISTINGS.items():
        first, second, rows = [], [], 0
        for _ in range(runs):
            start = time.perf_counter()
            page = admin.events(conn, filt, limit=50)
            first.append((time.perf_counter() - start) * 1000)
            rows = len(page.events)
            if page.next_after is not None:
                start = time.perf_counter()
                admin.events(conn, filt, after=page.next_after, limit=50)
                second.append((time.perf_counter() - start) * 1000)
        out[name] = {"rows": rows, "first_ms_median": round(statistics.median(first), 2),
                     "first_ms_max": round(max(first), 2),
                     "next_ms_median": round(statistics.median(second), 2) if second else None}
    return out


def _status_table_reads(conn: psycopg.Connection[Any], admin: Admin) -> dict[str, int]:
    """What one status call read from the events table, by the backend's table statistics.

    The counters are read before and after inside one transaction block, where
    the backend never flushes them, so the difference is this call's alone.
    """
    query = ("SELECT seq_scan, seq_tup_read, idx_tup_fetch FROM pg_stat_xact_user_tables"
             " WHERE relid = 'conveyor.events_live'::regclass")
    with conn.transaction(force_rollback=True):
        # Parallel workers keep statistics of their own; one process keeps them countable.
        conn.execute("SET LOCAL max_parallel_workers_per_gather = 0")
        before = conn.execute(query).fetchone()
        admin.status(conn)
        after = conn.execute(query).fetchone()
    assert before is not None and after is not None
    return {name: after[i] - before[i]
            for i, name in enumerate(("seq_scan", "seq_tup_read", "idx_tup_fetch"))}


# serial: fills a million rows, and the claim must take < 100 ms by the wall clock.
@pytest.mark.serial
def test_claim_on_a_million_finished_rows(fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        started = time.monotonic()
        conn.execute(FILL)
        conn.execute("VACUUM ANALYZE conveyor.events")
        filled = time.monotonic() - started
        size = conn.execute("SELECT pg_size_pretty(pg_total_relation_size('conveyor.events_live'))"
                            ).fetchone()
        figures = {
            "claim_1": _measure_claim(conn, _claim_params(1)),
            "claim_100": _measure_claim(conn, _claim_params(100)),
            # A worker limited to one topic of twenty and one tenant of fifty: the
            # claim index has no topic/tenant column, so it walks past the others.
            "claim_100_topic_filter": _measure_claim(conn, _claim_params(
                100, all_topics=False, topics=["big.7"])),
            "claim_1_tenant_filter": _measure_claim(conn, _claim_params(
                1, all_tenants=False, tenants=["t7"])),
            # Worst case: a worker whose topic has nothing due walks every due
            # pending row of the other topics on each poll.
            "claim_100_no_match": _measure_claim(conn, _claim_params(
                100, all_topics=False, topics=["nothing.here"])),
        }
        admin = Admin()
        timings, full_count = [], []
        for _ in range(3):
            start = time.perf_counter()
            status = admin.status(conn)
            timings.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            conn.execute(FULL_COUNT).fetchall()      # what status ran before R14
            full_count.append((time.perf_counter() - start) * 1000)
        reads = _status_table_reads(conn, admin)
        # Failed rows from the middle of the table become a rare topic and tenant:
        # a walk from the newest row would read half the table to reach them.
        conn.execute("""
            UPDATE conveyor.events
            SET topic = 'rare.topic', tenant = 'rare', last_error = 'SMTP 421: try later'
            WHERE id IN (SELECT id FROM conveyor.events
                         WHERE state = 'failed' AND id > %s ORDER BY id LIMIT %s)""",
                     (FINISHED // 2, RARE_FAILED))
        conn.execute("ANALYZE conveyor.events")
        pages = _measure_pages(conn)
    print(f"\nR14: filled {FINISHED:,} finished + {PENDING:,} pending + {FUTURE:,} future "
          f"in {filled:.1f}s ({size[0] if size else '?'})")
    for name, f in figures.items():
        print(f"R14 {name}: {f}")
    print(f"R14 admin status: {[round(t) for t in timings]} ms, full count(*) "
          f"{[round(t) for t in full_count]} ms (counts {status.counts}, "
          f"estimated {status.estimated_states}; rows read {reads})")
    for name, f in pages.items():
        print(f"R14 events page, {name}: {f}")
    for name in ("claim_1", "claim_100"):
        f = figures[name]
        assert f["rows"] == int(name.split("_")[1])
        assert f["wall_ms_median"] < CLAIM_LIMIT_MS and f["explain_ms_median"] < CLAIM_LIMIT_MS
    assert figures["claim_100_no_match"]["rows"] == 0
    assert (status.counts["pending"], status.counts["scheduled"]) == (PENDING, FUTURE)
    assert status.counts["failed"] == FINISHED // 10
    assert status.estimated_states == ["succeeded", "cancelled"]
    assert status.counts["succeeded"] == pytest.approx(FINISHED - FINISHED // 10, rel=0.05)
    # R14: no count(*) of the whole table. The open states are read through
    # their indexes, the finished ones only as far as the capped sample.
    assert reads["seq_scan"] == 0
    assert reads["idx_tup_fetch"] <= PENDING + FUTURE + FINISHED // 10 + EXACT_FINISHED_LIMIT + 1
    for name in ("rare tenant", "rare topic"):
        assert pages[name]["rows"] == 50
    assert pages["failed, error text"]["rows"] == 50
    for name, f in pages.items():
        if name != "failed, error text":
            assert f["first_ms_median"] < PAGE_LIMIT_MS, (name, f)


# 9,000 events through the pin: the bound (p95 < 50 ms) is far above what a
# 45 s pin measured (docs/reliability.md); a soak run raises both.
HOLD_SECONDS = 20
RATE = 450          # events per second


async def _rr_reader(url: str, offset: float, stop: asyncio.Event) -> None:
    """Overlapping REPEATABLE READ snapshots: one is always open (plan R13(b))."""
    await asyncio.sleep(offset)
    async with await psycopg.AsyncConnection.connect(url) as conn:
        await conn.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
        while not stop.is_set():
            await conn.execute("SELECT count(*) FROM conveyor.events")
            try:
                await asyncio.wait_for(stop.wait(), 20)
            except TimeoutError:
                pass
            await conn.rollback()


# light: 300 events/s for 30 s left the machine nearly idle (96 % measured on
# 2 cores, 2026-12-04), and 450/s for 20 s do as well; the bound on the claims
# is loose.
@pytest.mark.light
@pytest.mark.parametrize("pin", ["idle_in_transaction_xid", "rr_readers"])
async def test_claim_latency_with_the_vacuum_horizon_pinned(fresh_db: str, pin: str) -> None:
    latencies: list[float] = []
    handled = 0

    async def handle(event: Event) -> None:
        nonlocal handled
        handled += 1

    worker = Worker(fresh_db, router_for("pin.*", handle),
                    fast_config(concurrency=50, batch_size=50, poll_interval=1.0,
                                lease_ttl=10.0, heartbeat_interval=2.0, rescue_interval=2.0))
    original = worker.claims.claim

    async def timed_claim(want: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = await original(want, *args, **kwargs)
        latencies.append((time.perf_counter() - start) * 1000)
        return result

    worker.claims.claim = timed_claim  # type: ignore[method-assign]
    holder = await psycopg.AsyncConnection.connect(fresh_db)
    stop_readers = asyncio.Event()
    readers: list[asyncio.Task[None]] = []
    task = asyncio.create_task(worker.run())
    sent = 0
    try:
        await asyncio.wait_for(worker.started.wait(), 10)
        if pin == "idle_in_transaction_xid":
            await holder.execute("SELECT txid_current()")     # idle in transaction, with an xid
        else:
            readers = [asyncio.create_task(_rr_reader(fresh_db, 5.0 * i, stop_readers))
                       for i in range(4)]
        async with AsyncCommittingProducer(fresh_db) as producer:
            start = time.monotonic()
            tick = 0.1
            while time.monotonic() - start < HOLD_SECONDS:
                batch = int(RATE * tick)
                await producer.enqueue_many([NewEvent(topic="pin.evt") for _ in range(batch)])
                sent += batch
                next_at = start + (sent / RATE)
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        for _ in range(100):
            if handled >= sent:
                break
            await asyncio.sleep(0.1)
        async with await psycopg.AsyncConnection.connect(fresh_db, autocommit=True) as conn:
            await asyncio.sleep(0.6)    # let the stats collector catch up
            dead = await (await conn.execute(
                "SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables "
                "WHERE relid = 'conveyor.events_live'::regclass")).fetchone()
            xmin_age = await (await conn.execute(
                "SELECT max(age(backend_xmin)) FROM pg_stat_activity "
                "WHERE datname = current_database()")).fetchone()
    finally:
        stop_readers.set()
        await asyncio.wait_for(asyncio.gather(*readers, return_exceptions=True), 10)
        await holder.rollback()
        await holder.close()
        worker.request_stop()
        await asyncio.wait_for(task, 15)
        await worker.close()
    busy = sorted(latencies)
    p50 = statistics.median(busy)
    p95 = busy[int(0.95 * (len(busy) - 1))]
    p99 = busy[int(0.99 * (len(busy) - 1))]
    print(f"\nR13 {pin}: horizon pinned {HOLD_SECONDS}s at {RATE} events/s: {sent} sent, {handled} handled; "
          f"{len(busy)} claims p50 {p50:.1f} ms p95 {p95:.1f} ms p99 {p99:.1f} ms max {busy[-1]:.1f} ms; "
          f"dead tuples {dead}, oldest xmin age {xmin_age}")
    assert handled >= sent
    assert p95 < 50.0
