"""An async handler that blocks the event loop past the lease, with two real workers.

Adversary finding F12: the blocked worker's heartbeat could not run, so the
other worker rescued the event and ran it too; the attempts overlapped, and
after ``max_attempts`` rescues the event ended ``failed`` ("lease expired")
although every call returned. Now the watchdog thread renews the blocked
worker's leases from its own connection, each only until its handler's
timeout: a handler that blocks and returns succeeds once, and one that blocks
past its timeout is rescued as before.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from acceptance.helpers import WorkerProcess, query
from waiting import wait_for

from .blocking_app import LEDGER_DDL

# serial: blocks event loops past their leases, timed against the watchdog.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

APP = "tests.worker.blocking_app:router"
# Lease 2 s (heartbeat 0.67 s, first watchdog warning after 0.5 s); rescues often.
TIMINGS = ("--lease-ttl", "2", "--rescue-interval", "0.3", "--poll-interval", "0.5",
           "--backoff-base", "0.1")


@pytest.fixture
def db(fresh_db: str) -> str:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute(LEDGER_DDL)
    return fresh_db


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(url: str, *args: str) -> WorkerProcess:
        worker = WorkerProcess(url, tmp_path / f"worker-{len(started)}.log", *args, app=APP)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def _insert(url: str, payload: dict[str, object], count: int = 1) -> list[int]:
    rows = query(url, "INSERT INTO conveyor.events (topic, payload, max_attempts) "
                      "SELECT 'block.loop', %s::jsonb, 5 FROM generate_series(1, %s) "
                      "RETURNING id", (json.dumps(payload), count))
    return sorted(r[0] for r in rows)


def _stop(*workers: WorkerProcess) -> None:
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(timeout=30) == 0, worker.log()[-3000:]


def test_a_handler_blocking_the_loop_past_the_lease_runs_once_and_succeeds(
        db: str, spawn: Callable[..., WorkerProcess]) -> None:
    ids = _insert(db, {"block": 5}, count=3)       # 2.5 x the lease, each
    a = spawn(db, *TIMINGS, "--handler-timeout", "60", "--concurrency", "2")
    b = spawn(db, *TIMINGS, "--handler-timeout", "60", "--concurrency", "2")
    wait_for(lambda: query(db, "SELECT count(*) FROM public.block_ledger") == [(3,)],
             90, "three blocking calls recorded", interval=0.2, alive=[a, b])
    wait_for(lambda: query(db, "SELECT count(*) FROM conveyor.events "
                               "WHERE state = 'succeeded'") == [(3,)],
             30, "the three events succeeded", interval=0.2, alive=[a, b])
    _stop(a, b)
    events = query(db, "SELECT id, state, attempts, COALESCE(errors, '[]')"
                       " FROM conveyor.events ORDER BY id")       # NULL: no history (0020)
    assert events == [(i, "succeeded", 1, []) for i in ids], events
    # Each ran once: no rescue, no overlapping attempt on the other worker.
    ledger = query(db, "SELECT event_id, attempt FROM public.block_ledger ORDER BY event_id")
    assert ledger == [(i, 1) for i in ids], ledger
    logs = a.log() + b.log()
    assert "loop_blocked" in logs or "event loop blocked" in logs
    assert "renewed" in logs and "while the event loop is blocked" in logs


def test_a_loop_blocked_past_the_handler_timeout_lets_the_lease_go(
        db: str, spawn: Callable[..., WorkerProcess]) -> None:
    a = spawn(db, *TIMINGS, "--handler-timeout", "3")
    wait_for(lambda: "started" in a.log(), 30, "worker A to start", alive=[a])
    [event_id] = _insert(db, {"block": 9, "block_attempts": 1})
    wait_for(lambda: query(db, "SELECT state FROM conveyor.events WHERE id = %s",
                           (event_id,)) == [("running",)],
             30, "worker A to claim the event", interval=0.05, alive=[a])
    b = spawn(db, *TIMINGS, "--handler-timeout", "3")
    # A's watchdog keeps the lease only until the 3 s timeout: B rescues the
    # event while A is still blocked, and runs attempt 2 (which does not block).
    wait_for(lambda: query(db, "SELECT count(*) FROM public.block_ledger") == [(2,)],
             60, "both attempts recorded", interval=0.2, alive=[a, b])
    _stop(a, b)
    ledger = query(db, "SELECT attempt, pid, ended FROM public.block_ledger ORDER BY attempt")
    (first, pid_a, first_ended), (second, pid_b, second_ended) = ledger
    assert (first, pid_a, second, pid_b) == (1, a.pid, 2, b.pid)
    assert second_ended < first_ended, "B ran it while A was still blocked"
    [(state, attempts, last_error)] = query(
        db, "SELECT state, attempts, errors->0->>'error' FROM conveyor.events WHERE id = %s",
        (event_id,))
    assert (state, attempts) == ("succeeded", 2)
    assert last_error.startswith("lease expired")
