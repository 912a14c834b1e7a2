"""The checker itself: fabricated histories with one of each anomaly, each reported."""

from __future__ import annotations

from typing import Any

import psycopg

from conveyor_tools.chaos import (
    CANCELLED,
    RAISED,
    SUCCEEDED,
    Execution,
    check,
    check_records,
    create_ledger,
)

OWNER_A = "00000000-0000-0000-0000-00000000000a"
OWNER_B = "00000000-0000-0000-0000-00000000000b"
TTL = 15.0


def run(ex_id: str, event: int, attempt: int, pid: int, start: float, end: float | None,
        outcome: str | None = SUCCEEDED, owner: str = OWNER_A, *, lost_lease: bool = False,
        **kw: Any) -> Execution:
    """One execution that held its lease at start, and at its end unless ``lost_lease``."""
    finished = end is not None
    return Execution(
        execution=ex_id, event_id=event, attempt=attempt, pid=pid, started=start, finished=end,
        outcome=outcome if finished else None, lease_owner=owner, lease_attempt=attempt,
        lease_state="running", lease_expires=start + TTL,
        end_lease_owner=(None if lost_lease else owner) if finished else None,
        end_lease_attempt=(attempt + 1 if lost_lease else attempt) if finished else None,
        end_state=("pending" if lost_lease else "running") if finished else None, **kw)


def test_clean_history_is_ok() -> None:
    ledger = [run("a", 1, 1, 100, 0.0, 1.0), run("b", 2, 1, 100, 0.5, 1.5),
              run("c", 3, 1, 101, 0.0, 0.2, RAISED), run("d", 3, 2, 101, 5.0, 5.1)]
    report = check_records(ledger, {1: "succeeded", 2: "succeeded", 3: "succeeded"})
    assert report.ok, report.summary()
    assert (report.lost, report.unexpected, report.duplicated, report.overlapping) == (0, 0, 0, 0)
    assert report.retries == 1 and report.completed == 3


def test_each_anomaly_is_reported() -> None:
    states = {1: "succeeded", 2: "pending", 3: "succeeded", 4: "succeeded", 5: "succeeded",
              6: "succeeded"}
    ledger = [
        run("ok", 1, 1, 100, 0.0, 1.0),
        # 2: committed, never run -> lost
        # 3: ran twice, sequentially, the first holding its lease to the end on a live
        #    worker -> an unexplained duplicate (an acknowledgement vanished)
        run("dup1", 3, 1, 100, 0.0, 1.0), run("dup2", 3, 2, 101, 30.0, 31.0, owner=OWNER_B),
        # 4: the second started while the first's granted lease was still valid -> overlap
        run("ov1", 4, 1, 100, 0.0, 10.0), run("ov2", 4, 2, 101, 5.0, 6.0, owner=OWNER_B),
        # 5: first ran on a worker that was SIGKILLed -> an allowed duplicate, an orphan
        run("k1", 5, 1, 200, 0.0, None), run("k2", 5, 2, 101, 19.0, 19.5, owner=OWNER_B),
        # 6: a zombie: the first lost its lease (expired) and ran on while the second ran
        run("z1", 6, 1, 100, 0.0, 40.0, lost_lease=True),
        run("z2", 6, 2, 101, 20.0, 21.0, owner=OWNER_B),
        # 99: never committed -> unexpected
        run("u", 99, 1, 100, 0.0, 1.0),
    ]
    report = check_records(ledger, states, deaths={200: 2.0})
    assert not report.ok
    assert report.lost == 1 and report.lost_examples == [(2, "state pending, never run")]
    assert report.unexpected == 1 and report.unexpected_examples == [99]
    assert report.duplicated == 4
    # the overlap (4) is also a duplicate nothing explains
    assert report.unexplained_duplicates == 2 and report.unexplained_examples == [3, 4]
    assert report.overlapping == 1 and report.overlap_examples == [("ov1", "ov2")]
    assert report.zombie_overlaps == 1
    assert report.duplicates_after_kill == 1
    assert report.orphans == 1 and report.rerun_delays == [17.0]
    assert report.not_terminal == 1
    summary = report.summary()
    assert "lost 1" in summary and "unexpected 1" in summary and "overlapping 1" in summary


def test_committed_set_from_producers_and_missing_rows() -> None:
    ledger = [run("a", 1, 1, 100, 0.0, 1.0)]
    report = check_records(ledger, {1: "succeeded"}, committed=[1, 7])
    assert report.lost == 1 and report.lost_examples == [(7, "not in the events table")]


def test_cancelled_and_parked_events() -> None:
    ledger = [run("a", 1, 1, 100, 0.0, 1.0, CANCELLED), run("b", 1, 2, 100, 20.0, 21.0),
              run("c", 2, 1, 100, 0.0, 1.0, RAISED)]
    report = check_records(ledger, {1: "succeeded", 2: "failed"})
    assert report.ok, report.summary()
    assert report.allowed_duplicates == 1 and report.lost == 0


def test_a_partition_explains_a_rerun_only_of_what_it_cut_off() -> None:
    # Worker 100 finished events 1 and 2, then was cut off at t=10 until t=15:
    # event 2's acknowledgement (finished 0.5 s before the cut) never landed and
    # it ran again at 14; event 1 finished long before the cut, so its rerun is
    # still an acknowledgement that vanished.
    ledger = [run("a1", 1, 1, 100, 0.0, 1.0), run("a2", 1, 2, 101, 14.0, 14.1, owner=OWNER_B),
              run("b1", 2, 1, 100, 9.0, 9.5), run("b2", 2, 2, 101, 14.0, 14.2, owner=OWNER_B)]
    states = {1: "succeeded", 2: "succeeded"}
    report = check_records(ledger, states, partitions={100: [(10.0, 15.0)]})
    assert report.duplicated == 2 and report.duplicates_after_partition == 1
    assert report.unexplained_duplicates == 1 and report.unexplained_examples == [1]
    assert report.to_dict()["partition_rerun_max"] == 4.0
    # Without the partition, both are unexplained.
    assert check_records(ledger, states).unexplained_duplicates == 2


def test_start_without_lease_is_reported_not_fatal() -> None:
    stale = Execution(execution="a", event_id=1, attempt=2, pid=100, started=0.0, finished=1.0,
                      outcome=SUCCEEDED, lease_owner=None, lease_attempt=2, lease_state="pending")
    report = check_records([stale], {1: "succeeded"})
    assert report.started_without_lease == 1 and report.ok


def test_check_reads_a_real_ledger(fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        create_ledger(conn)
        ids = [r[0] for r in conn.execute(
            "INSERT INTO conveyor.events (topic, payload) SELECT 'chaos.x', '{}' "
            "FROM generate_series(1, 3) RETURNING id").fetchall()]
        conn.execute(
            "INSERT INTO public.conveyor_ledger (execution, event_id, attempt, worker_pid, host, "
            "started_at, finished_at, outcome, lease_owner, lease_attempt, lease_state, "
            "lease_expires_at, end_lease_owner, end_lease_attempt, end_state) VALUES "
            "(gen_random_uuid(), %s, 1, 1, 'h', now(), now(), 'succeeded', %s, 1, 'running', "
            "now() + interval '15 s', %s, 1, 'running')", (ids[0], OWNER_A, OWNER_A))
        conn.execute("UPDATE conveyor.events SET state = 'succeeded' WHERE id = %s", (ids[0],))
        report = check(conn)
    assert report.committed == 3 and report.lost == 2 and report.completed == 1
