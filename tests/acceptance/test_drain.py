"""Four real worker processes drain 10,000 events: each runs exactly once."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import psycopg
import pytest

from conveyor import NewEvent, Producer
from waiting import wait_for

from .helpers import WorkerProcess, drained, query

# serial: four worker processes draining 10,000 events load both cores.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

EVENTS = 10_000
WORKERS = 4


def test_four_workers_drain_ten_thousand_events_exactly_once(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    workers = [spawn(acc_db, "--concurrency", "50", "--name", f"drain-{i}")
               for i in range(WORKERS)]
    wait_for(lambda: query(acc_db, "SELECT count(*) FROM conveyor.workers")[0][0] == WORKERS,
             30, "all workers registered", alive=workers)

    with psycopg.connect(acc_db) as conn:
        ids = Producer().enqueue_many(
            conn, [NewEvent(topic=f"acc.drain.{i % 7}", payload={"n": i}) for i in range(EVENTS)])
        conn.commit()
    assert len(set(ids)) == EVENTS
    started = time.monotonic()

    executions = drained(acc_db, ids, workers, timeout=150)
    elapsed = time.monotonic() - started
    print(f"drained {EVENTS} events with {WORKERS} processes in {elapsed:.1f}s "
          f"({EVENTS / elapsed:.0f}/s)")

    assert [e for e, n in executions.items() if n != 1] == [], "no event ran twice"
    assert query(acc_db, "SELECT count(*) FROM conveyor.events WHERE attempts <> 1") == [(0,)]
    pids = {p for (p,) in query(acc_db, "SELECT DISTINCT pid FROM public.ledger")}
    assert pids <= {w.pid for w in workers}
    assert len(pids) >= 2, "the work was shared between processes"

    for w in workers:
        w.signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(timeout=30) == 0, w.log()[-2000:]
