"""Drains with and without claim windows, in turns: events/s and WAL bytes per event.

A whole ``Worker`` (this process, its default settings but ``claim_window``)
drains ``--events`` no-op events filled in one commit before it starts; the
variants alternate for ``--rounds`` rounds on the same database and the
medians are printed as JSON. WAL is the server's position before and after
the drain, divided by the events (other sessions' WAL included: run it on a
quiet server, such as the embedded one); the server's CPU is every postgres
process's on this machine, the worker's this process's (the drain's watcher
included in both, alike for every variant).

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
TICKS = os.sysconf("SC_CLK_TCK")
FILL_BATCH = 5_000


def _server_cpu() -> float:
    """Seconds of CPU every postgres process on this machine has used (user + system)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        if name.startswith("postgres"):
            fields = rest.split()
            total += int(fields[11]) + int(fields[12])
    return total / TICKS


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
        cpu = _server_cpu(), time.process_time()
        started = time.perf_counter()
        task = asyncio.create_task(worker.run())
        while True:
            await asyncio.sleep(0.005)
            cur = await watch.execute(
                f"SELECT count(*) FROM {SCHEMA}.events WHERE state IN ('pending', 'running')")
            if (await cur.fetchone() or [1])[0] == 0:
                break
        seconds = time.perf_counter() - started
        server_cpu, worker_cpu = _server_cpu() - cpu[0], time.process_time() - cpu[1]
        cur = await watch.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (lsn,))
        wal = float((await cur.fetchone() or [0])[0])
        worker.request_stop()
        await task
    return {"events_per_s": count / seconds, "wal_bytes_per_event": wal / count,
            "server_cpu_us_per_event": server_cpu / count * 1e6,
            "worker_cpu_us_per_event": worker_cpu / count * 1e6,
            "succeeded": worker.stats.succeeded,
            "events_per_claim": worker.stats.claimed / max(1, worker.stats.claims)}


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
    figures = ("events_per_s", "wal_bytes_per_event", "server_cpu_us_per_event",
               "worker_cpu_us_per_event")
    return {f"{w:g}": {**{f: statistics.median(r[f] for r in runs) for f in figures},
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
