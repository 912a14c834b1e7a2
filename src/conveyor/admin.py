# Generated from src/conveyor/admin_async.py by scripts/unasync.py; DO NOT EDIT.
"""Operator operations: status, show, events, retry, cancel, prune, pause.

Each method joins the transaction of the connection you pass, as the
producers do. The statements run here; parameters, checks, decoding and the
bulk flows are the I/O-free core in :mod:`conveyor.admin_core` (what ``status``
computes: :mod:`conveyor.admin_status`). The pauses and cron schedules are
methods of :mod:`conveyor.admin_controls_async`, which the admin inherits.

``conveyor/admin_async.py`` is the source people edit; ``conveyor/admin.py``
is its sync twin, generated from it by ``scripts/unasync.py``.

Example::

    with psycopg.connect(dsn, autocommit=True) as conn:
        admin = Admin()
        print(admin.status(conn).counts)
        admin.retry_failed(conn, topic="email.send")
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from datetime import datetime
from typing import Any, TypeVar, cast

import psycopg
from psycopg.rows import dict_row

from conveyor.admin_async import AsyncAdmin as AsyncAdmin
from conveyor.admin_controls import AdminControls
from conveyor.admin_core import (
    LIST_LIMIT_MAX,
    PRUNE_DEFAULT_STATES,
    Rows,
    Step,
    _already_cancelled,
    _cancel_flow,
    _check_after,
    _check_filter,
    _check_limit,
    _check_newest,
    _count_step,
    _list_flow,
    _not_changed,
    _page,
    _prune_params,
    _report,
    _reschedule_params,
    _retry_flow,
)
from conveyor.admin_history import AdminHistory
from conveyor.admin_results import AdminResults
from conveyor.admin_status import (
    FAILED_EXACT_LIMIT,
    FAILED_TOPIC_EXACT_LIMIT,
    SCHEDULED,
    WORKER_ALIVE_WITHIN,
    estimate_params,
    failed_cap,
    needs_estimate,
    queue_status,
)
from conveyor.admin_workflows import AdminWorkflows
from conveyor.db.execute import execute_past_moves, run, run_past_moves
from conveyor.db.named_queries import queries_for
from conveyor.db.rows import record_from_event_get_row
from conveyor.errors import EventNotFoundError, InvalidInputError
from conveyor.filters import EventFilter
from conveyor.notify import WAKE_ALL, result_payload, wake_payload
from conveyor.records import EventPage, EventRecord, QueueStatus
from conveyor.validation import check_event_id, check_schema_name, check_topic

__all__ = [
    "EXACT_FINISHED_LIMIT",
    "FAILED_EXACT_LIMIT",
    "FAILED_TOPIC_EXACT_LIMIT",
    "LIST_LIMIT_MAX",
    "MATCH_BATCH",
    "PRUNE_BATCH",
    "PRUNE_DEFAULT_STATES",
    "SCHEDULED",
    "WORKER_ALIVE_WITHIN",
    "Admin",
]

# Up to this many succeeded and cancelled rows, they are counted exactly (by
# reading them through events_prunable_idx, which holds only them); beyond it
# they are estimated from the planner's statistics, so a status call never
# reads the bulk of the table.
EXACT_FINISHED_LIMIT = 10_000

# prune deletes at most this many events per DELETE.
PRUNE_BATCH = 10_000

# retry_matching and cancel_matching change at most this many events per UPDATE.
MATCH_BATCH = 1000

# What a flow returns (_run_flow).
_T = TypeVar("_T")


def _fetch(conn: psycopg.Connection[Any], query: str,
                       params: dict[str, Any]) -> Rows:
    """Rows by column name; unprepared, so each call is planned for its own values.

    Run once more if a row it waited for was moved into the history meanwhile
    (:func:`~conveyor.db.execute.execute_past_moves` says why).
    """
    cur = conn.cursor(row_factory=dict_row)
    try:
        execute_past_moves(conn, cur, query, params, prepare=False)
    except (psycopg.errors.SyntaxError, psycopg.errors.InvalidTextRepresentation) as exc:
        # The one value the server parses for us: a payload path PostgreSQL rejects.
        if params.get("payload") is None:
            raise
        raise InvalidInputError(f"invalid payload path {params['payload']!r}: "
                                f"{exc.diag.message_primary or exc}") from None
    return cur.fetchall()


def _run_flow(conn: psycopg.Connection[Any],
                          flow: Generator[Step, Rows, _T]) -> _T:
    """Run an I/O-free flow: send each step's rows back until it returns."""
    try:
        step = next(flow)
        while True:
            step = flow.send(_fetch(conn, *step))
    except StopIteration as stop:
        result: _T = stop.value
        return result


