"""Flat under growth: the queue's figures at 0, 10 and 50 million finished rows.

Issue 24's second item. In a scratch schema migrated by Conveyor's own
migrator, with a due backlog of other topics that the measured worker does
not serve (as a real queue has), the history of finished events grows in
steps, each written with COPY in 100,000-row transactions (finished times
spread over the last 30 days, 20 topics, 50 tenants, 1 % failed; the
successes in the history's day partitions, as acknowledgements put them
since migration 0025, the failed events live, 100 of them there from the
start, so every size's failed page shows a full page), then VACUUM ANALYZE.
At each size the same measurements run:

* ``claim_ms``: the worker's own ``event_claim`` of 100, rolled back so every
  run sees the same table, ``--claims`` times: p50, p95, p99;
* ``enqueue_bulk_per_s``: ``Producer.enqueue_many`` of ``--events`` events,
  1,000 a transaction;
* ``enqueue_one_per_s``: ``Producer.enqueue`` and COMMIT, one at a time;
* ``drain_per_s``: a real ``conveyor worker`` at defaults draining the bulk
  events (no-op handler), commit to the last acknowledgement;
* ``pages_ms``: the dashboard's overview, event list, failed list, one topic,
  one tenant and one event's page, in-process, p50 and p95.

The report gives each figure at each size and as a ratio to the empty table
(the issue's bar: within 10 %). Timings on a shared machine move between
runs; run it on a quiet one.

    .venv/bin/python benchmarks/scale.py --url postgresql://... [--sizes 0,10M,50M] [--json]

About 0.35 GB of disk per million rows; the schema is dropped at the end
(``--keep`` leaves it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
from big_table import FILL_PENDING, _render, check_disk, claim_params, create_schema, rolled_back
from psycopg import sql

from conveyor import NewEvent, Producer
from conveyor.config import ProducerConfig
from conveyor.dashboard import DashboardConfig, allow_all, dashboard_app
from conveyor.db.named_queries import queries_for

REPO = Path(__file__).resolve().parents[1]
MARKER = "conveyor benchmarks/scale.py scratch schema"
CHUNK = 100_000
TOPICS = 20
TENANTS = 50
APP = "conveyor_tools.bench.app:router"
NOOP = "bench.noop"


# Two pages of failed events from the start, as the backlog is there from the
# start: without them the failed page at 0 rows showed no event, and its
# time was held against pages of 50 (1.55x at 50 M on 2026-12-05, most of it
# the rows' rendering: docs/benchmarks.md).
FILL_FAILED = """
INSERT INTO {schema}.events (topic, tenant, payload, state, attempts, finished_at, last_error)
SELECT 'big.' || (g %% 20), 't' || (g %% 50), '{{"n": 4}}', 'failed', 1,
       now() - interval '31 days', 'boom'
