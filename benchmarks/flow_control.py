"""How much a saturated flow limit slows an unlimited topic, measured with worker processes.

``--workers`` ``conveyor worker`` processes (``--concurrency`` each) drain
``--free`` no-op events of an unlimited topic, ``--rounds`` times in turn:

1. alone (the baseline: the same workers, the limits declared, nothing limited pending);
2. behind a backlog of ``--limited`` events of a topic limited to ``--limit``
   running (10 ms each), written just before the unlimited ones, so older and
   ahead of them in claim order, and saturating the limit through the drain.

Each drain is timed from the moment the unlimited topic is resumed (it is
paused while the backlogs are written) until none of its events is left.
Prints each round's rates and ratio, the median ratio, the limited topic's
running count sampled through the drain (it must stay at the limit: saturated)
and how many limited events were still in the open lane when the clock
started; ``--json PATH`` writes them. The target (docs/flow-control.md) is a
median ratio of at least 0.9.

    .venv/bin/python benchmarks/flow_control.py --database-url postgresql://root@127.0.0.1:5432/test
        [--workers 4] [--concurrency 50] [--free 20000] [--limited 3000] [--limit 5] [--rounds 3]

``--claims`` times the flow claims instead, with no worker: one tenant's
backlog of 1,000, 10,000 and 100,000 events in the limited lane beside 50
other tenants' single events, and the median time of a fair claim
(``fair_by="tenant"``) and of a per-key claim (``fifo_by="tenant"``) taking
1 and 4 events, each in a transaction rolled back. The fair claim's cost must
follow the tenants, not the backlog (docs/flow-control.md).

    .venv/bin/python benchmarks/flow_control.py --claims [--json PATH]

The schema ``conveyor_bench_flow`` is created afresh and dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

from conveyor import Admin, Migrator, NewEvent, Producer, ProducerConfig
from conveyor.db.named_queries import queries_for
from conveyor.router import pattern_filter

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "conveyor_bench_flow"
ADMIN = Admin(SCHEMA)


def _count(conn: psycopg.Connection, where: str) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}.events WHERE " + where).format(
        sql.Identifier(SCHEMA))).fetchone()
    return int(row[0]) if row else 0


def _pause_free(url: str) -> None:
    # Paused while the backlogs are written, so the clock starts with all of them in place.
    with psycopg.connect(url, autocommit=True) as conn:
        ADMIN.pause(conn, "free.job", reason="benchmark: writing the backlogs")
    time.sleep(1.5)         # every worker has heard of it (NOTIFY, or the poll)


def _enqueue(url: str, topic: str, n: int) -> None:
    with psycopg.connect(url) as conn:
        Producer(ProducerConfig(schema=SCHEMA)).enqueue_bulk(
            conn, [NewEvent(topic=topic, payload=i) for i in range(n)])


def _drain(url: str, total: int) -> tuple[float, list[int]]:
    """Resume the unlimited topic (paused while the backlogs were written) and time its
    drain; returns the rate and the limited topic's running counts sampled meanwhile."""
    with psycopg.connect(url, autocommit=True) as conn:
        ADMIN.resume(conn, "free.job")
    started = time.monotonic()
    running: list[int] = []
    with psycopg.connect(url, autocommit=True) as conn:
        while _count(conn, "topic = 'free.job' AND state <> 'succeeded'"):
            if time.monotonic() - started > 600:
                raise SystemExit("free.job did not drain in 10 minutes")
            running.append(_count(conn, "topic = 'limited.job' AND state = 'running'"))
            time.sleep(0.02)
    return total / (time.monotonic() - started), running


