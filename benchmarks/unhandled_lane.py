"""How much a backlog that no worker claims slows a handled topic, measured with worker processes.

``--workers`` ``conveyor worker`` processes (``--concurrency`` each, routes
``free.job`` and ``held.job``) drain ``--free`` no-op events of ``free.job``,
``--rounds`` times, in each round:

1. alone (the baseline);
2. behind N due events of ``orphan.job``, a topic no worker handles, for each
   N of ``--unhandled`` (written before, so older and ahead in claim order);
3. behind ``--paused`` due events of ``held.job``, handled but paused; then the
   pause is lifted and they must all run (none stranded).

Before each drain the backlog is left ``--settle`` seconds (the workers set it
aside meanwhile, migration 0018), finished rows are deleted and the table
vacuumed; the drain is timed from the commit of the ``free.job`` events until
none is pending or running. Prints each drain's rate and ratio to the round's
drain alone, the median ratios, the enqueue's WAL per event (least of the
rounds: the WAL position is the whole server's) and the transactions the
database committed per drained event and per idle second; ``--json PATH``
writes them. Target (docs/workers.md): a median ratio of at least 0.9.

    .venv/bin/python benchmarks/unhandled_lane.py --database-url postgresql://root@127.0.0.1:5432/bench
        [--workers 4] [--concurrency 50] [--free 20000] [--unhandled 20000,55000]
        [--paused 55000] [--rounds 3]

Give it a database of its own: the transaction counts are the database's.
The schema ``conveyor_bench_lanes`` is created afresh and dropped at the end.
Also imported by the workers, for ``router``.
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
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from conveyor import Admin, Migrator, NewEvent, Producer, ProducerConfig, Router
from conveyor.types import Event

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "conveyor_bench_lanes"
ADMIN = Admin(SCHEMA)

router = Router()


@router.route("free.job", blocking=False)
def free(event: Event) -> None:
    """Nothing: the handled topic's drain rate is the figure."""


@router.route("held.job", blocking=False)
def held(event: Event) -> None:
    """Nothing: paused while the free topic drains."""


def _sql(text: str) -> sql.Composed:
    return sql.SQL(text).format(s=sql.Identifier(SCHEMA))


def _one(conn: psycopg.Connection[Any], text: str) -> Any:
    row = conn.execute(_sql(text)).fetchone()
    return row[0] if row else None


def _enqueue(url: str, topic: str, n: int) -> int:
    """Writes n events of topic in one transaction; returns the WAL bytes it took."""
    with psycopg.connect(url) as conn:
        before = _one(conn, "SELECT pg_current_wal_insert_lsn()")
        Producer(ProducerConfig(schema=SCHEMA)).enqueue_bulk(
            conn, [NewEvent(topic=topic, payload=i) for i in range(n)])
        conn.commit()
        return int(_one(conn, f"SELECT pg_current_wal_insert_lsn() - '{before}'::pg_lsn"))


def _pending(url: str, topic: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return int(conn.execute(_sql("SELECT count(*) FROM {s}.events WHERE state = 'pending'"
                                     " AND topic = %s"), (topic,)).fetchone()[0])  # type: ignore[index]


def _tidy(url: str, settle: float) -> None:
    """Let the workers settle on the backlog, then start every drain from the same table."""
    time.sleep(settle)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(_sql("DELETE FROM {s}.events WHERE state = 'succeeded'"))
        conn.execute(_sql("VACUUM ANALYZE {s}.events"))


def _commits(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return int(conn.execute("SELECT xact_commit FROM pg_stat_database"
                                " WHERE datname = current_database()").fetchone()[0])  # type: ignore[index]


def _drain(url: str, n: int) -> dict[str, float]:
    """Write n free.job events and time their drain; also says how many events of
    the other topics were still in the open lane (not set aside) at the start."""
    with psycopg.connect(url, autocommit=True) as conn:
        # The lane column of the code under test: limited IS NULL is 0018's aside lane.
        in_way = _one(conn, "SELECT count(*) FROM {s}.events WHERE state = 'pending'"
                            " AND limited IS NOT DISTINCT FROM false AND topic <> 'free.job'")
    commits = _commits(url)
    wal = _enqueue(url, "free.job", n)
    started = time.monotonic()
    left = _sql("SELECT EXISTS (SELECT 1 FROM {s}.events WHERE state = 'pending'"
                " AND topic = 'free.job') OR EXISTS (SELECT 1 FROM {s}.events"
                " WHERE state = 'running' AND topic = 'free.job')")
    with psycopg.connect(url, autocommit=True) as conn:
        while conn.execute(left).fetchone()[0]:  # type: ignore[index]
            if time.monotonic() - started > 600:
                raise SystemExit("free.job did not drain in 10 minutes")
            time.sleep(0.02)
    took = time.monotonic() - started
    return {"per_s": round(n / took), "in_the_way_at_start": in_way,
            "wal_per_event": round(wal / n, 1),
            "commits_per_event": round((_commits(url) - commits) / n, 4)}


def _fleet(args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, "-m", "conveyor.cli.main", "--database-url",
                               args.database_url, "--schema", SCHEMA, "--log-level", "warning",
                               "worker", "--app", "benchmarks.unhandled_lane:router",
                               "--concurrency", str(args.concurrency)], env=env, cwd=ROOT)
             for _ in range(args.workers)]
    with psycopg.connect(args.database_url, autocommit=True) as conn:
        deadline = time.monotonic() + 30
        while _one(conn, "SELECT count(*) FROM {s}.workers") < args.workers:
            if time.monotonic() > deadline:
                raise SystemExit("workers did not register")
            time.sleep(0.1)
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(timeout=60)


