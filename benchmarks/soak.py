"""Soak: an hour of steady load with retention on, sampled every minute (issue 24, item 3).

On a private embedded PostgreSQL (its own data directory, autovacuum and every
other setting at the server's defaults) it

1. measures the **maximum**: ``--workers`` real ``conveyor worker`` processes
   (no-op handler, defaults) drain while a feeder keeps a backlog in front of
   them, enqueueing with ``Producer.enqueue_many`` as fast as they take it;
   the rate of acknowledgements over ``--max-seconds`` is the maximum the
   machine sustains with producer and workers both running;
2. **soaks** at ``--fraction`` of it (0.7 by default) for ``--minutes``: a
   feeder on a fixed schedule (event n due at start + n / rate), the workers
   with ``--retention`` (the pruner deletes what aged out every 10 minutes),
   and every ``--sample`` seconds one row: events done and their rate, the
   p50/p99 from due to claim (``attempted_at - greatest(created_at, run_at)``
   of the events finished in the minute), the backlog, the table's heap,
   index and total size, live and dead tuples, autovacuum passes, WAL
   written, and the machine's load (so a run that shared the machine says so);
3. reports whether it stayed **flat**: each figure of the last quarter
   against the quarter after the first retention pass, and writes the series
   as JSON and, with ``--plot``, a picture (matplotlib, the ``bench`` extra).

    .venv/bin/python benchmarks/soak.py --minutes 60 --json-out r.json --plot soak.svg

A shorter run (``--minutes 5 --retention 1m``) shows the shape; retention
needs at least two prune passes inside the run to say anything. The history
(0025) is dropped a partition at a time: with a day's partitions (the
default) an hour's soak drops none; ``--history-span 10m`` shows the drops.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from chaos import PrivateServer, RateFeeder, parse_seconds, source_version, start_worker
from conveyor import NewEvent, Producer

REPO = Path(__file__).resolve().parents[1]
APP = "conveyor_tools.bench.app:router"
TOPIC = "bench.noop"
RUNNER_APP = "soak-runner"

# One row a sample; the events finished since the last sample. Read by id, above
# the highest finished id the last sample saw: since 0025 the finished rows are
# in the history's day partitions, which no index holds by finished_at, and a
# read by finish time scanned the whole day so far, every minute. An event
# with a lower id that finished since (at most the workers' slots, near the
# boundary) is left out: the queue is read in id order.
SAMPLE_SQL = """
WITH finished AS (
  SELECT id, attempted_at - greatest(created_at, run_at) AS wait
  FROM conveyor.events
  WHERE id > %(after_id)s AND state IN ('succeeded', 'cancelled')
)
SELECT
  (SELECT count(*) FROM finished) AS done,
  (SELECT coalesce(max(id), %(after_id)s) FROM finished) AS last_id,
  (SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (
            ORDER BY extract(epoch FROM wait))
     FROM finished) AS wait_s,
  (SELECT count(*) FROM conveyor.events WHERE state = 'pending') AS pending,
  -- Every partition's (0025): the parent has no storage of its own.
  (SELECT sum(pg_table_size(t.relid)) FROM pg_partition_tree('conveyor.events') AS t)
    AS heap_bytes,
  (SELECT sum(pg_indexes_size(t.relid)) FROM pg_partition_tree('conveyor.events') AS t)
    AS index_bytes,
  (SELECT sum(pg_total_relation_size(t.relid)) FROM pg_partition_tree('conveyor.events') AS t)
    AS total_bytes,
  -- The live partition alone (pending, running, failed: what claims read),
  -- and how many partitions the history has (0026: `--history-span`).
  pg_total_relation_size('conveyor.events_live') AS live_bytes,
  (SELECT count(*) FROM conveyor.history_parts()) AS partitions,
  s.n_live_tup, s.n_dead_tup, s.autovacuum_count, s.autoanalyze_count,
  pg_current_wal_lsn() AS lsn, now() AS at