def _fleet(args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["CONVEYOR_BENCH_FLOW_LIMIT"] = str(args.limit)
    procs = [subprocess.Popen([sys.executable, "-m", "conveyor.cli.main", "--database-url",
                               args.database_url, "--schema", SCHEMA, "--log-level", "warning",
                               "worker", "--app", "benchmarks.flow_apps:router",
                               "--concurrency", str(args.concurrency)], env=env, cwd=ROOT)
             for _ in range(args.workers)]
    with psycopg.connect(args.database_url, autocommit=True) as conn:
        deadline = time.monotonic() + 30
        while conn.execute(sql.SQL("SELECT count(*) FROM {}.workers").format(
                sql.Identifier(SCHEMA))).fetchone()[0] < args.workers:  # type: ignore[index]
            if time.monotonic() > deadline:
                raise SystemExit("workers did not register")
            time.sleep(0.1)
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(timeout=60)


CLAIM_BACKLOGS = (1_000, 10_000, 100_000)
CLAIM_TENANTS = 50
CLAIM_REPEATS = 25


def _claim_ms(conn: psycopg.Connection, query: str, params: dict[str, object]) -> float:
    """The median time of one claim, each in a transaction rolled back (the backlog stays)."""
    times = []
    for _ in range(CLAIM_REPEATS):
        started = time.perf_counter()
        conn.execute(query, params).fetchall()
        times.append(time.perf_counter() - started)
        conn.rollback()
    return round(statistics.median(times) * 1000, 2)


def claims(url: str) -> dict[str, object]:
    """Time the fair and the per-key claim behind one tenant's growing backlog."""
    q = queries_for(SCHEMA)
    figures: list[dict[str, object]] = []
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(sql.SQL("INSERT INTO {}.flow_limits (pattern, fair_by, fifo_by) VALUES "
                              "('fair.job', 'tenant', NULL), ('fifo.job', NULL, 'tenant')")
                      .format(sql.Identifier(SCHEMA)))
    written = 0
    for backlog in CLAIM_BACKLOGS:
        for topic in ("fair.job", "fifo.job"):
            with psycopg.connect(url) as conn:
                producer = Producer(ProducerConfig(schema=SCHEMA))
                producer.enqueue_bulk(conn, [NewEvent(topic=topic, payload=i, tenant="big")
                                             for i in range(backlog - written)])
                if not written:
                    producer.enqueue_bulk(conn, [NewEvent(topic=topic, payload=i, tenant=f"t{i:02}")
                                                 for i in range(CLAIM_TENANTS)])
        written = backlog
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(sql.SQL("UPDATE {}.events SET limited = true WHERE NOT limited")
                          .format(sql.Identifier(SCHEMA)))
            admin.execute(sql.SQL("VACUUM ANALYZE {}.events").format(sql.Identifier(SCHEMA)))
        row: dict[str, object] = {"backlog": backlog, "tenants": CLAIM_TENANTS + 1}
        with psycopg.connect(url) as conn:
            for limit in (1, 4):
                base = {"all_topics": True, "topics": [], "prefixes": [], "all_tenants": True,
                        "tenants": [], "owner": str(uuid.uuid4()), "lease_ttl": 30, "limit": limit}
                row[f"fair_{limit}_ms"] = _claim_ms(conn, q["flow_claim_fair"], {
                    **base, **pattern_filter(["fair.job"], prefix="limit_"), "pattern": "fair.job"})
                row[f"fifo_{limit}_ms"] = _claim_ms(conn, q["flow_claim_fifo"], {
                    **base, **pattern_filter(["fifo.job"], prefix="limit_"), "pattern": "fifo.job",
                    "fifo_tenant": True, "fifo_path": []})
        figures.append(row)
        print(f"backlog {backlog:>7,} + {CLAIM_TENANTS} tenants: fair claim of 1 / 4 "
              f"{row['fair_1_ms']} / {row['fair_4_ms']} ms, per-key claim of 1 / 4 "
              f"{row['fifo_1_ms']} / {row['fifo_4_ms']} ms")
    return {"claims": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="postgresql://root@127.0.0.1:5432/test")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--free", type=int, default=20_000)
    parser.add_argument("--limited", type=int, default=3000)
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--claims", action="store_true",
                        help="time the fair and per-key claims behind a growing backlog instead")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with psycopg.connect(args.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        Migrator(SCHEMA).apply(conn)
    if args.claims:
        try:
            result = claims(args.database_url)
        finally:
            with psycopg.connect(args.database_url, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(SCHEMA)))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return
    rounds: list[dict[str, float]] = []
    try:
        procs = _fleet(args)
        for _ in range(args.rounds):
            _pause_free(args.database_url)
            _enqueue(args.database_url, "free.job", args.free)
            alone, _ = _drain(args.database_url, args.free)
            _pause_free(args.database_url)
            with psycopg.connect(args.database_url, autocommit=True) as conn:
                pending = _count(conn, "topic = 'limited.job' AND state = 'pending'")
            _enqueue(args.database_url, "limited.job", max(0, args.limited - pending))
            _enqueue(args.database_url, "free.job", args.free)
            with psycopg.connect(args.database_url, autocommit=True) as conn:
                unsorted = _count(conn, "topic = 'limited.job' AND state = 'pending'"
                                        " AND NOT limited")
            behind, running = _drain(args.database_url, args.free)
            rounds.append({"alone_per_s": round(alone), "behind_per_s": round(behind),
                           "ratio": round(behind / alone, 3),
                           "limited_running_mean": round(statistics.mean(running), 2),
                           "limited_running_max": max(running),
                           "limited_unsorted_at_start": unsorted})
            r = rounds[-1]
            print(f"unlimited drain: alone {alone:,.0f}/s; behind a saturated limit of "
                  f"{args.limit} {behind:,.0f}/s (x{r['ratio']:.2f}); limited running "
                  f"{r['limited_running_mean']} on average, {r['limited_running_max']} at most; "
                  f"{unsorted:,} limited events still in the open lane at the start")
        _stop(procs)
    finally:
        with psycopg.connect(args.database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
    figures = {"workers": args.workers, "concurrency": args.concurrency, "free": args.free,
               "limited": args.limited, "limit": args.limit, "rounds": rounds,
               "median_ratio": statistics.median(r["ratio"] for r in rounds)}
    print(f"median ratio x{figures['median_ratio']:.2f} over {len(rounds)} rounds")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