def _round(args: argparse.Namespace) -> dict[str, Any]:
    url = args.database_url
    _tidy(url, 0)
    alone = _drain(url, args.free)
    out: dict[str, Any] = {"alone": alone}
    for n in args.unhandled:
        _enqueue(url, "orphan.job", n - _pending(url, "orphan.job"))
        _tidy(url, args.settle)
        out[f"unhandled_{n}"] = {**_drain(url, args.free), "ratio": 0.0}
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(_sql("DELETE FROM {s}.events WHERE topic = 'orphan.job'"))
        ADMIN.pause(conn, "held.job", reason="benchmark")
    _enqueue(url, "held.job", args.paused)
    _tidy(url, args.settle)
    out[f"paused_{args.paused}"] = {**_drain(url, args.free), "ratio": 0.0}
    with psycopg.connect(url, autocommit=True) as conn:
        ADMIN.resume(conn, "held.job")
    started = time.monotonic()
    while _pending(url, "held.job"):
        if time.monotonic() - started > 120:
            raise SystemExit(f"{_pending(url, 'held.job')} held.job events stranded after resume")
        time.sleep(0.1)
    out["resumed_drained_s"] = round(time.monotonic() - started, 2)
    for figures in out.values():
        if isinstance(figures, dict) and "ratio" in figures:
            figures["ratio"] = round(figures["per_s"] / alone["per_s"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="postgresql://root@127.0.0.1:5432/test")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--free", type=int, default=20_000)
    parser.add_argument("--unhandled", type=lambda s: [int(x) for x in s.split(",")],
                        default=[20_000, 55_000])
    parser.add_argument("--paused", type=int, default=55_000)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with psycopg.connect(args.database_url, autocommit=True) as conn:
        conn.execute(_sql("DROP SCHEMA IF EXISTS {s} CASCADE"))
        Migrator(SCHEMA).apply(conn)
    rounds: list[dict[str, Any]] = []
    try:
        procs = _fleet(args)
        time.sleep(2)
        idle_from, idle_at = _commits(args.database_url), time.monotonic()
        time.sleep(10)
        idle = (_commits(args.database_url) - idle_from) / (time.monotonic() - idle_at)
        for _ in range(args.rounds):
            rounds.append(_round(args))
            print(json.dumps(rounds[-1]), flush=True)
        _stop(procs)
    finally:
        with psycopg.connect(args.database_url, autocommit=True) as conn:
            conn.execute(_sql("DROP SCHEMA IF EXISTS {s} CASCADE"))
    keys = [k for k, v in rounds[0].items() if isinstance(v, dict) and "ratio" in v]
    figures = {"workers": args.workers, "concurrency": args.concurrency, "free": args.free,
               "idle_commits_per_s": round(idle, 1), "rounds": rounds,
               "median_ratio": {k: statistics.median(r[k]["ratio"] for r in rounds)
                                for k in keys},
               "alone_per_s_median": statistics.median(r["alone"]["per_s"] for r in rounds),
               "enqueue_wal_per_event_least": min(r["alone"]["wal_per_event"] for r in rounds),
               "commits_per_drained_event_median": statistics.median(
                   r["alone"]["commits_per_event"] for r in rounds)}
    for k, v in figures["median_ratio"].items():
        print(f"{k}: median ratio to the drain alone x{v:.2f}")
    print(f"drain alone {figures['alone_per_s_median']:,.0f}/s; enqueue WAL "
          f"{figures['enqueue_wal_per_event_least']} B/event; "
          f"{figures['commits_per_drained_event_median']} commits per drained event; "
          f"{figures['idle_commits_per_s']} commits/s idle")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
