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


def _holders(url: str) -> int:
    """How many workers hold running events."""
    return query(url, "SELECT count(DISTINCT lease_owner) FROM conveyor.events"
                      " WHERE state = 'running'")[0][0]


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
        # A worker just started may not have claimed yet; kill only while
        # every worker holds running events, so each kill interrupts members.
        wait_for(lambda: _holders(acc_db) >= len(workers), 60,
                 "every worker to hold running members", alive=workers)
        victim = workers.pop(rng.randrange(len(workers)))
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
