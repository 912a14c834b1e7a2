"""R14 at full size: the claim, status, rescue and prune on a table of 10 M finished rows.

Builds, in a fresh scratch schema migrated by Conveyor's own migrator, 10 M
succeeded rows (finished over the last 30 days), 40 k due pending rows and
100 k pending rows scheduled for tomorrow, with INSERT ... SELECT
generate_series in chunks (indexes, constraints and the NOTIFY trigger all in
place; the bulk inserts use the product's own per-transaction NOTIFY opt-out),
then VACUUM ANALYZE. Then measures, with the worker's own named queries:

* the claim of 1 and of 100 events (``event_claim`` with the parameters the
  worker builds from its router): wall-clock p50/p95 over ``--claims`` runs,
  each rolled back so every run sees the same table;
* EXPLAIN (ANALYZE, BUFFERS) of those claims: index entries walked and
  buffers touched, which should grow with the batch, not with the table;
* ``Admin.status``, next to the full ``count(*) ... GROUP BY topic, state`` it
  ran before R14 (same-run baseline), and how far its succeeded estimate is
  from the number of rows inserted;
* the plans of the maintenance queries (rescue of 100 expired leases, prune
  batches with and without anything old enough) and of ``retry-failed``;
* how long migration 0002's ``CREATE INDEX events_failed_idx`` takes here
  (built and rolled back), since it blocks writes while it builds.

    .venv/bin/python benchmarks/big_table.py --url postgresql://... [--finished 10000000] [--json]

Needs about 3.5 GB of free disk per 10 M rows (table, indexes, WAL); the
schema is dropped at the end (``--keep`` leaves it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql

from conveyor.admin import Admin
from conveyor.config import WorkerConfig
from conveyor.db.named_queries import Queries, queries_for
from conveyor.router import Router
from conveyor.schema.migrator import Migrator, load_migrations
from conveyor.worker import Worker
from conveyor.worker.maintenance import PRUNE_BATCH, RESCUE_BATCH

MARKER = "conveyor R14 big-table benchmark: dropped when the benchmark ends"
CHUNK = 1_000_000
BYTES_PER_ROW = 350          # heap + pkey + finished index + WAL, measured at 10 M, rounded up

# The status query before R14, kept here only as the same-run baseline.
LEGACY_STATUS_COUNT = "SELECT topic, state, count(*) FROM {schema}.events GROUP BY topic, state"

FILL_FINISHED = """
INSERT INTO {schema}.events (topic, tenant, payload, state, attempts, run_at, created_at,
                             updated_at, attempted_at, finished_at)
SELECT 'big.' || (g %% 20), 't' || (g %% 50), '{{"n": 1}}', 'succeeded', 1,
       f - interval '1 minute', f - interval '1 minute', f, f - interval '1 second', f
FROM (SELECT g, now() - interval '30 days' + g * %(step)s * interval '1 second' AS f
      FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g) AS s
"""

FILL_PENDING = """
INSERT INTO {schema}.events (topic, tenant, payload, run_at)
SELECT 'big.' || (g %% 20), 't' || (g %% 50), '{{"n": 2}}',
       now() - interval '1 hour' + g * interval '1 ms'
FROM generate_series(1, %(n)s) AS g
"""

FILL_FUTURE = """
INSERT INTO {schema}.events (topic, tenant, payload, run_at)
SELECT 'big.' || (g %% 20), 't' || (g %% 50), '{{"n": 3}}',
       now() + interval '1 day' + g * interval '1 second'
FROM generate_series(1, %(n)s) AS g
"""


def log(message: str) -> None:
    print(f"[big_table] {message}", file=sys.stderr, flush=True)


def _render(template: str, schema: str) -> str:
    return sql.SQL(template).format(schema=sql.Identifier(schema)).as_string()


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]


def _summary(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(statistics.median(values), 2),
            "p95_ms": round(_percentile(values, 0.95), 2),
            "max_ms": round(max(values), 2), "runs": len(values)}


def check_disk(conn: psycopg.Connection[Any], rows: int) -> dict[str, Any]:
    """Refuse to start when the server's data directory has too little room."""
    need = rows * BYTES_PER_ROW
    try:
        row = conn.execute("SHOW data_directory").fetchone()
    except psycopg.Error:
        conn.rollback()
        row = None
    directory = str(row[0]) if row else ""
    if not directory or not os.path.isdir(directory):
        log(f"data directory not visible from here; needs about {need / 1e9:.1f} GB free")
        return {"need_gb": round(need / 1e9, 1), "free_gb": None}
    free = shutil.disk_usage(directory).free
    if free < 2 * need:
        raise SystemExit(f"big_table: {free / 1e9:.1f} GB free under {directory}, "
                         f"need at least {2 * need / 1e9:.1f} GB")
    return {"need_gb": round(need / 1e9, 1), "free_gb": round(free / 1e9, 1)}


