"""R19: Conveyor behind PgBouncer in transaction mode.

A private PgBouncer (``pool_mode = transaction``, 4 server connections per
database) sits in front of the test PostgreSQL. Real ``conveyor worker``
processes run through it with ``--transaction-pooler`` (poll only, no session
settings, no prepared statements); producers and admin calls go through it on
connections with ``prepare_threshold=None``. The ledger of executions is
written over direct connections: it is the test's instrument, not the system
under test.

* R1 through the pooler: 3 workers drain 3,000 events, each exactly once,
  while far more client connections than server connections are open.
* R3 through the pooler: a random worker is SIGKILLed every 2 s and replaced;
  nothing is lost and orphans run again within the lease bound.
* A worker started through the pooler *without* ``--transaction-pooler``
  finds the pooler on its first connection (``pooler_detected``: the backend
  pid PgBouncer announces is not the server's), keeps no session state there,
  logs the ``listen_deaf`` warning and drains every event once by polling.
  With ``--listen-url`` pointing straight at PostgreSQL a worker hears NOTIFY
  and wakes at once.
* Migrations, producers (single INSERT, INSERT batch, COPY batch) and the
  admin API work through the pooler on connections without prepared
  statements; ``CommittingProducer``, which opens its own connection, finds
  the pooler the same way and prepares nothing.
* In session mode a plain worker LISTENs through PgBouncer and runs each
  event once. The detection cannot tell session from transaction pooling, so
  a worker not told assumes transactions (``pooler_detected``);
  ``--no-transaction-pooler`` keeps the session state without a warning.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from conveyor import Admin, CommittingProducer, NewEvent, Producer
from conveyor.config import LISTENER_PING_INTERVAL_DEFAULT
from conveyor.schema.migrator import Migrator, latest_version
from conveyor.worker.listener import PROBE_TIMEOUT
from conveyor_tools.chaos import LEDGER_URL_ENV, CheckReport, check, create_ledger
from together import run_together

from .pgbouncer import PgBouncer

# light: each test has a private PgBouncer (a port of its own) and a database of
# its own, and bounds its timings loosely (a pickup within 3 s, a drain within
# 40 s); the SIGKILL storm alone is serial.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
APP = "conveyor_tools.chaos:chaos_router"
POOL_SIZE = 4
LEASE_TTL, RESCUE = 3.0, 1.0
# The listener judges its probe when it next wakes up after PROBE_TIMEOUT: with no
# traffic, at its ping interval (the CLI keeps the default).
DEAF_VERDICT_AFTER = max(PROBE_TIMEOUT, LISTENER_PING_INTERVAL_DEFAULT)


# ------------------------------------------------------------------ fixtures

def private_bouncer(server_url: str, pool_size: int = POOL_SIZE,
                    pool_mode: str = "transaction") -> PgBouncer:
    """A PgBouncer not started yet; the test fails (never skips) when pgbouncer is missing."""
    try:
        return PgBouncer(server_url, pool_size=pool_size, pool_mode=pool_mode)
    except RuntimeError as exc:
        missing = str(exc)
    pytest.fail(missing, pytrace=False)


@pytest.fixture
def bouncer(server_url: str) -> Iterator[PgBouncer]:
    """A private PgBouncer in transaction mode in front of the test server."""
    with private_bouncer(server_url) as pooler:
        yield pooler


@pytest.fixture
def ledger_db(fresh_db: str) -> str:
    """A fresh migrated database with an empty ledger (its direct URL)."""
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        create_ledger(conn)
    return fresh_db


class WorkerProcess:
    """One ``conveyor worker`` process, JSON logs to a file."""

    def __init__(self, url: str, ledger_url: str, log_path: Path, args: tuple[str, ...]) -> None:
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
        env.update({LEDGER_URL_ENV: ledger_url, "PYTHONUNBUFFERED": "1"})
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "conveyor.cli.main", "--database-url", url,
                 "--log-format", "json", "worker", "--app", APP, *args],
                cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.started = time.time()
        self.killed = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def actions(self, action: str) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("action") == action]

    def kill(self) -> float:
        self.killed = True
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        return time.time()

    def terminate(self, timeout: float = 20) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            return -9


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker processes; every one still running is killed at teardown."""
    started: list[WorkerProcess] = []

    def start(url: str, ledger_url: str, *args: str) -> WorkerProcess:
        worker = WorkerProcess(url, ledger_url, tmp_path / f"worker-{len(started)}.log", args)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.alive():
            worker.proc.kill()
            worker.proc.wait(timeout=10)


