"""The acknowledgement as statements (worker/acks.py): pure, checked without a database.

That the statements write what they say is tested where they run: the
completer's tests (tests/worker/) and ``work_event``'s (tests/test_testing.py).
"""

from __future__ import annotations

from conveyor.db.named_queries import queries_for
from conveyor.types import EventState
from conveyor.worker.acks import ack, finished_notice
from conveyor.worker.executor import Outcome

Q = queries_for("conveyor")
OWNER = "6a1f0000-0000-4000-8000-000000000000"


def _ok(event_id: int, **fields: object) -> Outcome:
    return Outcome(event_id, 1, EventState.SUCCEEDED, **fields)  # type: ignore[arg-type]


def test_plain_successes_are_one_statement_with_array_literals() -> None:
    plan = ack(Q, OWNER, [_ok(1), _ok(2)])
    assert plan.settle is None and plan.settled == []
    assert plan.statements == [(Q["event_succeed_many"],
                                {"owner": OWNER, "ids": "{1,2}", "attempts": "{1,1}"})]


def test_retention_zero_deletes_plain_successes() -> None:
    (query, _params), = ack(Q, OWNER, [_ok(1)], delete_succeeded=True).statements
    assert query == Q["event_delete_succeeded_many"]


def test_every_other_outcome_and_a_success_with_a_result_are_settled() -> None:
    retry = Outcome(3, 2, EventState.PENDING, delay=1.5, error="boom", traceback="tb")
    kept = _ok(4, result='{"n": 1}')
    plan = ack(Q, OWNER, [_ok(1), retry, kept])
    assert plan.succeed is not None and plan.succeed[1]["ids"] == "{1}"
    assert plan.settle is not None
    query, params = plan.settle
    assert query == Q["event_settle_many"]
    assert params == {"owner": OWNER, "ids": [3, 4], "attempts": [2, 1],
                      "states": ["pending", "succeeded"], "delays": [1.5, None],
                      "refunds": [0, 0], "errors": ["boom", None], "tracebacks": ["tb", None],
                      "results": [None, '{"n": 1}']}
    assert list(plan.settled) == [retry, kept]


def test_the_finished_notice_names_the_watched_final_outcomes_written() -> None:
    watched = _ok(1, result="1", watched=True)
    retried = Outcome(2, 1, EventState.PENDING, delay=1.0, watched=True)
    lost = _ok(3, result="3", watched=True)
    unwatched = _ok(4, result="4")
    notice = finished_notice(Q, [watched, retried, lost, unwatched], done={1, 2, 4})
    assert notice == (Q["event_notify_finished"], {"channel": Q.results_channel, "ids": [1]})
    assert finished_notice(Q, [unwatched], done={4}) is None