def create_schema(conn: psycopg.Connection[Any], schema: str, marker: str = MARKER,
                  who: str = "big_table") -> None:
    """A migrated scratch schema, marked as ``who``'s; one left by an earlier run is replaced."""
    exists = conn.execute("SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace"
                          " WHERE nspname = %s", (schema,)).fetchone()
    if exists is not None:
        if exists[0] != marker:
            raise SystemExit(f"{who}: schema {schema!r} exists and is not ours; "
                             "pick another with --schema")
        log(f"dropping {schema} left by an earlier run")
        drop_schema(conn, schema)
    Migrator(schema).apply(conn)
    conn.execute(sql.SQL("COMMENT ON SCHEMA {} IS {}").format(
        sql.Identifier(schema), sql.Literal(marker)))


def drop_schema(conn: psycopg.Connection[Any], schema: str) -> None:
    conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def fill(conn: psycopg.Connection[Any], schema: str, finished: int, pending: int,
         future: int) -> dict[str, Any]:
    started = time.monotonic()
    step = 30 * 86400 / max(finished, 1)          # finished_at spread over 30 days
    for first in range(1, finished + 1, CHUNK):
        last = min(finished, first + CHUNK - 1)
        with conn.transaction():
            conn.execute("SET LOCAL conveyor.notify = 'off'")   # the product's opt-out
            conn.execute(_render(FILL_FINISHED, schema),
                         {"first": first, "last": last, "step": step})
        log(f"  {last:,} finished rows ({time.monotonic() - started:.0f} s)")
    with conn.transaction():
        conn.execute(_render(FILL_PENDING, schema), {"n": pending})
        conn.execute(_render(FILL_FUTURE, schema), {"n": future})
    filled = time.monotonic() - started
    started = time.monotonic()
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "events")))
    vacuumed = time.monotonic() - started
    size = conn.execute("SELECT pg_total_relation_size(%s::regclass),"
                        " pg_relation_size(%s::regclass)",
                        (f"{schema}.events_live", f"{schema}.events_live")).fetchone()
    assert size is not None
    return {"fill_s": round(filled, 1), "vacuum_analyze_s": round(vacuumed, 1),
            "total_size_gb": round(size[0] / 1e9, 2), "heap_size_gb": round(size[1] / 1e9, 2)}


def claim_params(schema: str, limit: int, topics: list[str] | None = None) -> dict[str, Any]:
    """The parameters the worker itself builds from its router and config."""
    router = Router()
    for pattern in topics or ["*"]:
        router.add(pattern, lambda event: None)
    claim_filter = Worker("", router, WorkerConfig(schema=schema))._filter
    return {**claim_filter, "limit": limit, "owner": str(uuid.uuid4()),
            "lease_ttl": WorkerConfig().lease_ttl}


@contextmanager
def rolled_back(conn: psycopg.Connection[Any]) -> Iterator[None]:
    with conn.transaction(force_rollback=True):
        yield


def time_claims(conn: psycopg.Connection[Any], q: Queries, params: dict[str, Any],
                runs: int) -> dict[str, Any]:
    walls: list[float] = []
    claimed = 0
    for i in range(runs + 3):                      # 3 warm-up runs, not counted
        with rolled_back(conn):
            t0 = time.perf_counter()
            rows = conn.execute(q["event_claim"], params).fetchall()
            if i >= 3:
                walls.append((time.perf_counter() - t0) * 1000)
            claimed = len(rows)
    return {"claimed": claimed, **_summary(walls)}


