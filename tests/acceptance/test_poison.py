"""A poison event in a real worker process: max_attempts runs, then parked with its history."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable

import pytest

from waiting import wait_for

from .helpers import WorkerProcess, query, run_cli

pytestmark = pytest.mark.slow

MAX_ATTEMPTS = 4


def test_poison_event_runs_max_attempts_times_then_parks_failed(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    enqueued = run_cli("--database-url", acc_db, "enqueue", "acc.poison", '{"fail": true}',
                       "--max-attempts", str(MAX_ATTEMPTS))
    assert enqueued.returncode == 0, enqueued.stderr
    event_id = int(enqueued.stdout.strip())
    healthy = run_cli("--database-url", acc_db, "enqueue", "acc.fine", "{}")
    healthy_id = int(healthy.stdout.strip())

    worker = spawn(acc_db, "--backoff-base", "0.2", "--poll-interval", "1")
    wait_for(lambda: query(acc_db, "SELECT state FROM conveyor.events WHERE id = %s",
                           (event_id,)) == [("failed",)],
             30, "the poison event to be parked", interval=0.1, alive=[worker])

    runs = query(acc_db, "SELECT attempt, pid, failed FROM public.ledger WHERE event_id = %s "
                         "ORDER BY attempt", (event_id,))
    assert runs == [(n, worker.pid, True) for n in range(1, MAX_ATTEMPTS + 1)]
    assert query(acc_db, "SELECT state FROM conveyor.events WHERE id = %s",
                 (healthy_id,)) == [("succeeded",)]

    shown = run_cli("--database-url", acc_db, "show", str(event_id), "--json")
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert record["state"] == "failed"
    assert record["attempts"] == MAX_ATTEMPTS
    assert record["max_attempts"] == MAX_ATTEMPTS
    assert [e["attempt"] for e in record["errors"]] == list(range(1, MAX_ATTEMPTS + 1))
    for n, error in enumerate(record["errors"], start=1):
        assert error["error"] == f"RuntimeError: poison event {event_id} failed on attempt {n}"
        assert "Traceback" in error["traceback"] and "handle_async" in error["traceback"]
    assert "poison event" in record["last_error"]

    # Parked for good: it does not run again by itself.
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert query(acc_db, "SELECT count(*) FROM public.ledger WHERE event_id = %s",
                 (event_id,)) == [(MAX_ATTEMPTS,)]


def test_poison_event_retries_run_when_due_not_at_the_next_poll(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    """Regression: the retry timer was armed at handler return (time.time() + delay) while
    run_at is written at acknowledgement (now() + delay), so it fired early, the claim found
    nothing, and every retry waited for the next poll."""
    enqueued = run_cli("--database-url", acc_db, "enqueue", "acc.poison", '{"fail": true}',
                       "--max-attempts", "3")
    event_id = int(enqueued.stdout.strip())
    # Backoff 0.2 s then 0.4 s: parked within about a second, unless retries wait for the poll.
    worker = spawn(acc_db, "--backoff-base", "0.2", "--poll-interval", "30")
    wait_for(lambda: query(acc_db, "SELECT state FROM conveyor.events WHERE id = %s",
                           (event_id,)) == [("failed",)],
             5, "the poison event to be parked", interval=0.1, alive=[worker])
