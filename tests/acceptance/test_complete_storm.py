"""Exactly-once effects under SIGKILL: a handler that completes its event in its own
transaction (``conveyor.complete``) writes its business row once per succeeded event.

Two worker processes drain the events; each time the succeeded count has
grown again, one of them is SIGKILLed, with handlers in the middle of their
transactions, and another is started. The events of a killed worker run
again once their leases expire, as always; what the kills cannot do is leave
a business row without its event's success, or a success without its row.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable

import psycopg
import pytest

from conveyor import NewEvent, Producer
from waiting import wait_for

from .complete_apps import BUSINESS_DDL
from .helpers import WorkerProcess, query, state_counts

pytestmark = pytest.mark.slow

APP = "tests.acceptance.complete_apps:router"
EVENTS = 400
KILLS = 6
ARGS = ("--lease-ttl", "2", "--rescue-interval", "1", "--concurrency", "20",
        "--poll-interval", "1")


def _succeeded(url: str) -> int:
    return state_counts(url).get("succeeded", 0)


def _busy_pids(url: str) -> set[int]:
    """The worker processes with events running under their lease."""
    return {pid for (pid,) in query(url, "SELECT DISTINCT w.pid FROM conveyor.events AS e"
                                         " JOIN conveyor.workers AS w ON w.id = e.lease_owner"
                                         " WHERE e.state = 'running'")}


def test_business_rows_equal_succeeded_events_through_a_kill_storm(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    with psycopg.connect(acc_db) as conn:
        conn.execute(BUSINESS_DDL)
        ids = Producer().enqueue_many(conn, [NewEvent(topic="business.write",
                                                      payload={"sleep": 0.02})
                                             for _ in range(EVENTS)])
        conn.commit()
    rng = random.Random(23)
    workers = [spawn(acc_db, *ARGS, app=APP) for _ in range(2)]
    kills = 0
    busy: list[WorkerProcess] = []   # the workers with handlers under way, as last seen

    def some_busy() -> bool:
        pids = _busy_pids(acc_db)
        busy[:] = [w for w in workers if w.pid in pids]
        return bool(busy) or _succeeded(acc_db) == EVENTS

    while kills < KILLS:
        seen = _succeeded(acc_db)
        if seen == EVENTS:
            break
        # Kill only while there is work under way: after some more successes.
        wait_for(lambda seen=seen: _succeeded(acc_db) >= min(EVENTS, seen + 20), 60,
                 "more events to succeed", alive=workers)
        # ... and only a worker with handlers under way: one just started may own
        # nothing yet (a loaded machine's run once killed only such workers, and
        # no handler was interrupted).
        wait_for(some_busy, 60, "a worker's handlers under way", alive=workers)
        if not busy:
            break
        victim = busy[rng.randrange(len(busy))]
        workers.remove(victim)
        victim.signal(signal.SIGKILL)
        assert victim.wait(timeout=10) == -signal.SIGKILL
        kills += 1
        workers.append(spawn(acc_db, *ARGS, app=APP))
    wait_for(lambda: _succeeded(acc_db) == EVENTS, 120, "every event to succeed",
             alive=workers)

    rows = query(acc_db, "SELECT event_id FROM public.business")
    ran = query(acc_db, "SELECT sum(attempts), max(attempts) FROM conveyor.events")[0]
    print(f"\n{EVENTS} events, {kills} workers SIGKILLed: {len(rows)} business rows, "
          f"{ran[0]} attempts (most for one event: {ran[1]})")
    assert kills == KILLS, f"the events were done after {kills} kills"
    assert state_counts(acc_db) == {"succeeded": EVENTS}
    assert sorted(r[0] for r in rows) == sorted(ids)    # each once: none lost, none twice
    assert ran[1] >= 2, "no kill interrupted a handler: the storm proved nothing"
    for worker in workers:
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, worker.log()[-3000:]