def worker_args(name: str, *extra: str) -> tuple[str, ...]:
    return ("--concurrency", "16", "--lease-ttl", f"{LEASE_TTL:g}",
            "--rescue-interval", f"{RESCUE:g}", "--poll-interval", "0.5",
            "--shutdown-timeout", "5", "--name", name, *extra)


# ------------------------------------------------------------------- helpers

def pooled_connect(url: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A client connection fit for a transaction pooler: no prepared statements."""
    return psycopg.connect(url, prepare_threshold=None, connect_timeout=10, **kwargs)


def enqueue_through(url: str, total: int, payload: dict[str, Any], chunk: int = 500) -> list[int]:
    """Enqueue ``total`` events in transactions of ``chunk`` (COPY) through ``url``."""
    producer, ids = Producer(), []
    with pooled_connect(url) as conn:
        for start in range(0, total, chunk):
            n = min(chunk, total - start)
            ids += producer.enqueue_many(
                conn, [NewEvent(topic="chaos.work", payload=payload) for _ in range(n)])
            conn.commit()
    return ids


class Monitor:
    """Samples the queue and the pooling over one direct connection."""

    def __init__(self, direct_url: str, bouncer: PgBouncer) -> None:
        self.conn = psycopg.connect(direct_url, autocommit=True, application_name="r19-monitor")
        self.bouncer = bouncer
        self.dbname = str(conninfo_to_dict(direct_url)["dbname"])
        self.max_clients = 0           # client connections PgBouncer held at once
        self.max_servers = 0           # server connections PgBouncer held at once
        self.max_backends = 0          # PostgreSQL backends serving PgBouncer at once
        self.server_pids: set[int] = set()
        self.client_ids: set[str] = set()

    def open_events(self) -> int:
        row = self.conn.execute("SELECT count(*) FROM conveyor.events "
                                "WHERE state IN ('pending', 'running')").fetchone()
        return int(row[0]) if row else 0

    def sample(self) -> None:
        clients = self.bouncer.clients(self.dbname)
        servers = self.bouncer.servers(self.dbname)
        # Every backend of this database but the direct ones (this monitor, the ledger).
        row = self.conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend' AND pid <> pg_backend_pid() "
            "AND application_name <> 'ledger-writer'").fetchone()
        self.max_clients = max(self.max_clients, len(clients))
        self.max_servers = max(self.max_servers, len(servers))
        self.max_backends = max(self.max_backends, int(row[0]) if row else 0)
        self.server_pids |= {int(s["remote_pid"]) for s in servers if s["remote_pid"]}
        self.client_ids |= {str(c["ptr"]) for c in clients}

    def figures(self) -> dict[str, int]:
        return {"max_client_connections": self.max_clients,
                "max_server_connections": self.max_servers,
                "max_backends_seen_by_postgres": self.max_backends,
                "distinct_server_backends": len(self.server_pids),
                "distinct_client_connections": len(self.client_ids)}

    def close(self) -> None:
        self.conn.close()


def wait_drained(monitor: Monitor, timeout: float, workers: Callable[[], list[WorkerProcess]],
                 tick: Callable[[], None] | None = None) -> float:
    """Seconds until no event is pending or running; fails on timeout or a worker's own exit."""
    start = time.monotonic()
    next_sample = 0.0
    while True:
        now = time.monotonic()
        if tick is not None:
            tick()
        for w in workers():
            assert w.alive() or w.killed, \
                f"worker {w.pid} exited on its own (rc {w.proc.returncode}):\n{w.text()[-3000:]}"
        if now >= next_sample:
            next_sample = now + 0.25
            monitor.sample()
            if monitor.open_events() == 0:
                return now - start
        if now - start > timeout:
            pytest.fail(f"{monitor.open_events()} events still open after {timeout}s")
        time.sleep(0.05)


def ledger_check(direct_url: str, deaths: dict[int, float] | None = None) -> CheckReport:
    with psycopg.connect(direct_url, autocommit=True) as conn:
        return check(conn, deaths=deaths or {})


def state_counts(direct_url: str) -> dict[str, int]:
    with psycopg.connect(direct_url, autocommit=True) as conn:
        return {str(s): int(n) for s, n in conn.execute(
            "SELECT state, count(*) FROM conveyor.events GROUP BY 1").fetchall()}


def assert_clean_logs(worker: WorkerProcess) -> None:
    """No error-level record (a prepared statement or session setting gone astray would show)."""
    bad = [r for r in worker.records() if r.get("level") in ("error", "critical")]
    assert not bad, f"worker {worker.pid} logged errors: {bad[:5]}"
    assert 'prepared statement "' not in worker.text()       # e.g. "_pg3_0" does not exist


def wait_for_action(worker: WorkerProcess, action: str, timeout: float) -> dict[str, Any]:
    """The first log record of ``worker`` with this ``action`` (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not (found := worker.actions(action)):
        assert worker.alive(), worker.text()[-3000:]
        assert time.monotonic() < deadline, \
            f"no {action} record in {timeout:g}s:\n{worker.text()[-3000:]}"
        time.sleep(0.1)
    return found[0]


def first_start(direct: psycopg.Connection[Any], event_id: int, *, timeout: float) -> float:
    """Epoch second the ledger saw ``event_id``'s first execution start (waits for it)."""
    deadline = time.monotonic() + timeout
    while True:
        row = direct.execute("SELECT extract(epoch FROM min(started_at)) "
                             "FROM public.conveyor_ledger WHERE event_id = %s", (event_id,)).fetchone()
        if row is not None and row[0] is not None:
            return float(row[0])
        assert time.monotonic() < deadline, f"event {event_id} not started within {timeout:g}s"
        time.sleep(0.01)


def wait_for_listen_session(direct: psycopg.Connection[Any], worker: WorkerProcess,
                            timeout: float = 20) -> None:
    """Wait until a backend of this database has run the worker's LISTEN (its last
    statement, or the hold of the wake gate that follows it when the fetch
    connection goes through a pooler)."""
    deadline = time.monotonic() + timeout
    while not direct.execute(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = 'conveyor-listen' AND (query ILIKE 'LISTEN%' "
            "OR query LIKE '%pg_try_advisory_lock_shared%')").fetchone():
        assert worker.alive(), worker.text()[-3000:]
        assert time.monotonic() < deadline, f"no LISTEN session within {timeout:g}s"
        time.sleep(0.05)


def pickup_times(pooled: str, direct: psycopg.Connection[Any], n: int) -> list[float]:
    """Seconds from each of ``n`` commits (through ``pooled``) to its handler's start."""
    time.sleep(1.0)       # past the fetch that follows the LISTEN
    pickups = []
    with pooled_connect(pooled) as conn:
        producer = Producer()
        for _ in range(n):
            sent = time.time()
            event_id = producer.enqueue(conn, "chaos.work", {"ms": 0})
            conn.commit()
            pickups.append(first_start(direct, event_id, timeout=10) - sent)
    return pickups


def report(name: str, figures: dict[str, Any]) -> None:
    print(f"\nR19 {name}: {json.dumps(figures)}")


# --------------------------------------------------------------------- tests

EVENTS_R1 = 3000
DEAF_EVENTS = 300


@pytest.mark.light
def test_r19_r1_short_three_poll_only_workers_through_the_pooler_run_each_event_once(
        bouncer: PgBouncer, ledger_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    pooled = bouncer.url(ledger_db)
    t = time.monotonic()
    ids = enqueue_through(pooled, EVENTS_R1, {"ms_min": 0, "ms_max": 20})
    enqueue_s = time.monotonic() - t
    assert len(set(ids)) == EVENTS_R1
    workers = [spawn(pooled, ledger_db, *worker_args(f"r19-r1-{i}", "--transaction-pooler"))
               for i in range(3)]
    monitor = Monitor(ledger_db, bouncer)
    try:
        drain_s = wait_drained(monitor, 90, lambda: workers)
    finally:
        monitor.close()
    codes = [w.terminate() for w in workers]
    assert codes == [0, 0, 0], [w.text()[-2000:] for w in workers]

    result = ledger_check(ledger_db)
    assert result.ok, result.summary()
    assert (result.lost, result.unexpected, result.duplicated) == (0, 0, 0), result.summary()
    assert result.committed == EVENTS_R1 and result.retries == 0 and result.unfinished == 0
    assert state_counts(ledger_db) == {"succeeded": EVENTS_R1}

    # The pooling was real: 3 workers x 3 connections (fetch, ack, maintenance; no LISTEN)
    # shared at most POOL_SIZE server connections, as PgBouncer and PostgreSQL both say.
    figures = monitor.figures()
    assert figures["max_client_connections"] >= 9, figures
    assert 1 <= figures["max_server_connections"] <= POOL_SIZE, figures
    assert figures["max_backends_seen_by_postgres"] <= POOL_SIZE, figures
    assert figures["distinct_client_connections"] > figures["distinct_server_backends"], figures
    for w in workers:
        assert w.actions("poll_only"), f"worker {w.pid} did not say it polls only"
        assert not w.actions("listen_deaf")
        assert_clean_logs(w)
    report("R1-short", {"events": EVENTS_R1, "workers": 3, "enqueue_s": round(enqueue_s, 2),
                        "drain_s": round(drain_s, 2),
                        "events_per_s": round(EVENTS_R1 / drain_s), **figures})


EVENTS_R3 = 6000
KILL_EVERY, KILL_WINDOW = 2.0, 14.0

ORPHAN_RESCUES = """
SELECT w.pid, extract(epoch FROM (x->>'at')::timestamptz)
FROM conveyor.events e CROSS JOIN LATERAL jsonb_array_elements(e.errors) AS x
JOIN conveyor.workers w ON w.id::text = x->>'worker'
WHERE x->>'error' LIKE 'lease expired%'
"""


# serial: SIGKILLs a worker every 2 s; orphans must run again within the lease bound.
@pytest.mark.serial
def test_r19_r3_short_sigkill_a_worker_every_two_seconds_through_the_pooler(
        bouncer: PgBouncer, ledger_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    pooled = bouncer.url(ledger_db)
    enqueue_through(pooled, EVENTS_R3, {"ms_min": 30, "ms_max": 200})
    fleet = [spawn(pooled, ledger_db, *worker_args(f"r19-r3-{i}", "--transaction-pooler"))
             for i in range(3)]
    rng = random.Random(19)
    deaths: dict[int, float] = {}
    first_kill = time.monotonic() + 3.0          # let the fleet get going
    next_kill = first_kill

    def tick() -> None:
        nonlocal next_kill
        now = time.monotonic()
        if now < next_kill or now > first_kill + KILL_WINDOW:
            return
        next_kill = now + KILL_EVERY
        victim = rng.choice([w for w in fleet if w.alive()])
        deaths[victim.pid] = victim.kill()
        fleet.append(spawn(pooled, ledger_db, *worker_args(f"r19-r3-{len(fleet)}",
                                                           "--transaction-pooler")))

    monitor = Monitor(ledger_db, bouncer)
    try:
        drain_s = wait_drained(monitor, 120, lambda: fleet, tick)
    finally:
        monitor.close()
    survivors = [w for w in fleet if w.alive()]
    codes = [w.terminate() for w in survivors]
    assert set(codes) <= {0}, codes

    result = ledger_check(ledger_db, deaths)
    assert len(deaths) >= 5, f"only {len(deaths)} kills: the queue drained too early"
    assert result.ok, result.summary()
    assert result.lost == 0 and result.unexpected == 0 and result.overlapping == 0
    # Every duplicate is a re-run of an event whose execution was on a killed pid.
    assert result.duplicated == result.duplicates_after_kill, result.summary()
    assert result.duplicated <= len(deaths) * 16
    assert result.orphans_not_rerun == 0 and result.not_terminal == 0, result.summary()
    assert state_counts(ledger_db) == {"succeeded": EVENTS_R3}

    with psycopg.connect(ledger_db, autocommit=True) as conn:
        rescues = conn.execute(ORPHAN_RESCUES).fetchall()
    rescued = [float(at) - deaths[pid] for pid, at in rescues if pid in deaths]
    bound = LEASE_TTL + RESCUE
    assert rescued, "no orphan was rescued: the kills hit idle workers only"
    assert max(rescued) <= bound + 3.0, (max(rescued), bound)
    assert result.rerun_max is not None and result.rerun_max <= bound + 12.0, result.summary()
    for w in survivors:
        assert_clean_logs(w)
    report("R3-short", {
        "events": EVENTS_R3, "kills": len(deaths), "drain_s": round(drain_s, 2),
        "duplicated": result.duplicated, "orphans": result.orphans,
        "orphan_rescued_max_s": round(max(rescued), 2),
        "orphan_rerun_max_s": round(result.rerun_max, 2),
        "orphan_rerun_p95_s": round(result.rerun_p95 or 0, 2), **monitor.figures()})


@pytest.mark.light
def test_listen_through_the_pooler_is_reported_deaf(
        bouncer: PgBouncer, ledger_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    worker = spawn(bouncer.url(ledger_db), ledger_db, *worker_args("r19-deaf"))
    deaf = wait_for_action(worker, "listen_deaf", 20)
    warned_after = time.time() - worker.started
    assert deaf["level"] == "warning"
    for hint in ("PgBouncer", "--listen-url", "--transaction-pooler"):
        assert hint in deaf["message"], deaf["message"]
    time.sleep(1.0)
    assert worker.alive(), worker.text()[-3000:]
    assert len(worker.actions("listen_deaf")) == 1      # once per connection, not per poll
    assert worker.terminate() == 0, worker.text()[-3000:]
    report("deaf listener", {"warned_after_start_s": round(warned_after, 1)})


@pytest.mark.light
def test_a_worker_not_told_of_the_pooler_still_drains_each_event_once_by_polling(
        server_url: str, ledger_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    # One server connection for every client: any two clients preparing a statement of
    # the same name meet, so the outcome does not depend on how PgBouncer assigns servers.
    with private_bouncer(server_url, pool_size=1) as tight:
        pooled = tight.url(ledger_db)
        worker = spawn(pooled, ledger_db, *worker_args("r19-noflag", "--poll-interval", "1"))
        enqueue_through(pooled, DEAF_EVENTS, {"ms_min": 0, "ms_max": 5}, chunk=100)
        with psycopg.connect(ledger_db, autocommit=True) as direct:
            deadline = time.monotonic() + 40
            while not worker.actions("ack_failed") and direct.execute(
                    "SELECT count(*) FROM conveyor.events "
                    "WHERE state IN ('pending', 'running')").fetchone() != (0,):
                assert worker.alive(), worker.text()[-3000:]
                assert time.monotonic() < deadline, "not drained within 40 s"
                time.sleep(0.1)
        errors = [r for r in worker.records() if r.get("level") == "error"]
        assert not errors, f"{len(errors)} errors, the first: {errors[0]['message']}"
        # It found the pooler on its first connection and kept no session state there.
        assert worker.actions("pooler_detected"), worker.text()[-3000:]
        assert worker.terminate() == 0, worker.text()[-3000:]
        result = ledger_check(ledger_db)
        assert result.lost == 0 and result.duplicated == 0, result.summary()
        assert state_counts(ledger_db) == {"succeeded": DEAF_EVENTS}


@pytest.mark.light
def test_a_direct_listen_url_hears_notifications_and_wakes_at_once(
        bouncer: PgBouncer, ledger_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    pooled = bouncer.url(ledger_db)
    # A 30 s poll: only a NOTIFY heard on the direct LISTEN connection starts an event fast.
    worker = spawn(pooled, ledger_db, *worker_args("r19-listen", "--poll-interval", "30",
                                                   "--transaction-pooler", "--listen-url", ledger_db))
    with psycopg.connect(ledger_db, autocommit=True) as direct:
        wait_for_listen_session(direct, worker)
        listening_since = time.monotonic()
        pickups = pickup_times(pooled, direct, 5)
    assert max(pickups) < 3.0, pickups
    # The listener heard its own probe: past the moment it judges it, no warning came.
    time.sleep(max(0.0, listening_since + DEAF_VERDICT_AFTER + 3.0 - time.monotonic()))
    assert worker.alive()
    assert not worker.actions("listen_deaf"), worker.text()[-3000:]
    assert not worker.actions("poll_only")
    apps = {c["application_name"] for c in bouncer.clients(str(conninfo_to_dict(ledger_db)["dbname"]))}
    assert "conveyor-fetch" in apps and "conveyor-listen" not in apps, apps
    assert worker.terminate() == 0
    assert_clean_logs(worker)
    report("direct listen", {"pickup_s": [round(p, 3) for p in pickups]})


@pytest.mark.light
def test_in_session_mode_a_plain_worker_listens_through_the_pooler_and_runs_each_event_once(
        server_url: str, ledger_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    # Session pooling keeps a client on one server connection: LISTEN works through it.
    with private_bouncer(server_url, pool_size=8, pool_mode="session") as session:
        pooled = session.url(ledger_db)
        worker = spawn(pooled, ledger_db, *worker_args("r19-session", "--poll-interval", "30"))
        with psycopg.connect(ledger_db, autocommit=True) as direct:
            wait_for_listen_session(direct, worker)
            pickups = pickup_times(pooled, direct, 3)
        assert max(pickups) < 3.0, pickups
        enqueue_through(pooled, 500, {"ms_min": 0, "ms_max": 5}, chunk=100)
        monitor = Monitor(ledger_db, session)
        try:
            wait_drained(monitor, 60, lambda: [worker])
        finally:
            monitor.close()
        assert worker.terminate() == 0, worker.text()[-3000:]
    result = ledger_check(ledger_db)
    assert result.ok and result.lost == 0 and result.duplicated == 0, result.summary()
    assert state_counts(ledger_db) == {"succeeded": 503}
    assert_clean_logs(worker)
    report("session mode", {"pickup_s": [round(p, 3) for p in pickups]})


@pytest.mark.light
def test_in_session_mode_detection_is_conservative_and_no_transaction_pooler_keeps_state(
        server_url: str, ledger_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    # The backend pid check cannot tell session from transaction pooling, so a
    # worker not told assumes the unsafe one and says so; told
    # --no-transaction-pooler, it keeps its session state and warns nothing.
    with private_bouncer(server_url, pool_size=8, pool_mode="session") as session:
        plain = spawn(session.url(ledger_db), ledger_db, *worker_args("r19-session-auto"))
        told = spawn(session.url(ledger_db), ledger_db,
                     *worker_args("r19-session-told", "--no-transaction-pooler"))
        for worker in (plain, told):
            wait_for_action(worker, "started", 20)
        time.sleep(0.5)
        detected = plain.actions("pooler_detected")
        assert detected and "--no-transaction-pooler" in detected[0]["message"]
        assert told.actions("pooler_detected") == []
        for worker in (plain, told):
            assert worker.terminate() == 0, worker.text()[-3000:]
            assert_clean_logs(worker)


@pytest.mark.light
def test_migrations_producers_and_admin_work_through_the_pooler(
        bouncer: PgBouncer, empty_db: str) -> None:
    pooled = bouncer.url(empty_db)
    # Two migrators at once: the transaction-scoped advisory lock serialises
    # them, and 0025's steps (each in a transaction) too: no session lock,
    # which a pooler could not keep.
    def migrate(go: Callable[[], None]) -> list[int]:
        with pooled_connect(pooled, autocommit=True) as conn:
            go()
            return [m.version for m in Migrator().apply(conn)]

    applied = [v for versions in run_together(2, migrate) for v in versions]
    assert sorted(applied) == list(range(1, latest_version() + 1))   # each exactly once

    producer, admin = Producer(), Admin()
    with pooled_connect(pooled) as conn:
        single = [producer.enqueue(conn, "r19.single", {"n": i}) for i in range(12)]
        keyed = producer.enqueue(conn, "r19.keyed", {}, idempotency_key="k-1")
        assert producer.enqueue(conn, "r19.keyed", {}, idempotency_key="k-1") == keyed
        small = producer.enqueue_many(conn, [NewEvent(topic="r19.small", payload={"n": i})
                                             for i in range(10)])            # INSERT
        big = producer.enqueue_many(conn, [NewEvent(topic="r19.copy", payload={"n": i})
                                           for i in range(2000)])          # COPY
        conn.commit()
        producer.enqueue(conn, "r19.rolled_back", {})
        conn.rollback()
        assert len(set(single + small + big + [keyed])) == 12 + 10 + 2000 + 1
        status = admin.status(conn)
        assert status.counts.get("pending") == 2023, status.counts
        assert admin.show(conn, big[-1]).payload == {"n": 1999}
        admin.cancel(conn, single[0])
        conn.commit()
        assert admin.show(conn, single[0]).state == "cancelled"
        assert admin.status(conn).counts.get("pending") == 2022
        conn.commit()

    # One client connection is served by whichever server connection is free at each
    # transaction: while another client holds one in a transaction, it gets another.
    with pooled_connect(pooled, autocommit=True) as a, pooled_connect(pooled) as b:
        pid_b = b.execute("SELECT pg_backend_pid()").fetchone()
        pids_a = {a.execute("SELECT pg_backend_pid()").fetchone() for _ in range(3)}
        assert pid_b not in pids_a
        b.rollback()
    config = {r["key"]: r["value"] for r in bouncer.admin("SHOW CONFIG")}
    assert config["pool_mode"] == "transaction"


@pytest.mark.light
def test_a_committing_producer_enqueues_through_the_pooler(bouncer: PgBouncer, fresh_db: str) -> None:
    pooled = bouncer.url(fresh_db)
    stop = threading.Event()

    def other_client() -> None:        # other clients' transactions move ours between servers
        with pooled_connect(pooled, autocommit=True) as conn:
            while not stop.is_set():
                conn.execute("SELECT pg_sleep(0.003)")

    others = [threading.Thread(target=other_client) for _ in range(3)]
    for t in others:
        t.start()
    failures: list[str] = []
    try:
        with CommittingProducer(pooled) as producer:
            for n in range(200):
                try:
                    producer.enqueue("r19.committing", {"n": n})
                except Exception as exc:  # noqa: BLE001 - counted below
                    failures.append(str(exc))
    finally:
        stop.set()
        for t in others:
            t.join(timeout=10)
    assert not failures, f"{len(failures)} of 200 enqueues failed, the first: {failures[0]}"
