"""A pause outlives the worker: real ``conveyor worker`` processes, paused by the CLI."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import psycopg
import pytest

from conveyor import NewEvent, Producer
from waiting import wait_for

from .helpers import WorkerProcess, query, run_cli

pytestmark = pytest.mark.slow


def _enqueue(url: str, topic: str, n: int = 1) -> list[int]:
    with psycopg.connect(url) as conn:
        ids = Producer().enqueue_many(conn, [NewEvent(topic=topic) for _ in range(n)])
        conn.commit()
    return ids


def _ran(url: str, ids: list[int]) -> set[int]:
    return {e for (e,) in query(url, "SELECT event_id FROM public.ledger WHERE event_id = ANY(%s)",
                                (ids,))}


def test_pause_survives_a_worker_restart_until_resumed(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    worker = spawn(acc_db)
    warm = _enqueue(acc_db, "acc.flow")
    wait_for(lambda: _ran(acc_db, warm) == set(warm), 20, "the first worker's first event",
             alive=[worker])

    done = run_cli("--database-url", acc_db, "pause", "acc.paused", "--reason", "test")
    assert done.returncode == 0, done.stderr
    held = _enqueue(acc_db, "acc.paused", 3)
    flowing = _enqueue(acc_db, "acc.flow")
    wait_for(lambda: _ran(acc_db, flowing) == set(flowing), 10, "the unpaused topic",
             alive=[worker])
    time.sleep(1.0)
    assert _ran(acc_db, held) == set()

    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0, worker.log()[-3000:]

    # A 60 s poll: only the resume's notification can start the held events within
    # the bound below, which leaves a loaded machine room (it was 1.5 s).
    restarted = spawn(acc_db, "--poll-interval", "60")
    flowing = _enqueue(acc_db, "acc.flow")
    wait_for(lambda: _ran(acc_db, flowing) == set(flowing), 20, "the restarted worker's event",
             alive=[restarted])
    time.sleep(1.0)
    assert _ran(acc_db, held) == set(), "a restarted worker claimed a paused topic"
    assert {s for (s,) in query(acc_db, "SELECT state FROM conveyor.events WHERE id = ANY(%s)",
                                 (held,))} == {"pending"}

    done = run_cli("--database-url", acc_db, "resume", "acc.paused")
    assert done.returncode == 0, done.stderr
    resumed = time.monotonic()
    wait_for(lambda: _ran(acc_db, held) == set(held), 20, "the resumed topic",
             interval=0.02, alive=[restarted])
    assert time.monotonic() - resumed < 20
