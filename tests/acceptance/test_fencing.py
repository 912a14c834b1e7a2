"""A frozen worker (SIGSTOP) loses its leases; when it thaws, its late results are fenced out.

This is the failure River's rescuer bug #1302 was about: a worker that was
only paused, not dead, finishes an event that another worker already re-ran,
and must not be able to write over that event's outcome.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable

import psycopg
import pytest

from conveyor import NewEvent, Producer
from waiting import wait_for

from .helpers import WorkerProcess, query, run_cli, state_counts

pytestmark = pytest.mark.slow

EVENTS = 10
ARGS = ("--lease-ttl", "2", "--rescue-interval", "1", "--poll-interval", "30")


def test_thawed_worker_cannot_overwrite_a_rescued_event(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    with psycopg.connect(acc_db) as conn:
        ids = Producer().enqueue_many(conn, [
            NewEvent(topic="acc.frozen", payload={"sleep": 1.5, "sleep_attempts": 1})
            for _ in range(EVENTS)])
        conn.commit()
    frozen = spawn(acc_db, *ARGS, "--name", "frozen")
    wait_for(lambda: state_counts(acc_db).get("running", 0) == EVENTS, 20,
             "the first worker to claim every event", interval=0.05, alive=[frozen])
    frozen.signal(signal.SIGSTOP)
    try:
        other = spawn(acc_db, *ARGS, "--name", "other")
        wait_for(lambda: state_counts(acc_db).get("succeeded", 0) == EVENTS, 30,
                 "the other worker to rescue and finish every event", alive=[other])
    finally:
        frozen.signal(signal.SIGCONT)
    # Let the thawed worker finish its stale handlers and try to acknowledge them.
    time.sleep(3.0)
    assert frozen.alive(), frozen.log()[-3000:]

    assert state_counts(acc_db) == {"succeeded": EVENTS}
    rows = query(acc_db, "SELECT attempts, lease_owner, errors FROM conveyor.events "
                         "WHERE id = ANY(%s)", (ids,))
    for attempts, owner, errors in rows:
        assert (attempts, owner) == (2, None)
        assert [e["attempt"] for e in errors] == [1], "only the rescue is in the history"
    runs = query(acc_db, "SELECT attempt, pid FROM public.ledger ORDER BY 1")
    assert {(2, other.pid)} == {r for r in runs if r[0] == 2}
    assert sum(1 for r in runs if r[0] == 2) == EVENTS
    stale = sum(1 for r in runs if r[0] == 1)
    print(f"thawed worker finished {stale} stale attempts; all fenced out")
    log = frozen.log()
    assert "no longer owned" in log or "lost the lease" in log

    status = run_cli("--database-url", acc_db, "status", "--json")
    assert {w["pid"] for w in json.loads(status.stdout)["workers"]} == \
        {frozen.pid, other.pid}
    for worker in (frozen, other):
        worker.signal(signal.SIGTERM)
    for worker in (frozen, other):
        assert worker.wait(timeout=30) == 0
    status = run_cli("--database-url", acc_db, "status", "--json")
    assert json.loads(status.stdout)["workers"] == [], "workers unregister on exit"