FROM generate_series(1, %(n)s) AS g
"""


def log(message: str) -> None:
    print(f"[scale] {message}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, mult in (("M", 1_000_000), ("K", 1_000)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * mult)
    return int(text)


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))], 2)

    return {"p50": round(statistics.median(ordered), 2), "p95": at(0.95), "p99": at(0.99)}


def grow_history(conn: psycopg.Connection[Any], schema: str, have: int, want: int) -> float:
    """COPY finished rows until the history holds ``want``; seconds taken."""
    started = time.monotonic()
    now = datetime.now(UTC)
    span = timedelta(days=30).total_seconds()
    columns = ("topic, tenant, payload, state, attempts, run_at, created_at, updated_at, "
               "attempted_at, finished_at, last_error, done")
    statement = sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(schema, "events"), sql.SQL(columns))
    # Where a worker's acknowledgements put them (0025): the successes in the
    # history's day partitions, the failed events live.
    first = (now - timedelta(seconds=span)).date()
    for day in (first + timedelta(days=d) for d in range((now.date() - first).days + 2)):
        conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} PARTITION OF {}"
                             " FOR VALUES FROM ({}) TO ({})").format(
            sql.Identifier(schema, f"events_done_{day:%Y%m%d}"),
            sql.Identifier(schema, "events_done"),
            sql.Literal(f"{day} 00:00+00"), sql.Literal(f"{day + timedelta(days=1)} 00:00+00")))
    while have < want:
        rows = min(CHUNK, want - have)
        with conn.transaction(), conn.cursor() as cur, cur.copy(statement) as copy:
            lines = []
            for n in range(have, have + rows):
                finished = now - timedelta(seconds=span * (1 - n / max(want, 1)))
                at = finished.isoformat()
                failed = n % 100 == 0
                lines.append(f"big.{n % TOPICS}\tt{n % TENANTS}\t{{\"n\": {n}}}\t"
                             f"{'failed' if failed else 'succeeded'}\t1\t{at}\t{at}\t{at}\t{at}\t"
                             f"{at}\t{'boom' if failed else chr(92) + 'N'}\t"
                             f"{chr(92) + 'N' if failed else 't'}\n")
                if len(lines) == 10_000:
                    copy.write("".join(lines))
                    lines.clear()
            copy.write("".join(lines))
        have += rows
        if have % 1_000_000 == 0 or have == want:
            log(f"  {have:,} finished rows ({time.monotonic() - started:.0f} s)")
    return time.monotonic() - started


def time_claims(conn: psycopg.Connection[Any], schema: str, runs: int) -> dict[str, float]:
    q = queries_for(schema)
    params = claim_params(schema, 100)
    walls = []
    for i in range(runs + 5):                      # 5 warm-up runs, not counted
        with rolled_back(conn):
            t0 = time.perf_counter()
            conn.execute(q["event_claim"], params).fetchall()
            if i >= 5:
                walls.append((time.perf_counter() - t0) * 1000)
    return percentiles(walls)


def enqueue_rates(url: str, schema: str, events: int) -> dict[str, float]:
    producer = Producer(ProducerConfig(schema=schema))
    with psycopg.connect(url) as conn:
        row = conn.execute(sql.SQL("SELECT coalesce(max(id), 0) FROM {}").format(
            sql.Identifier(schema, "events"))).fetchone()
        conn.commit()
        t0 = time.perf_counter()
        for first in range(0, events, 1000):
            producer.enqueue_many(conn, [NewEvent(topic=NOOP, payload={"n": i})
                                         for i in range(first, min(events, first + 1000))])
            conn.commit()
        bulk = events / (time.perf_counter() - t0)
        singles = max(events // 10, 100)
        t0 = time.perf_counter()
        for i in range(singles):
            producer.enqueue(conn, NOOP, {"n": i})
            conn.commit()
        one = singles / (time.perf_counter() - t0)
    return {"enqueue_bulk_per_s": round(bulk), "enqueue_one_per_s": round(one),
            "queued": events + singles, "after_id": row[0] if row else 0}


def drain_rate(url: str, schema: str, queued: int, after_id: int) -> float:
    """A worker at defaults drains the no-op events the enqueue left (ids past ``after_id``);
    events per second from the first claim to the last acknowledgement, in the database's
    clock, so the worker's start-up is not counted."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tools")])}
    events = sql.Identifier(schema, "events")
    count = sql.SQL("SELECT count(*) FROM {} WHERE id > %s AND state IN ('pending', 'running')"
                    ).format(events)
    span = sql.SQL("SELECT count(*), extract(epoch FROM max(finished_at) - min(attempted_at)) "
                   "FROM {} WHERE id > %s").format(events)
    worker = subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli.main", "--database-url", url, "--schema", schema,
         "worker", "--app", APP, "--retention", "forever"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            deadline = time.monotonic() + 600
            while True:
                row = conn.execute(count, (after_id,)).fetchone()
                left = row[0] if row else 0
                if not left:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{left} of {queued} events still queued after 600 s")
                time.sleep(0.05)
            row = conn.execute(span, (after_id,)).fetchone()
            if not row or row[0] != queued or not row[1]:
                raise RuntimeError(f"expected {queued} drained events, found {row}")
            return queued / float(row[1])
    finally:
        worker.terminate()
        worker.wait(timeout=30)


async def time_pages(url: str, schema: str, requests: int) -> dict[str, dict[str, float]]:
    with psycopg.connect(url) as conn:
        row = conn.execute(sql.SQL("SELECT max(id) FROM {} WHERE state = 'succeeded'").format(
            sql.Identifier(schema, "events"))).fetchone()
    pages = {"overview": "/", "events": "/events", "failed": "/events?state=failed",
             "topic": "/events?topic=big.7", "tenant": "/events?tenant=t7",
             "event": f"/events/{row[0] if row and row[0] else 1}"}
    app = dashboard_app(url, DashboardConfig(schema=schema), authorize=allow_all)
    walls: dict[str, list[float]] = {name: [] for name in pages}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://dashboard") as client:
        for round_ in range(requests + 2):
            for name, path in pages.items():
                t0 = time.perf_counter()
                response = await client.get(path)
                if response.status_code != 200:
                    raise RuntimeError(f"{path} answered {response.status_code}")
                if round_ >= 2:
                    walls[name].append((time.perf_counter() - t0) * 1000)
    return {name: percentiles(values) for name, values in walls.items()}


