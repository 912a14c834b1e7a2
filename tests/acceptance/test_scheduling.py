"""Delayed and prioritised events run when and in the order they say, in a real worker."""

from __future__ import annotations

import signal
from collections.abc import Callable

import psycopg
import pytest

from conveyor import Producer
from waiting import wait_for

from .helpers import WorkerProcess, listening, query, run_cli

# serial: a delayed event must start less than 1 s late.
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def _enqueue(url: str, *args: str) -> int:
    done = run_cli("--database-url", url, "enqueue", *args)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_delayed_event_runs_when_due_not_before_and_not_at_the_poll(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    worker = spawn(acc_db, "--poll-interval", "60")
    wait_for(lambda: listening(acc_db), 30, "the worker to LISTEN", alive=[worker])
    event_id = _enqueue(acc_db, "acc.later", "--delay", "2s")
    started = wait_for(lambda: query(
        acc_db, "SELECT l.started - extract(epoch FROM e.run_at) FROM public.ledger l "
                "JOIN conveyor.events e ON e.id = l.event_id WHERE l.event_id = %s",
        (event_id,)), 10, "the delayed event to run", alive=[worker])
    late = float(started[0][0])
    print(f"delayed event started {late * 1000:.0f} ms after its run_at")
    assert 0 <= late < 1.0
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0


def test_higher_priority_runs_first(acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    with psycopg.connect(acc_db) as conn:
        low = [Producer().enqueue(conn, "acc.prio") for _ in range(3)]
        high = Producer().enqueue(conn, "acc.prio", priority=10)
        urgent = Producer().enqueue(conn, "acc.prio", priority=20)
        conn.commit()
    worker = spawn(acc_db, "--concurrency", "1", "--batch-size", "1")
    wait_for(lambda: query(acc_db, "SELECT count(*) FROM public.ledger") == [(5,)], 20,
             "every event to run", alive=[worker])
    order = [e for (e,) in query(acc_db, "SELECT event_id FROM public.ledger ORDER BY started")]
    assert order == [urgent, high, *low]
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