def _nodes(plan: Any) -> Iterator[dict[str, Any]]:
    if isinstance(plan, dict):
        if "Node Type" in plan:
            yield plan
        for key in ("Plan", "Plans"):
            if key in plan:
                yield from _nodes(plan[key])
    elif isinstance(plan, list):
        for item in plan:
            yield from _nodes(item)


def explain(conn: psycopg.Connection[Any], query: str, params: dict[str, Any] | None,
            prepare: Callable[[], None] | None = None) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) in a rolled-back transaction, boiled down."""
    with rolled_back(conn):
        if prepare is not None:
            prepare()
        row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query,
                           params).fetchone()
    assert row is not None
    top = row[0][0]
    scans = []
    for node in _nodes(top):
        if node.get("Relation Name") == "events" or str(node.get("Index Name", "")).startswith(
                "events_"):
            if node["Node Type"] == "ModifyTable":
                continue
            scans.append({
                "node": node["Node Type"], "index": node.get("Index Name"),
                "rows": node["Actual Rows"] * node["Actual Loops"],
                "removed_by_filter": node.get("Rows Removed by Filter", 0),
                "heap_fetches": node.get("Heap Fetches")})
    plan = top["Plan"]
    return {"execution_ms": round(top["Execution Time"], 2),
            "buffers": plan["Shared Hit Blocks"] + plan["Shared Read Blocks"],
            "seq_scan_of_events": any(s["node"] == "Seq Scan" for s in scans),
            "scans": scans}


def time_status(url: str, schema: str, runs: int) -> dict[str, Any]:
    admin = Admin(schema)
    walls: list[float] = []
    legacy: list[float] = []
    legacy_sql = _render(LEGACY_STATUS_COUNT, schema)
    with psycopg.connect(url, autocommit=True) as conn:
        for _ in range(runs):
            t0 = time.perf_counter()
            status = admin.status(conn)
            walls.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            conn.execute(legacy_sql).fetchall()
            legacy.append((time.perf_counter() - t0) * 1000)
    return {"admin_status": _summary(walls), "legacy_full_count": _summary(legacy),
            "counts": status.counts, "estimated_states": status.estimated_states}


def failed_index_build(conn: psycopg.Connection[Any], schema: str) -> float:
    """Seconds migration 0002's CREATE INDEX takes on this table (rolled back)."""
    body = next(m for m in load_migrations() if m.version == 2).render(schema)
    index = sql.Identifier(schema, "events_failed_idx")
    with rolled_back(conn):
        conn.execute(sql.SQL("DROP INDEX {}").format(index))
        t0 = time.perf_counter()
        conn.execute(body.encode())
        return round(time.perf_counter() - t0, 2)


