"""The acknowledgement of finished attempts, as statements: pure, no I/O.

One batch of outcomes is written with at most two statements: every plain
success with ``event_succeed_many`` (or, under retention 0,
``event_delete_succeeded_many``), every other outcome with
``event_settle_many``. Both are fenced on (owner, attempt): a write for an
attempt that lost its lease changes nothing. The
:class:`~conveyor.worker.completer.Completer` runs them for the worker, and
``conveyor.testing.work_event`` for one event in the caller's transaction, so
a test acknowledges exactly as a worker does. A claim window
(:mod:`conveyor.worker.window`) writes its outcomes with the ``held``
statements: the same writes, fenced by the window's row locks instead of a
lease, each counting the attempt it writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.db.arrays import int_array
from conveyor.db.named_queries import Queries
from conveyor.types import FINAL_STATES, EventState
from conveyor.worker.classify import Outcome

Statement = tuple[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Ack:
    """The statements that acknowledge one batch; each returns the ids it wrote.

    ``settled``: the outcomes ``settle`` writes (the finished notification
    names the watched ones among them, :func:`finished_notice`).
    """

    succeed: Statement | None
    settle: Statement | None
    settled: Sequence[Outcome]

    @property
    def statements(self) -> list[Statement]:
        return [s for s in (self.succeed, self.settle) if s is not None]


_LEASED = {"succeed": "event_succeed_many", "delete": "event_delete_succeeded_many",
           "settle": "event_settle_many"}
_HELD = {"succeed": "event_succeed_held", "delete": "event_delete_succeeded_held",
         "settle": "event_settle_held"}


def ack(queries: Queries, owner: str, batch: Sequence[Outcome], *,
        delete_succeeded: bool = False, held: bool = False) -> Ack:
    """The statements that write ``batch`` for the lease owner ``owner``; ``held``:
    attempts a claim window holds (windows.sql), written in its transaction."""
    names = _HELD if held else _LEASED
    # A success with a result to keep is written with the other outcomes:
    # never deleted at once under retention 0, and its result stored.
    others = [o for o in batch if o.state is not EventState.SUCCEEDED or o.result is not None]
    succeeded = [o for o in batch if o.state is EventState.SUCCEEDED and o.result is None] \
        if others else batch
    succeed = settle = None
    if succeeded:
        succeed = (queries[names["delete" if delete_succeeded else "succeed"]], {
            "owner": owner,
            # Integer arrays as array literals: psycopg's per-element list
            # adaptation cost more than the statement itself on large batches.
            "ids": int_array(o.event_id for o in succeeded),
            "attempts": int_array(o.attempt for o in succeeded),
        })
    if others:
        settle = (queries[names["settle"]], {
            "owner": owner,
            "ids": [o.event_id for o in others],
            "attempts": [o.attempt for o in others],
            "states": [o.state.value for o in others],
            "delays": [o.delay for o in others],
            "refunds": [o.refund for o in others],
            "errors": [o.error for o in others],
            "tracebacks": [o.traceback for o in others],
            "results": [o.result for o in others],
        })
    return Ack(succeed, settle, others)


def finished_notice(queries: Queries, settled: Iterable[Outcome],
                    done: set[int]) -> Statement | None:
    """The NOTIFY for watched events that reached a final state, once written (``done``)."""
    finished = [o.event_id for o in settled
                if o.watched and o.event_id in done and o.state in FINAL_STATES]
    if not finished:
        return None
    return queries["event_notify_finished"], {"channel": queries.results_channel, "ids": finished}