def measure(url: str, schema: str, args: argparse.Namespace) -> dict[str, Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "events")))
        # Every partition's (0025): the parent has no storage of its own.
        size = conn.execute("SELECT sum(pg_total_relation_size(relid))::bigint"
                            " FROM pg_partition_tree(%s::regclass)",
                            (f"{schema}.events",)).fetchone()
        claims = time_claims(conn, schema, args.claims)
    rates = enqueue_rates(url, schema, args.events)
    drain = drain_rate(url, schema, rates.pop("queued"), rates.pop("after_id"))
    pages = asyncio.run(time_pages(url, schema, args.requests))
    return {"table_gb": round(size[0] / 1e9, 2) if size else None, "claim_ms": claims, **rates,
            "drain_per_s": round(drain), "pages_ms": pages}


def ratios(base: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """Each figure against the empty table's: above 1 is slower for times, faster for rates."""
    out = {"claim_p99": other["claim_ms"]["p99"] / base["claim_ms"]["p99"]}
    for key in ("enqueue_bulk_per_s", "enqueue_one_per_s", "drain_per_s"):
        out[key] = other[key] / base[key]
    for page, figures in other["pages_ms"].items():
        out[f"page_{page}_p95"] = figures["p95"] / base["pages_ms"][page]["p95"]
    return {k: round(v, 3) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=os.environ.get("CONVEYOR_DATABASE_URL"), required=False)
    p.add_argument("--schema", default="conveyor_scale")
    p.add_argument("--sizes", default="0,10M,50M", help="finished rows at each step (default 0,10M,50M)")
    p.add_argument("--pending", type=int, default=40_000,
                   help="due events of topics the worker does not serve (default 40,000)")
    p.add_argument("--events", type=int, default=20_000, help="events enqueued and drained per step")
    p.add_argument("--claims", type=int, default=200, help="timed claims per step (default 200)")
    p.add_argument("--requests", type=int, default=20, help="rounds of dashboard pages per step")
    p.add_argument("--keep", action="store_true", help="leave the schema in place")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if not args.url:
        p.error("give --url or set CONVEYOR_DATABASE_URL")
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"expected --sizes like 0,10M,50M, got {args.sizes!r}")
    if sizes != sorted(sizes):
        p.error(f"expected --sizes in increasing order, got {args.sizes!r}")
    report: dict[str, Any] = {"sizes": {}, "config": {k: v for k, v in vars(args).items()
                                                      if k not in ("url", "json")}}
    with psycopg.connect(args.url, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        report["server_version"] = version[0] if version else None
        report["disk"] = check_disk(conn, sizes[-1])
        create_schema(conn, args.schema, MARKER, "scale")
        with conn.transaction():
            conn.execute(_render(FILL_PENDING, args.schema), {"n": args.pending})
            conn.execute(_render(FILL_FAILED, args.schema), {"n": 100})
    have = 0
    try:
        for size in sizes:
            with psycopg.connect(args.url, autocommit=True) as conn:
                conn.execute("SET conveyor.notify = 'off'")   # the product's opt-out
                built = grow_history(conn, args.schema, have, size)
            have = size
            if size == sizes[0]:
                # The first measurement ran cold (2026-12-03: the empty table's drain
                # at 0.39 of the same drain at 10 M rows): one round is thrown away.
                log(f"warming up at {size:,} finished rows")
                measure(args.url, args.schema, args)
            log(f"measuring at {size:,} finished rows")
            figures = measure(args.url, args.schema, args)
            figures["build_s"] = round(built, 1)
            report["sizes"][str(size)] = figures
            if sizes[0] != size:
                figures["vs_first"] = ratios(report["sizes"][str(sizes[0])], figures)
            log(f"  {json.dumps({k: v for k, v in figures.items() if k != 'pages_ms'})}")
    finally:
        if not args.keep:
            with psycopg.connect(args.url, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(args.schema)))
    print(json.dumps(report, indent=1) if args.json else json.dumps(report["sizes"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
