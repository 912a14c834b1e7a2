"""Workflows through SIGKILLs: a chain into a 10,000-member group whose callback
(a chord) runs exactly once, after the last member, with every member's result.

Two worker processes drain the workflow; each time more members have
succeeded, one of them is SIGKILLed with members running, and another is
started. Killed members run again when their leases expire; what the kills
cannot do is start the callback before the last member succeeded, run it
twice, or leave it waiting.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable

import psycopg
import pytest

from conveyor import Producer, chain, group, step
from waiting import wait_for

from .helpers import WorkerProcess, query, state_counts
from .workflow_apps import CALLBACKS_DDL

pytestmark = pytest.mark.slow

APP = "tests.acceptance.workflow_apps:router"
MEMBERS = 10_000
KILLS = 4
ARGS = ("--lease-ttl", "2", "--rescue-interval", "1", "--concurrency", "50",
        "--poll-interval", "1")


def _succeeded(url: str) -> int:
    return state_counts(url).get("succeeded", 0)


def _holding(url: str, workers: list[WorkerProcess]) -> list[WorkerProcess]:
    """The workers among ``workers`` that hold running events now."""
    pids = {row[0] for row in query(url, "SELECT DISTINCT w.pid FROM conveyor.events AS e"
                                         " JOIN conveyor.workers AS w ON w.id = e.lease_owner"
                                         " WHERE e.state = 'running'")}
    return [worker for worker in workers if worker.pid in pids]


def test_a_chord_of_ten_thousand_runs_its_callback_once_through_kills(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    first = step("wf.start")
    members = [step("wf.member", {"i": i, "sleep": 0.01}) for i in range(MEMBERS)]
    last = step("wf.callback")
    with psycopg.connect(acc_db) as conn:
        conn.execute(CALLBACKS_DDL)
        ids = Producer().enqueue_workflow(conn, chain(first, group(*members), last))
        conn.commit()
    assert state_counts(acc_db) == {"pending": 1, "waiting": MEMBERS + 1}
    rng = random.Random(29)
    workers = [spawn(acc_db, *ARGS, app=APP) for _ in range(2)]
    kills = 0
    while kills < KILLS and _succeeded(acc_db) < MEMBERS:
        seen = _succeeded(acc_db)
        wait_for(lambda seen=seen: _succeeded(acc_db) >= min(MEMBERS, seen + 1500), 120,
                 "more members to succeed", alive=workers)
        # The victim holds running members: a worker just started may hold
        # none yet, while the other drains on (sometimes to the last member).
        holding = wait_for(lambda: _holding(acc_db, workers), 60,
                           "a worker to hold running members", alive=workers)
        victim = holding[rng.randrange(len(holding))]
        workers.remove(victim)
        victim.signal(signal.SIGKILL)
        assert victim.wait(timeout=10) == -signal.SIGKILL
        kills += 1
        workers.append(spawn(acc_db, *ARGS, app=APP))
    wait_for(lambda: _succeeded(acc_db) == MEMBERS + 2, 180, "the callback to succeed",
             alive=workers)

    callbacks = query(acc_db, "SELECT event_id, members, succeeded, total FROM public.callbacks")
    assert callbacks == [(ids[last], MEMBERS, MEMBERS, sum(range(MEMBERS)))]   # once, all seen
    timing = query(acc_db, f"""
        SELECT (SELECT attempted_at FROM conveyor.events WHERE id = {ids[last]})
                 - max(finished_at),
               (SELECT min(attempted_at) FROM conveyor.events WHERE topic = 'wf.member')
                 - (SELECT finished_at FROM conveyor.events WHERE id = {ids[first]}),
               max(attempts)
        FROM conveyor.events WHERE topic = 'wf.member'""")[0]
    late, member_start, most = timing
    print(f"\n{MEMBERS} members, {kills} workers SIGKILLed: callback started "
          f"{late.total_seconds() * 1000:.0f} ms after the last member finished; first member "
          f"{member_start.total_seconds() * 1000:.0f} ms after the chain's first step; "
          f"most attempts of one member: {most}")
    assert late.total_seconds() > 0, "the callback started before the last member finished"
    assert member_start.total_seconds() > 0, "a member started before the first step finished"
    assert kills == KILLS, f"the members were done after {kills} kills"
    assert most >= 2, "no kill interrupted a member: the storm proved nothing"
    assert state_counts(acc_db) == {"succeeded": MEMBERS + 2}
    for worker in workers:
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, worker.log()[-3000:]