def maintenance_plans(conn: psycopg.Connection[Any], q: Queries, schema: str) -> dict[str, Any]:
    def expire_100() -> None:
        conn.execute(q["event_claim"], claim_params(schema, 100)).fetchall()
        conn.execute(sql.SQL("UPDATE {} SET lease_expires_at = now() - interval '1 second'"
                             " WHERE state = 'running'").format(
            sql.Identifier(schema, "events")))

    worker_states = ["succeeded", "cancelled"]     # the worker's prune leaves failed alone
    return {
        "rescue_none_expired": explain(conn, q["event_rescue_expired"],
                                       {"limit": RESCUE_BATCH}),
        "rescue_100_expired": explain(conn, q["event_rescue_expired"],
                                      {"limit": RESCUE_BATCH}, prepare=expire_100),
        "prune_batch_15_days": explain(conn, q["event_prune"], {
            "older_than": 15 * 86400, "states": worker_states, "limit": PRUNE_BATCH}),
        "prune_nothing_older_than_60_days": explain(conn, q["event_prune"], {
            "older_than": 60 * 86400, "states": worker_states, "limit": PRUNE_BATCH}),
        "retry_failed": explain(conn, q["event_retry_failed"], {"topic": None}),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    schema = args.schema
    q = queries_for(schema)
    result: dict[str, Any] = {"finished": args.finished, "pending_due": args.pending,
                              "pending_future": args.future}
    with psycopg.connect(args.url, autocommit=True) as conn:
        server = conn.execute("SHOW server_version").fetchone()
        result["server_version"] = server[0] if server else "?"
        result["disk"] = check_disk(conn, args.finished + args.pending + args.future)
        create_schema(conn, schema)
        try:
            log(f"filling {schema}.events")
            result["fill"] = fill(conn, schema, args.finished, args.pending, args.future)
            # Status first, on the freshly vacuumed table: the rolled-back claims
            # below leave dead row versions that the estimate counts as rows.
            log("status")
            result["status"] = time_status(args.url, schema, args.status_runs)
            estimated = result["status"]["counts"]["succeeded"]
            result["status"]["succeeded_estimate_error_pct"] = round(
                100 * (estimated - args.finished) / max(args.finished, 1), 2)
            log("claims")
            result["claim"] = {
                "1": time_claims(conn, q, claim_params(schema, 1), args.claims),
                "100": time_claims(conn, q, claim_params(schema, 100), args.claims),
                "100_one_topic_of_20": time_claims(
                    conn, q, claim_params(schema, 100, ["big.7"]), args.claims),
            }
            result["claim_plan"] = {
                str(n): explain(conn, q["event_claim"], claim_params(schema, n))
                for n in (1, 100)}
            log("maintenance plans")
            result["maintenance"] = maintenance_plans(conn, q, schema)
            result["migration_0002_index_build_s"] = failed_index_build(conn, schema)
        finally:
            if args.keep:
                log(f"kept schema {schema}")
            else:
                drop_schema(conn, schema)
                log(f"dropped schema {schema}")
    return result


def report(r: dict[str, Any]) -> str:
    lines = [f"R14 big table: {r['finished']:,} succeeded + {r['pending_due']:,} due pending"
             f" + {r['pending_future']:,} future (PostgreSQL {r['server_version']})",
             f"fill {r['fill']['fill_s']} s, VACUUM ANALYZE {r['fill']['vacuum_analyze_s']} s,"
             f" table {r['fill']['total_size_gb']} GB (heap {r['fill']['heap_size_gb']} GB)"]
    for name, c in r["claim"].items():
        lines.append(f"claim {name:>20}: {c['claimed']:>3} rows  p50 {c['p50_ms']:7.2f} ms"
                     f"  p95 {c['p95_ms']:7.2f} ms  max {c['max_ms']:7.2f} ms  ({c['runs']} runs)")
    for n, plan in r["claim_plan"].items():
        walked = [s for s in plan["scans"] if s["index"] == "events_claim_idx"]
        entries = sum(s["rows"] + s["removed_by_filter"] for s in walked)
        lines.append(f"claim {n:>3} plan: {plan['execution_ms']} ms, claim index entries read"
                     f" {entries}, buffers {plan['buffers']},"
                     f" seq scan of events: {plan['seq_scan_of_events']}")
    s = r["status"]
    lines.append(f"Admin.status: p50 {s['admin_status']['p50_ms']} ms"
                 f" p95 {s['admin_status']['p95_ms']} ms; full count(*) baseline p50"
                 f" {s['legacy_full_count']['p50_ms']} ms; counts {s['counts']},"
                 f" estimated {s['estimated_states']}"
                 f" (succeeded off by {s['succeeded_estimate_error_pct']}%)")
    for name, plan in r["maintenance"].items():
        rows = sum(x["rows"] for x in plan["scans"])
        indexes = sorted({x["index"] for x in plan["scans"] if x["index"]})
        lines.append(f"{name}: {plan['execution_ms']} ms, rows read {rows}, buffers"
                     f" {plan['buffers']}, indexes {indexes},"
                     f" seq scan of events: {plan['seq_scan_of_events']}")
    lines.append(f"migration 0002 (CREATE INDEX events_failed_idx) on this table:"
                 f" {r['migration_0002_index_build_s']} s")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("CONVEYOR_DATABASE_URL"))
    parser.add_argument("--schema", default="conveyor_r14")
    parser.add_argument("--finished", type=int, default=10_000_000)
    parser.add_argument("--pending", type=int, default=40_000)
    parser.add_argument("--future", type=int, default=100_000)
    parser.add_argument("--claims", type=int, default=50, help="timed claims per batch size")
    parser.add_argument("--status-runs", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="leave the schema in place")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not args.url:
        parser.error("--url or CONVEYOR_DATABASE_URL is required")
    result = run(args)
    result["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                      capture_output=True, text=True, check=False).stdout.strip()
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
