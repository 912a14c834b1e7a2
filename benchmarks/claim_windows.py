"""Drains with and without claim windows, in turns: events/s and WAL bytes per event.

A whole ``Worker`` (this process, its default settings but ``claim_window``)
drains ``--events`` no-op events filled in one commit before it starts; the
variants alternate for ``--rounds`` rounds on the same database and the
medians are printed as JSON. WAL is the server's position before and after
the drain, divided by the events (other sessions' WAL included: run it on a
quiet server, such as the embedded one).

    PYTHONPATH=src:tools python benchmarks/claim_windows.py --url postgresql://... \
        --windows 0 0.1 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import psycopg

from conveyor import NewEvent, Producer, ProducerConfig
from conveyor.config import WorkerConfig
from conveyor.schema.migrator import Migrator
from conveyor.worker import Worker
from conveyor_tools.bench.app import NOOP_TOPIC, router

SCHEMA = "bench_windows"
FILL_BATCH = 5_000


def _fill(url: str, count: int) -> None:
    producer = Producer(ProducerConfig(schema=SCHEMA))
    with psycopg.connect(url) as conn:
        conn.execute(f"TRUNCATE {SCHEMA}.events")
        for start in range(0, count, FILL_BATCH):
            producer.enqueue_many(conn, [NewEvent(topic=NOOP_TOPIC, payload={"i": i})
                                         for i in range(start, min(count, start + FILL_BATCH))])
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {SCHEMA}.events")
        conn.execute("CHECKPOINT")


async def _drain(url: str, count: int, window: float, retention: float | None) -> dict[str, Any]:
    config = WorkerConfig(schema=SCHEMA, claim_window=window, retention=retention,
                          horizon_alert_after=None)
    worker = Worker(url, router, config)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as watch:
        cur = await watch.execute("SELECT pg_current_wal_lsn()")
        lsn = (await cur.fetchone() or [None])[0]
        started = time.perf_counter()
        task = asyncio.create_task(worker.run())
        while True:
            await asyncio.sleep(0.005)
            cur = await watch.execute(
                f"SELECT count(*) FROM {SCHEMA}.events WHERE state IN ('pending', 'running')")
            if (await cur.fetchone() or [1])[0] == 0:
                break
        seconds = time.perf_counter() - started
        cur = await watch.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (lsn,))
        wal = float((await cur.fetchone() or [0])[0])
        worker.request_stop()
        await task
    return {"events_per_s": count / seconds, "wal_bytes_per_event": wal / count,
            "succeeded": worker.stats.succeeded}


def run(url: str, count: int, windows: list[float], rounds: int,
        retention: float | None) -> dict[str, Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        Migrator(SCHEMA).apply(conn)
    results: dict[float, list[dict[str, Any]]] = {w: [] for w in windows}
    for _ in range(rounds):
        for window in windows:
            _fill(url, count)
            results[window].append(asyncio.run(_drain(url, count, window, retention)))
    return {f"{w:g}": {"events_per_s": statistics.median(r["events_per_s"] for r in runs),
                       "wal_bytes_per_event": statistics.median(r["wal_bytes_per_event"]
                                                                for r in runs),
                       "runs": runs}
            for w, runs in results.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("CONVEYOR_DATABASE_URL"))
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--windows", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--retention", type=float, default=None,
                        help="the workers' retention (0: delete each success)")
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("give --url or set CONVEYOR_DATABASE_URL")
    result = run(args.url, args.events, args.windows, args.rounds, args.retention)
    json.dump({"events": args.events, "rounds": args.rounds, "retention": args.retention,
               "windows": result}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