class Admin(AdminControls, AdminWorkflows, AdminHistory,
                 AdminResults):
    """Operator operations on the connection you pass, in its transaction.

    The pauses and cron schedules (``pause``, ``resume``, ``paused``,
    ``schedules``, ``remove_schedule``) come from :class:`AdminControls`,
    a workflow's graph and a step's dependencies (``workflow``,
    ``dependencies``) from :class:`AdminWorkflows`, the history's
    partitions (``history``, ``set_history_span``) from
    :class:`AdminHistory`.

    ``schema``: the schema holding Conveyor's tables. Defaults to ``"conveyor"``.
    """

    def __init__(self, schema: str = "conveyor") -> None:
        self._q = queries_for(check_schema_name(schema))

    def status(self, conn: psycopg.Connection[Any], *,
                     bounded: bool = False) -> QueueStatus:
        """Counts by state and topic, oldest due pending age, live workers.

        ``counts["pending"]`` is the events due now and ``counts["scheduled"]``
        the pending ones not yet due (``TopicCount.scheduled`` per topic).

        Pending, running and failed counts are exact; succeeded and cancelled
        are exact up to ``EXACT_FINISHED_LIMIT`` finished rows and estimated
        beyond (listed in ``QueueStatus.estimated_states``, left out of
        ``by_topic``). No call reads the bulk of the finished rows.

        ``bounded``: count the failed events exactly only up to
        ``FAILED_EXACT_LIMIT``; beyond it ``counts["failed"]`` is that bound
        (listed in ``QueueStatus.capped_states``) and each topic's count is
        exact up to ``FAILED_TOPIC_EXACT_LIMIT`` (``TopicCount.capped`` past
        it), so the call costs the same however many events failed (what
        the dashboard's overview shows). Defaults to False: every failed
        event counted.
        """
        q = self._q
        open_rows, failed_total = self._open_rows(conn, bounded)
        cur = run(conn, q["status_finished_sample"], {"limit": EXACT_FINISHED_LIMIT + 1})
        sample = cur.fetchall()
        estimate = None
        if needs_estimate(sample, EXACT_FINISHED_LIMIT):
            cur = run(conn, q["status_table_estimate"], estimate_params(q))
            estimate = cur.fetchone()
        oldest_row = (run(conn, q["status_oldest_due_age"])).fetchone()
        cur = run(conn, q["worker_list_alive"], {"within": WORKER_ALIVE_WITHIN})
        workers = cur.fetchall()
        return queue_status(open_rows, sample, estimate, oldest_row[0] if oldest_row else None,
                            workers, EXACT_FINISHED_LIMIT, failed_total)

    def _open_rows(self, conn: psycopg.Connection[Any],
                         bounded: bool) -> tuple[list[Any], int | None]:
        """The open counts' rows, and for a bounded status the failed events'
        total counted up to ``FAILED_EXACT_LIMIT + 1`` (None: counted exactly)."""
        q = self._q
        if not bounded:
            return (run(conn, q["status_open_counts"])).fetchall(), None
        rows = (run(conn, q["status_open_counts_but_failed"])).fetchall()
        cur = run(conn, q["status_failed_total_bounded"], {"limit": FAILED_EXACT_LIMIT})
        total_row = cur.fetchone()
        total = int(total_row[0]) if total_row else 0
        if total:
            cur = run(conn, q["status_failed_bounded"], {"cap": failed_cap(total)})
            rows += cur.fetchall()
        return rows, total

    def show(self, conn: psycopg.Connection[Any], event_id: int) -> EventRecord:
        """One event with its whole row, error history included.

        Raises EventNotFoundError for an unknown id.
        """
        event_id = check_event_id(event_id)
        row = (run(conn, self._q["event_get"], {"id": event_id})).fetchone()
        if row is None:
            raise EventNotFoundError(f"event {event_id} not found")
        return record_from_event_get_row(row)

    def events(self, conn: psycopg.Connection[Any], filter: EventFilter | None = None,
                     *, after: int | None = None, limit: int = 50,
                     newest: int | None = None) -> EventPage:
        """One page of the events ``filter`` matches, newest first (``id`` descending).

        Pass the page's ``next_after`` as ``after`` for the next page; it is
        None on the last page. Events enqueued meanwhile have higher ids and
        never appear on later pages, so paging visits each event at most once.

        Example::

            failed_mail = EventFilter(states=("failed",), topic="email.*")
            page = admin.events(conn, failed_mail)
            while page.next_after is not None:
                page = admin.events(conn, failed_mail, after=page.next_after)

        ``limit``: 1 to 1000; defaults to 50. ``filter`` defaults to None (every event).
        ``newest``: look only at the newest this many ids (the events with an
        id above the highest one minus ``newest``), so a filter no index
        serves (``error``, ``payload``) reads at most that many rows even
        when it matches nothing; defaults to None (every event).
        """
        filter, after, limit = _check_filter(filter), _check_after(after), _check_limit(limit)
        rows = _run_flow(conn, _list_flow(self._q, filter, after, limit + 1,
                                                      newest=_check_newest(newest)))
        return _page(rows, limit)

    def retry(self, conn: psycopg.Connection[Any], event_id: int) -> None:
        """Run a failed, cancelled or scheduled event again now."""
        event_id = check_event_id(event_id)
        cur = run(conn, self._q["event_retry"], {"id": event_id})
        if cur.fetchone() is None:
            cur = run(conn, self._q["event_state"], {"id": event_id})
            raise _not_changed(self._q, event_id, cur.fetchone(), "retried",
                               "failed, cancelled or pending")
        self._notify(conn)

    def reschedule(self, conn: psycopg.Connection[Any], event_id: int, *,
                         run_at: datetime | None = None, delay: float | None = None) -> datetime:
        """Make a pending, failed or cancelled event due at ``run_at`` (a timezone-aware
        datetime) or ``delay`` seconds from now (give one); returns its new due time.

        A failed or cancelled event becomes pending again, with one more
        attempt if all are spent (as :meth:`retry`). The workers hear of it at
        commit: a due event is claimed at once, a later one when it falls due.
        Raises InvalidStateError for a running or succeeded event,
        EventNotFoundError for an unknown id.
        """
        event_id = check_event_id(event_id)
        params = _reschedule_params(event_id, run_at, delay)
        cur = run(conn, self._q["event_reschedule"], params)
        row = cur.fetchone()
        if row is None:
            cur = run(conn, self._q["event_state"], {"id": event_id})
            raise _not_changed(self._q, event_id, cur.fetchone(), "rescheduled",
                               "pending, failed or cancelled")
        _id, topic, due, due_epoch, due_now = row
        run(conn, self._q["event_notify"], {
            "channel": self._q.channel, "payload": wake_payload(topic, None if due_now else due_epoch)})
        return cast(datetime, due)

    def retry_failed(self, conn: psycopg.Connection[Any],
                           topic: str | None = None) -> list[int]:
        """Retry every failed event (of one topic); returns their ids."""
        if topic is not None:
            check_topic(topic)
        cur = run(conn, self._q["event_retry_failed"], {"topic": topic})
        ids = [r[0] for r in cur.fetchall()]
        if ids:
            self._notify(conn)
        return ids

    def retry_matching(self, conn: psycopg.Connection[Any], filter: EventFilter, *,
                             dry_run: bool = False) -> list[int]:
        """Make every matching failed, cancelled or scheduled event due now, as ``retry`` does.

        Returns the ids changed, newest first (with ``dry_run``, the ids that
        would change, changing nothing). Works in batches of ``MATCH_BATCH``
        ids, each one UPDATE; on an autocommit connection each batch commits
        on its own. One NOTIFY wakes the workers at the end. An empty filter
        is refused: say ``states=("failed",)`` to retry every failed event.

        Example::

            admin.retry_matching(conn, EventFilter(states=("failed",), topic="email.*"))
        """
        ids = _run_flow(conn, _retry_flow(self._q, filter, dry_run, MATCH_BATCH))
        if ids and not dry_run:
            self._notify(conn)
        return ids

    def cancel_matching(self, conn: psycopg.Connection[Any], filter: EventFilter, *,
                              dry_run: bool = False) -> list[int]:
        """Cancel every matching pending, running or failed event; returns their ids.

        Batches, ``dry_run`` and the refusal of an empty filter as in
        :meth:`retry_matching`. A running event's late result is discarded.
        """
        return _run_flow(conn, _cancel_flow(self._q, filter, dry_run, MATCH_BATCH))

    def count_matching(self, conn: psycopg.Connection[Any], filter: EventFilter, *,
                             action: str) -> int:
        """How many events ``retry_matching`` (``action="retry"``) or
        ``cancel_matching`` (``"cancel"``) would change now, counted in one statement.

        The same filter, states and refusals as those methods; what a bulk
        action's confirmation shows. Rows may change state before the action
        runs: its own result is the exact number changed.
        """
        rows = _fetch(conn, *_count_step(self._q, filter, action))
        return int(rows[0]["n"])

    def cancel(self, conn: psycopg.Connection[Any], event_id: int) -> None:
        """Cancel a pending, running or failed event; a running one's result is discarded.

        Cancelling an event that is already cancelled does nothing; a succeeded
        one raises InvalidStateError, an unknown id EventNotFoundError.
        """
        event_id = check_event_id(event_id)
        # A running event's success may be written (and the row moved into
        # the history) while this waits for its lock.
        cur = run_past_moves(conn, self._q["event_cancel"], {"id": event_id})
        if cur.fetchone() is None:
            cur = run(conn, self._q["event_state"], {"id": event_id})
            state = cur.fetchone()
            if _already_cancelled(state):
                return
            raise _not_changed(self._q, event_id, state, "cancelled",
                               "pending, running or failed")
        # Delivered at commit: whoever waits for this event hears of its end.
        run(conn, self._q["event_notify"],
                        {"channel": self._q.results_channel, "payload": result_payload(event_id)})

    def prune(self, conn: psycopg.Connection[Any], older_than: float,
                    states: Sequence[str] | None = None, *, dry_run: bool = False,
                    progress: Callable[[int], None] | None = None) -> int:
        """Delete finished events older than ``older_than`` seconds; returns the count.

        ``states``: which finished states go; defaults to None, meaning
        succeeded and cancelled: failed events are deleted only when
        ``"failed"`` is listed. Deletes in batches of ``PRUNE_BATCH`` rows;
        ``progress(total_so_far)`` is called after each. With ``dry_run``
        nothing is deleted and the count is what would go, read through the
        same indexes (``progress`` is called once, with it).

        Example::

            admin.prune(conn, older_than=30 * 86_400, states=["failed"], dry_run=True)
        """
        params = _prune_params(older_than, states, progress, PRUNE_BATCH)
        if dry_run:
            row = (run(conn, self._q["event_prune_count"], params)).fetchone()
            return _report(progress, int(row[0]) if row else 0)
        total = 0
        while True:
            cur = run(conn, self._q["event_prune"], params)
            total = _report(progress, total + cur.rowcount)
            if cur.rowcount < PRUNE_BATCH:
                return total

    def _notify(self, conn: psycopg.Connection[Any]) -> None:
        run(conn, self._q["event_notify"], {"channel": self._q.channel, "payload": WAKE_ALL})
