"""Connections cut under a running worker (``pg_terminate_backend``): nothing is lost."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import psycopg
import pytest

from conveyor import NewEvent, Producer
from waiting import wait_for

from .helpers import WorkerProcess, drained, listening, query, state_counts

pytestmark = pytest.mark.slow

EVENTS = 1000
CUTS = 3
# Far under the workers' 60 s poll, so only a NOTIFY explains a start this soon; not
# the 2 s it was, which a loaded machine's scheduling alone can use up.
WAKE_LIMIT = 10.0


def terminate_worker_backends(url: str) -> set[int]:
    """Kill every session of the worker (its four connections), never the ledger's."""
    rows = query(url, "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE datname = current_database() AND application_name LIKE 'conveyor-%' "
                      "AND pid <> pg_backend_pid()")
    return {int(pid) for pid, ok in rows if ok}


def enqueue_one(url: str) -> tuple[int, float]:
    with psycopg.connect(url) as conn:
        event_id = Producer().enqueue(conn, "acc.wake", {})
        conn.commit()
    return event_id, time.time()


def assert_listen_wakes_worker(url: str, worker: WorkerProcess, old: set[int]) -> float:
    """With a 60 s poll only a NOTIFY can start a new event within WAKE_LIMIT seconds."""
    wait_for(lambda: listening(url, exclude=old), 30, "a new LISTEN session", alive=[worker])
    time.sleep(0.3)  # let the fetch loop settle into its idle wait
    event_id, enqueued_at = enqueue_one(url)
    started = wait_for(lambda: query(url, "SELECT started FROM public.ledger WHERE event_id = %s",
                                     (event_id,)), 30, f"event {event_id} to run", alive=[worker])
    return float(started[0][0]) - enqueued_at


def test_worker_survives_repeated_backend_termination(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    worker = spawn(acc_db, "--poll-interval", "60", "--concurrency", "20",
                   "--lease-ttl", "6", "--rescue-interval", "2")
    wait_for(lambda: listening(acc_db), 30, "the worker to LISTEN", alive=[worker])
    with psycopg.connect(acc_db) as conn:
        ids = Producer().enqueue_many(conn, [NewEvent(topic="acc.cut", payload={"sleep": 0.1})
                                             for _ in range(EVENTS)])
        conn.commit()

    cut: set[int] = set()
    for _ in range(CUTS):
        time.sleep(1.0)
        killed = terminate_worker_backends(acc_db)
        assert killed, "the worker had sessions to cut"
        cut |= killed
        assert worker.alive()
    counts_at_last_cut = state_counts(acc_db)
    assert counts_at_last_cut.get("succeeded", 0) < EVENTS, "the cuts came mid-drain"

    executions = drained(acc_db, ids, [worker])
    twice = [e for e, n in executions.items() if n > 1]
    print(f"{len(cut)} sessions cut in {CUTS} rounds; {len(twice)} events ran more than once")
    assert twice == []

    latency = assert_listen_wakes_worker(acc_db, worker, cut)
    print(f"after reconnecting, a new event started {latency:.3f}s after its enqueue")
    assert latency < WAKE_LIMIT
    assert worker.alive()
    assert "re-established" in worker.log()
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0


def test_connection_lost_log_line_is_plain_text(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    worker = spawn(acc_db, "--poll-interval", "60")
    old = wait_for(lambda: listening(acc_db), 30, "the worker to LISTEN", alive=[worker])
    terminate_worker_backends(acc_db)
    wait_for(lambda: listening(acc_db, exclude={old}), 30, "a new LISTEN session", alive=[worker])
    lost = [line for line in worker.log().splitlines() if "connection lost:" in line]
    assert lost
    assert not any("lost: ['" in line for line in lost), lost