FROM pg_stat_user_tables s
WHERE s.schemaname = 'conveyor' AND s.relname = 'events_live'
"""

# The columns of the report's rows, in order.
COLUMNS = ["t_min", "done", "per_s", "wait_p50_ms", "wait_p99_ms", "pending", "heap_mb",
           "index_mb", "total_mb", "live_mb", "partitions", "live_tuples", "dead_tuples", "autovacuums",
           "autoanalyzes", "wal_mb", "query_ms", "fed", "feeder_lag_s", "load1"]


def log(msg: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


class Workers:
    """``conveyor worker`` processes on the bench app (no-op handler)."""

    def __init__(self, url: str, count: int, retention: str, logdir: Path) -> None:
        self.url, self.count, self.retention, self.logdir = url, count, retention, logdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, label: str) -> None:
        for n in range(self.count):
            self.procs.append(start_worker(
                self.url, ["--app", APP, "--retention", self.retention,
                           "--name", f"soak-{label}-{n}"], self.logdir / f"{label}-{n}.log"))

    def stop(self) -> list[int]:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=30))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        self.procs = []
        return codes

    def died(self) -> list[int]:
        return [p.returncode for p in self.procs if p.poll() is not None]


class BacklogFeeder(threading.Thread):
    """Keeps ``low``..``high`` events pending: as fast as the workers take them."""

    def __init__(self, url: str, low: int, high: int) -> None:
        super().__init__(daemon=True, name="soak-backlog")
        self.url, self.low, self.high = url, low, high
        self.enqueued = 0
        self.stop = threading.Event()

    def run(self) -> None:
        producer = Producer()
        with psycopg.connect(self.url, application_name=RUNNER_APP) as conn:
            while not self.stop.is_set():
                pending = conn.execute(
                    b"SELECT count(*) FROM conveyor.events WHERE state = 'pending'").fetchone()
                conn.commit()
                missing = self.high - (pending[0] if pending else 0)
                if missing < self.high - self.low:
                    self.stop.wait(0.05)
                    continue
                for start in range(0, missing, 1000):
                    n = min(1000, missing - start)
                    producer.enqueue_many(conn, [NewEvent(topic=TOPIC, payload={})
                                                 for _ in range(n)])
                    conn.commit()
                    self.enqueued += n


def finished(conn: psycopg.Connection[Any]) -> int:
    """Events acknowledged so far (retention keeps them all while measuring the maximum)."""
    row = conn.execute(b"SELECT count(*) FROM conveyor.events WHERE state = 'succeeded'"
                       ).fetchone()
    conn.commit()
    return int(row[0]) if row else 0


def measure_max(url: str, args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """Acknowledgements per second with a feeder keeping the workers busy."""
    workers = Workers(url, args.workers, "forever", logdir)
    feeder = BacklogFeeder(url, low=5 * args.batch, high=20 * args.batch)
    feeder.start()
    workers.start("max")
    try:
        with psycopg.connect(url, application_name=RUNNER_APP) as conn:
            time.sleep(args.warmup)     # the workers start and reach their pace
            a, ta = finished(conn), time.monotonic()
            time.sleep(args.max_seconds)
            b, tb = finished(conn), time.monotonic()
    finally:
        feeder.stop.set()
        feeder.join(timeout=30)
        codes = workers.stop()
    rate = (b - a) / (tb - ta)
    log(f"maximum: {rate:,.0f} events/s over {tb - ta:.0f}s (workers exited {codes})")
    with psycopg.connect(url, autocommit=True, application_name=RUNNER_APP) as conn:
        # The soak starts on an empty table: its sizes are the soak's own.
        conn.execute(b"TRUNCATE conveyor.events")
        conn.execute(b"VACUUM ANALYZE conveyor.events")
    return {"per_s": round(rate, 1), "seconds": round(tb - ta, 1), "exit_codes": codes}


def sample(conn: psycopg.Connection[Any], after_id: int) -> dict[str, Any]:
    t = time.monotonic()
    cur = conn.execute(SAMPLE_SQL.encode(), {"after_id": after_id})
    names = [d.name for d in cur.description or ()]
    # sum() of sizes is numeric: a float here, so the JSON holds numbers.
    row = {name: float(v) if isinstance(v, Decimal) else v
           for name, v in zip(names, cur.fetchone() or (), strict=True)}
    conn.commit()
    row["query_ms"] = round((time.monotonic() - t) * 1000, 1)
    return row


def lsn_bytes(lsn: str) -> int:
    hi, lo = lsn.split("/")
    return (int(hi, 16) << 32) + int(lo, 16)


def soak(url: str, args: argparse.Namespace, rate: float, logdir: Path) -> list[list[Any]]:
    workers = Workers(url, args.workers, args.retention_text, logdir)
    workers.start("soak")
    feeder = RateFeeder(url, rate, 0.1, {}, topic=TOPIC)
    rows: list[list[Any]] = []
    with psycopg.connect(url, application_name=RUNNER_APP) as conn:
        taken = time.monotonic()
        first = sample(conn, 0)
        last_id, lsn0, t0 = first["last_id"], lsn_bytes(first["lsn"]), time.monotonic()
        feeder.start()
        end = t0 + args.minutes * 60
        next_at = t0 + args.sample
        try:
            while time.monotonic() < end:
                time.sleep(max(0.0, next_at - time.monotonic()))
                next_at += args.sample
                # The window runs from one sample's now() to the next; its length is
                # taken on the monotonic clock at the same moments, as the database's
                # now() is the wall clock, which a VM may step (seen: 42 s in a minute).
                began = time.monotonic()
                s = sample(conn, last_id)
                elapsed, taken = (began - taken) or 1.0, began
                wait = s["wait_s"] or [None, None]
                lsn = lsn_bytes(s["lsn"])
                lag = (time.monotonic() - t0) - feeder.enqueued / rate
                rows.append([
                    round((time.monotonic() - t0) / 60, 2), s["done"],
                    round(s["done"] / elapsed, 1),
                    round(wait[0] * 1000, 1) if wait[0] is not None else None,
                    round(wait[1] * 1000, 1) if wait[1] is not None else None,
                    s["pending"], round(s["heap_bytes"] / 2**20, 1),
                    round(s["index_bytes"] / 2**20, 1), round(s["total_bytes"] / 2**20, 1),
                    round(s["live_bytes"] / 2**20, 1), s["partitions"],
                    s["n_live_tup"], s["n_dead_tup"], s["autovacuum_count"],
                    s["autoanalyze_count"], round((lsn - lsn0) / 2**20, 1), s["query_ms"],
                    feeder.enqueued, round(max(0.0, lag), 2),
                    # the machine's 1-minute load: whatever else ran shows here
                    round(os.getloadavg()[0], 2)])
                last_id, lsn0 = s["last_id"], lsn
                log(" ".join(f"{c}={v}" for c, v in zip(COLUMNS, rows[-1], strict=True)))
                if workers.died():
                    raise RuntimeError(f"a worker exited during the soak: {workers.died()}")
        finally:
            feeder.stop.set()
            feeder.join(timeout=30)
            codes = workers.stop()
            log(f"workers exited {codes}")
    return rows


def flatness(rows: list[list[Any]], retention_min: float, span_min: float = 0.0
             ) -> dict[str, Any]:
    """Each figure's mean over the run's last quarter against the quarter after warm-up.

    Warm-up ends once the table has reached its steady size: the retention, plus
    the history's span (a partition is dropped once its end is past the
    retention), plus a prune interval (10 minutes) for the first pass to have run.
    """
    col = {c: i for i, c in enumerate(COLUMNS)}
    steady = [r for r in rows if r[col["t_min"]] > retention_min + span_min + 10.0]
    if len(steady) < 8:
        return {"note": "too short: fewer than 8 samples after the first retention pass"}
    q = len(steady) // 4
    early, late = steady[:q], steady[-q:]
    out: dict[str, Any] = {"from_min": steady[0][col["t_min"]], "samples": len(steady)}
    for name in ("per_s", "wait_p99_ms", "total_mb", "index_mb", "live_mb", "dead_tuples",
                 "wal_mb"):
        a = [r[col[name]] for r in early if r[col[name]] is not None]
        b = [r[col[name]] for r in late if r[col[name]] is not None]
        if a and b and sum(a):
            out[name] = {"early": round(sum(a) / len(a), 1), "late": round(sum(b) / len(b), 1),
                         "late_over_early": round((sum(b) / len(b)) / (sum(a) / len(a)), 3)}
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    col = {c: i for i, c in enumerate(COLUMNS)}
    rows = result["rows"]
    t = [r[col["t_min"]] for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    ax = axes[0]
    ax.plot(t, [r[col["per_s"]] for r in rows], label="done/s")
    ax.axhline(result["rate"], color="grey", linestyle="--", linewidth=0.8, label="fed/s")
    ax.set_ylabel("events/s")
    ax.legend(loc="lower right", fontsize=8)
    # Headroom above the fed rate: a line drawn on the frame is not seen.
    ax.set_ylim(bottom=0, top=1.15 * max([result["rate"], *(r[col["per_s"]] for r in rows)]))
    ax = axes[1]
    ax.plot(t, [r[col["wait_p99_ms"]] for r in rows], label="p99")
    ax.plot(t, [r[col["wait_p50_ms"]] for r in rows], label="p50")
    ax.set_ylabel("due to claim, ms")
    ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[2]
    for name, label in (("total_mb", "table + indexes"), ("heap_mb", "heap"),
                        ("index_mb", "indexes"), ("live_mb", "live partition")):
        ax.plot(t, [r[col[name]] for r in rows], label=label)
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[3]
    ax.plot(t, [r[col["live_tuples"]] / 1e6 for r in rows], label="live rows (live partition)")
    ax.plot(t, [r[col["dead_tuples"]] / 1e6 for r in rows], label="dead rows (live partition)")
    ax.set_ylabel("million rows")
    ax.set_xlabel("minutes")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"Soak at {result['rate']:,.0f} events/s ({result['fraction']:.0%} of "
                 f"{result['max']['per_s']:,.0f}/s), retention {result['retention']}, "
                 f"history span {result['history_span_s'] / 60:g} min, "
                 f"{result['source']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="soak length (default 60)")
    p.add_argument("--fraction", type=float, default=0.7,
                   help="share of the measured maximum to feed (default 0.7)")
    p.add_argument("--rate", type=float, default=None,
                   help="feed this many events/s instead of measuring the maximum")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--retention", type=parse_seconds, default=600.0,
                   help="the workers' --retention (default 10m)")
    p.add_argument("--history-span", type=parse_seconds, default=None,
                   help="the history's partition span (`conveyor history --span`; default: "
                        "the database's, a day)")
    p.add_argument("--sample", type=parse_seconds, default=60.0,
                   help="seconds between samples (default 60)")
    p.add_argument("--max-seconds", type=parse_seconds, default=60.0,
                   help="how long the maximum is measured (default 60)")
    p.add_argument("--warmup", type=parse_seconds, default=10.0,
                   help="seconds before the maximum is measured (default 10)")
    p.add_argument("--batch", type=int, default=1000, help="the feeder's backlog unit")
    p.add_argument("--json-out", type=Path, help="write the result here")
    p.add_argument("--plot", type=Path, help="draw the series here (.svg or .png)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, data)")
    args = p.parse_args(argv)
    if not 0 < args.fraction <= 1:
        p.error(f"--fraction must be in (0, 1], got {args.fraction}")
    if args.minutes <= 0:
        p.error(f"--minutes must be positive, got {args.minutes}")
    args.retention_text = f"{int(args.retention)}s"
    base = Path(tempfile.mkdtemp(prefix="conveyor-soak-"))
    os.chmod(base, 0o755)
    logdir = base / "logs"
    logdir.mkdir()
    server = None
    try:
        server = PrivateServer(base)
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute(b'CREATE DATABASE "soak"')
        url = make_conninfo(server.url, dbname="soak")
        subprocess.run([sys.executable, "-m", "conveyor.cli.main", "--database-url", url,
                        "migrate"], cwd=REPO, check=True, capture_output=True, timeout=120)
        if args.history_span:
            subprocess.run([sys.executable, "-m", "conveyor.cli.main", "--database-url", url,
                            "history", "--span", f"{int(args.history_span)}s"], cwd=REPO,
                           check=True, capture_output=True, timeout=120)
        source = source_version()
        started = datetime.now(UTC)
        top = ({"per_s": args.rate / args.fraction, "seconds": 0, "given": True}
               if args.rate else measure_max(url, args, logdir))
        rate = args.rate or round(top["per_s"] * args.fraction, 1)
        log(f"soak: {rate:,.0f} events/s for {args.minutes:g} min, retention "
            f"{args.retention_text}")
        rows = soak(url, args, rate, logdir)
        result = {"source": source, "started": started.isoformat(timespec="seconds"),
                  "max": top, "fraction": args.fraction, "rate": rate,
                  "workers": args.workers, "retention": args.retention_text,
                  "history_span_s": args.history_span or 86_400,
                  "minutes": args.minutes, "sample_s": args.sample,
                  "flatness": flatness(rows, args.retention / 60,
                                       (args.history_span or 86_400) / 60),
                  "columns": COLUMNS,
                  "rows": rows}
    finally:
        if server is not None:
            server.close()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result["flatness"], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
