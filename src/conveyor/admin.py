"""Operator operations: status, show, events, retry, cancel, prune.

:class:`Admin` works on a sync connection and :class:`AsyncAdmin` mirrors it
on an async one; both join the caller's transaction like the producers do.

Example::

    with psycopg.connect(dsn, autocommit=True) as conn:
        admin = Admin()
        print(admin.status(conn).counts)
        admin.retry_failed(conn, topic="email.send")
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row

from conveyor.db.execute import run, run_async
from conveyor.db.named_queries import Queries, queries_for
from conveyor.db.rows import record_from_event_get_row, worker_from_row
from conveyor.errors import EventNotFoundError, InvalidInputError, InvalidStateError
from conveyor.router import patterns_match
from conveyor.types import (
    FINISHED_STATES,
    EventFilter,
    EventPage,
    EventRecord,
    EventState,
    EventSummary,
    QueueStatus,
    TopicCount,
)
from conveyor.validation import (
    DELAY_MAX_SECONDS,
    check_event_id,
    check_schema_name,
    check_topic,
)

# A worker that has not renewed its heartbeat for this long is not counted alive.
WORKER_ALIVE_WITHIN = 30.0


# Up to this many succeeded and cancelled rows, they are counted exactly (by
# reading them through events_prunable_idx, which holds only them); beyond it
# they are estimated from the planner's statistics, so a status call never
# reads the bulk of the table.
EXACT_FINISHED_LIMIT = 10_000

# The states whose counts may be estimates; pending, running and failed are
# always exact (each has a partial index holding only its rows).
ESTIMABLE_STATES = (EventState.SUCCEEDED.value, EventState.CANCELLED.value)


def _estimate_finished(estimate: Sequence[Any] | None, open_total: int,
                       floor: dict[str, int]) -> dict[str, int]:
    """Succeeded and cancelled counts from the planner's statistics.

    Finished-but-not-failed rows = estimated live rows - the exact open and
    failed counts, split by the states' shares in pg_stats (all succeeded when
    neither share is known), and never below what the sample already saw.
    """
    live_rows, states, shares = estimate if estimate is not None else (None, None, None)
    finished = max(0.0, float(live_rows or 0) - open_total)
    share = dict(zip(states or [], shares or [], strict=False))
    succeeded_share = share.get(EventState.SUCCEEDED.value, 0.0)
    cancelled_share = share.get(EventState.CANCELLED.value, 0.0)
    if succeeded_share + cancelled_share <= 0:
        succeeded_share = 1.0
    succeeded = round(finished * succeeded_share / (succeeded_share + cancelled_share))
    cancelled = round(finished) - succeeded
    return {EventState.SUCCEEDED.value: max(succeeded, floor[EventState.SUCCEEDED.value]),
            EventState.CANCELLED.value: max(cancelled, floor[EventState.CANCELLED.value])}


# The key of QueueStatus.counts (and TopicCount.scheduled) for pending events
# whose run_at is still in the future: not an EventState, a part of pending.
SCHEDULED = "scheduled"


def _empty_counts() -> dict[str, int]:
    """Every count at 0, "scheduled" right after "pending" (the order status prints)."""
    counts = {EventState.PENDING.value: 0, SCHEDULED: 0}
    counts.update({s.value: 0 for s in EventState if s is not EventState.PENDING})
    return counts


def _status(open_rows: Sequence[Sequence[Any]], sample: Sequence[Sequence[Any]],
            estimate: Sequence[Any] | None, oldest: float | None,
            workers: Sequence[Sequence[Any]]) -> QueueStatus:
    counts = _empty_counts()
    per_topic: dict[tuple[str, str], int] = {}
    scheduled_per_topic: dict[str, int] = {}
    due_pairs = set()
    for topic, tenant, state, n in open_rows:
        counts[state] += n
        if state == SCHEDULED:
            # A pending row of its topic, due count 0 unless due events add to it.
            per_topic.setdefault((topic, EventState.PENDING.value), 0)
            scheduled_per_topic[topic] = scheduled_per_topic.get(topic, 0) + n
            continue
        per_topic[topic, state] = per_topic.get((topic, state), 0) + n
        if state == EventState.PENDING.value:
            due_pairs.add((topic, tenant))
    seen = dict.fromkeys(ESTIMABLE_STATES, 0)
    seen_per_topic: dict[tuple[str, str], int] = {}
    for state, topic, n in sample:
        if state in seen:      # the sample holds only these states (0003)
            seen[state] += n
            seen_per_topic[topic, state] = n
    estimated: list[str] = []
    if not _needs_estimate(sample):
        counts.update(seen)               # the sample held every finished row
        per_topic.update(seen_per_topic)
    else:
        counts.update(_estimate_finished(estimate, sum(counts.values()), seen))
        estimated = list(ESTIMABLE_STATES)
    by_topic = [TopicCount(topic, EventState(state), n,
                           scheduled_per_topic.get(topic, 0) if state == "pending" else 0)
                for (topic, state), n in sorted(per_topic.items())]
    infos = [worker_from_row(w) for w in workers]

    def claimable(topic: str, tenant: str | None) -> bool:
        return any(patterns_match(w.topics, topic)
                   and (w.tenants is None or tenant in w.tenants) for w in infos)

    # A topic is unhandled when some tenant's due events of it have no live
    # worker allowed to claim them (a tenant-limited worker covers only its own).
    # Events not yet due wait anyway: a worker started before they fall due is in time.
    unhandled = sorted({topic for topic, tenant in due_pairs if not claimable(topic, tenant)})
    return QueueStatus(counts=counts, by_topic=by_topic, oldest_pending_age_s=oldest,
                       workers=infos, unhandled_topics=unhandled, estimated_states=estimated)


def _needs_estimate(sample: Sequence[Sequence[Any]]) -> bool:
    return sum(int(row[2]) for row in sample) > EXACT_FINISHED_LIMIT


def _estimate_params(q: Queries) -> dict[str, Any]:
    return {"schema": q.schema, "table": q.events_table}


# What prune deletes when no states are given: what the workers' own pruning
# deletes. Failed events wait for an operator and go only when asked for.
PRUNE_DEFAULT_STATES = (EventState.CANCELLED.value, EventState.SUCCEEDED.value)


def _prune_states(states: Sequence[str] | None) -> list[str]:
    if states is None:
        return list(PRUNE_DEFAULT_STATES)
    if isinstance(states, str):
        raise InvalidInputError(
            f"expected states to be a list of states such as ['failed'], got {states!r:.60}")
    out = []
    for s in states:
        try:
            state = EventState(s)
        except ValueError:
            raise InvalidInputError(f"unknown state {s!r}") from None
        if state not in FINISHED_STATES:
            raise InvalidInputError(
                f"only finished events can be pruned; {state.value!r} is not finished")
        out.append(state.value)
    return out


def _older_than(seconds: object) -> float:
    value: float | None = None
    if isinstance(seconds, int | float) and not isinstance(seconds, bool):
        try:
            value = float(seconds)
        except OverflowError:
            value = None
    if value is None or not 0 <= value <= DELAY_MAX_SECONDS:
        raise InvalidInputError(
            f"older_than must be a number of seconds from 0 to {DELAY_MAX_SECONDS:.0f}"
            f" (100 years), got {seconds!r:.60}")
    return value


def _prune_params(older_than: object, states: Sequence[str] | None,
                  progress: object) -> dict[str, Any]:
    if progress is not None and not callable(progress):
        raise InvalidInputError(f"expected progress to be callable, got {progress!r:.60}")
    return {"older_than": _older_than(older_than), "states": _prune_states(states),
            "limit": PRUNE_BATCH}


def _already_cancelled(state_row: Sequence[Any] | None) -> bool:
    return state_row is not None and state_row[0] == EventState.CANCELLED.value


def _not_changed(q: Queries, event_id: int, state_row: Sequence[Any] | None, action: str,
                 allowed: str) -> Exception:
    if state_row is None:
        return EventNotFoundError(f"event {event_id} not found")
    return InvalidStateError(
        f"event {event_id} is {state_row[0]}; only {allowed} events can be {action}")


PRUNE_BATCH = 10_000


def _report(progress: Callable[[int], None] | None, total: int) -> int:
    if progress is not None:
        progress(total)
    return total

# The largest page Admin.events returns.
LIST_LIMIT_MAX = 1000


def _fetch(conn: psycopg.Connection[Any], query: str,
           params: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows by column name; unprepared, so each call is planned for its own values."""
    cur = conn.cursor(row_factory=dict_row)
    cur.execute(query, params, prepare=False)
    return cur.fetchall()


async def _fetch_async(conn: psycopg.AsyncConnection[Any], query: str,
                       params: dict[str, Any]) -> list[dict[str, Any]]:
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(query, params, prepare=False)
    return await cur.fetchall()


def _summary_from_row(row: Mapping[str, Any]) -> EventSummary:
    """An :class:`EventSummary` from one ``event_list`` row, read by column name."""
    return EventSummary(
        id=row["id"], tenant=row["tenant"], topic=row["topic"], state=EventState(row["state"]),
        attempts=row["attempts"], max_attempts=row["max_attempts"], priority=row["priority"],
        run_at=row["run_at"], created_at=row["created_at"], updated_at=row["updated_at"],
        last_error=row["last_error"])


def _check_filter(filter: object) -> EventFilter:
    if filter is None:
        return EventFilter()
    if not isinstance(filter, EventFilter):
        raise InvalidInputError(f"expected filter to be an EventFilter, got {filter!r:.60}")
    return filter


def _check_limit(limit: object) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= LIST_LIMIT_MAX:
        raise InvalidInputError(
            f"expected limit to be an integer from 1 to {LIST_LIMIT_MAX}, got {limit!r:.60}")
    return limit


def _check_after(after: object) -> int | None:
    if after is None:
        return None
    if isinstance(after, str):
        raise InvalidInputError(f"invalid after {after!r:.60}: expected an event id (an integer)")
    try:
        return check_event_id(after)
    except InvalidInputError as exc:
        raise InvalidInputError(f"after: {exc}") from None


def _list_params(filter: EventFilter, after: int | None, limit: int, *,
                 states: Sequence[str] | None = None,
                 scheduled_pending_only: bool = False) -> dict[str, Any]:
    """``event_list``'s parameters; an unset filter field binds the value that folds away."""
    topic = filter.topic
    exact = prefix = None
    if topic is not None and topic != "*":
        if topic.endswith(".*"):
            prefix = topic[:-1]          # "email." ... "email/": '/' follows '.' in byte order
        else:
            exact = topic
    return {
        "after": after, "ids": list(filter.ids),
        "states": list(filter.states if states is None else states),
        "topic": exact, "topic_from": prefix,
        "topic_to": None if prefix is None else prefix[:-1] + "/",
        "tenant": filter.tenant, "older_than": filter.older_than,
        "newer_than": filter.newer_than, "error": filter.error,
        "scheduled_pending_only": scheduled_pending_only, "limit": limit,
    }


# retry_matching and cancel_matching change at most this many events per UPDATE.
MATCH_BATCH = 1000

# The states each bulk action can change (retry: pending only while scheduled).
RETRYABLE_STATES = ("pending", "failed", "cancelled")
CANCELLABLE_STATES = ("pending", "running", "failed")

# A step of an I/O-free flow: a query and its parameters; the driver sends back the rows.
Step = tuple[str, dict[str, Any]]
Rows = list[dict[str, Any]]


def _check_matching(filter: object) -> EventFilter:
    if filter is None or (isinstance(filter, EventFilter) and filter.is_empty()):
        raise InvalidInputError(
            "give at least one filter: an empty one matches every event; say"
            " states=('failed',) or topic='*' to mean all of them")
    return _check_filter(filter)


def _matching_states(filter: EventFilter, allowed: tuple[str, ...], action: str) -> list[str]:
    for state in filter.states:
        if state not in allowed:
            raise InvalidInputError(
                f"{state!r} events cannot be {action}; only {', '.join(allowed)} events can")
    return list(filter.states or allowed)


def _matching_flow(q: Queries, filter: EventFilter, update: str, states: list[str], *,
                   scheduled_pending_only: bool, dry_run: bool,
                   ) -> Generator[Step, Rows, list[int]]:
    """The batches of a bulk action, newest first: select up to MATCH_BATCH matching
    ids (keyset on id), then change them (the UPDATE checks each row's state again).
    Changed rows stop matching or lie past the keyset, so none is visited twice."""
    changed: list[int] = []
    after = None
    while True:
        rows = yield q["event_list"], _list_params(
            filter, after, MATCH_BATCH, states=states,
            scheduled_pending_only=scheduled_pending_only)
        ids = [r["id"] for r in rows]
        if ids and not dry_run:
            done = yield q[update], {"ids": ids, "states": states}
            ids = sorted((r["id"] for r in done), reverse=True)
        changed += ids
        if len(rows) < MATCH_BATCH:
            return changed
        after = rows[-1]["id"]


def _run_flow(conn: psycopg.Connection[Any], flow: Generator[Step, Rows, list[int]]) -> list[int]:
    try:
        step = next(flow)
        while True:
            step = flow.send(_fetch(conn, *step))
    except StopIteration as stop:
        result: list[int] = stop.value
        return result


async def _run_flow_async(conn: psycopg.AsyncConnection[Any],
                          flow: Generator[Step, Rows, list[int]]) -> list[int]:
    try:
        step = next(flow)
        while True:
            step = flow.send(await _fetch_async(conn, *step))
    except StopIteration as stop:
        result: list[int] = stop.value
        return result


def _retry_flow(q: Queries, filter: object, dry_run: bool) -> Generator[Step, Rows, list[int]]:
    checked = _check_matching(filter)
    states = _matching_states(checked, RETRYABLE_STATES, "retried")
    return _matching_flow(q, checked, "event_retry_ids", states, scheduled_pending_only=True,
                          dry_run=dry_run)


def _cancel_flow(q: Queries, filter: object, dry_run: bool) -> Generator[Step, Rows, list[int]]:
    checked = _check_matching(filter)
    states = _matching_states(checked, CANCELLABLE_STATES, "cancelled")
    return _matching_flow(q, checked, "event_cancel_ids", states, scheduled_pending_only=False,
                          dry_run=dry_run)


def _page(rows: Sequence[Mapping[str, Any]], limit: int) -> EventPage:
    """A page from up to ``limit + 1`` rows: the extra row only says another page exists."""
    events = [_summary_from_row(r) for r in rows[:limit]]
    return EventPage(events=events, next_after=events[-1].id if len(rows) > limit else None)


class Admin:
    """Operator operations on a sync connection."""

    def __init__(self, schema: str = "conveyor") -> None:
        self._q = queries_for(check_schema_name(schema))

    def status(self, conn: psycopg.Connection[Any]) -> QueueStatus:
        """Counts by state and topic, oldest due pending age, live workers.

        ``counts["pending"]`` is the events due now and ``counts["scheduled"]``
        the pending ones not yet due (``TopicCount.scheduled`` per topic).

        Pending, running and failed counts are exact; succeeded and cancelled
        are exact up to ``EXACT_FINISHED_LIMIT`` finished rows and estimated
        beyond (listed in ``QueueStatus.estimated_states``, left out of
        ``by_topic``). No call reads the bulk of the finished rows.
        """
        q = self._q
        open_rows = run(conn, q["status_open_counts"]).fetchall()
        sample = run(conn, q["status_finished_sample"],
                     {"limit": EXACT_FINISHED_LIMIT + 1}).fetchall()
        estimate = (run(conn, q["status_table_estimate"], _estimate_params(q)).fetchone()
                    if _needs_estimate(sample) else None)
        oldest_row = run(conn, q["status_oldest_due_age"]).fetchone()
        workers = run(conn, q["worker_list_alive"], {"within": WORKER_ALIVE_WITHIN}).fetchall()
        return _status(open_rows, sample, estimate, oldest_row[0] if oldest_row else None,
                       workers)

    def show(self, conn: psycopg.Connection[Any], event_id: int) -> EventRecord:
        event_id = check_event_id(event_id)
        row = run(conn, self._q["event_get"], {"id": event_id}).fetchone()
        if row is None:
            raise EventNotFoundError(f"event {event_id} not found")
        return record_from_event_get_row(row)

    def events(self, conn: psycopg.Connection[Any], filter: EventFilter | None = None, *,
               after: int | None = None, limit: int = 50) -> EventPage:
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
        """
        filter, after, limit = _check_filter(filter), _check_after(after), _check_limit(limit)
        rows = _fetch(conn, self._q["event_list"], _list_params(filter, after, limit + 1))
        return _page(rows, limit)

    def retry(self, conn: psycopg.Connection[Any], event_id: int) -> None:
        """Run a failed, cancelled or scheduled event again now."""
        event_id = check_event_id(event_id)
        if run(conn, self._q["event_retry"], {"id": event_id}).fetchone() is None:
            state = run(conn, self._q["event_state"], {"id": event_id}).fetchone()
            raise _not_changed(self._q, event_id, state, "retried",
                               "failed, cancelled or pending")
        self._notify(conn)

    def retry_failed(self, conn: psycopg.Connection[Any], topic: str | None = None) -> list[int]:
        """Retry every failed event (of one topic); returns their ids."""
        if topic is not None:
            check_topic(topic)
        ids = [r[0] for r in run(conn, self._q["event_retry_failed"], {"topic": topic})]
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
        ids = _run_flow(conn, _retry_flow(self._q, filter, dry_run))
        if ids and not dry_run:
            self._notify(conn)
        return ids

    def cancel_matching(self, conn: psycopg.Connection[Any], filter: EventFilter, *,
                        dry_run: bool = False) -> list[int]:
        """Cancel every matching pending, running or failed event; returns their ids.

        Batches, ``dry_run`` and the refusal of an empty filter as in
        :meth:`retry_matching`. A running event's late result is discarded.
        """
        return _run_flow(conn, _cancel_flow(self._q, filter, dry_run))

    def cancel(self, conn: psycopg.Connection[Any], event_id: int) -> None:
        """Cancel a pending, running or failed event; a running one's result is discarded.

        Cancelling an event that is already cancelled does nothing; a succeeded
        one raises InvalidStateError, an unknown id EventNotFoundError.
        """
        event_id = check_event_id(event_id)
        if run(conn, self._q["event_cancel"], {"id": event_id}).fetchone() is None:
            state = run(conn, self._q["event_state"], {"id": event_id}).fetchone()
            if _already_cancelled(state):
                return
            raise _not_changed(self._q, event_id, state, "cancelled",
                               "pending, running or failed")

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
        params = _prune_params(older_than, states, progress)
        if dry_run:
            row = run(conn, self._q["event_prune_count"], params).fetchone()
            return _report(progress, int(row[0]) if row else 0)
        total = 0
        while True:
            cur = run(conn, self._q["event_prune"], params)
            total = _report(progress, total + cur.rowcount)
            if cur.rowcount < PRUNE_BATCH:
                return total

    def _notify(self, conn: psycopg.Connection[Any]) -> None:
        run(conn, self._q["event_notify"], {"channel": self._q.channel, "payload": "*"})


class AsyncAdmin:
    """The async mirror of :class:`Admin`."""

    def __init__(self, schema: str = "conveyor") -> None:
        self._q = queries_for(check_schema_name(schema))

    async def status(self, conn: psycopg.AsyncConnection[Any]) -> QueueStatus:
        q = self._q
        open_rows = await (await run_async(conn, q["status_open_counts"])).fetchall()
        sample = await (await run_async(conn, q["status_finished_sample"],
                                        {"limit": EXACT_FINISHED_LIMIT + 1})).fetchall()
        estimate = (await (await run_async(conn, q["status_table_estimate"],
                                           _estimate_params(q))).fetchone()
                    if _needs_estimate(sample) else None)
        oldest_row = await (await run_async(conn, q["status_oldest_due_age"])).fetchone()
        workers = await (await run_async(conn,
            q["worker_list_alive"], {"within": WORKER_ALIVE_WITHIN})).fetchall()
        return _status(open_rows, sample, estimate, oldest_row[0] if oldest_row else None,
                       workers)

    async def show(self, conn: psycopg.AsyncConnection[Any], event_id: int) -> EventRecord:
        event_id = check_event_id(event_id)
        row = await (await run_async(conn, self._q["event_get"], {"id": event_id})).fetchone()
        if row is None:
            raise EventNotFoundError(f"event {event_id} not found")
        return record_from_event_get_row(row)

    async def events(self, conn: psycopg.AsyncConnection[Any], filter: EventFilter | None = None,
                     *, after: int | None = None, limit: int = 50) -> EventPage:
        filter, after, limit = _check_filter(filter), _check_after(after), _check_limit(limit)
        rows = await _fetch_async(conn, self._q["event_list"],
                                  _list_params(filter, after, limit + 1))
        return _page(rows, limit)

    async def retry(self, conn: psycopg.AsyncConnection[Any], event_id: int) -> None:
        event_id = check_event_id(event_id)
        if await (await run_async(conn, self._q["event_retry"], {"id": event_id})).fetchone() is None:
            state = await (await run_async(conn, self._q["event_state"], {"id": event_id})).fetchone()
            raise _not_changed(self._q, event_id, state, "retried",
                               "failed, cancelled or pending")
        await self._notify(conn)

    async def retry_failed(self, conn: psycopg.AsyncConnection[Any],
                           topic: str | None = None) -> list[int]:
        if topic is not None:
            check_topic(topic)
        cur = await run_async(conn, self._q["event_retry_failed"], {"topic": topic})
        ids = [r[0] for r in await cur.fetchall()]
        if ids:
            await self._notify(conn)
        return ids

    async def retry_matching(self, conn: psycopg.AsyncConnection[Any], filter: EventFilter, *,
                             dry_run: bool = False) -> list[int]:
        ids = await _run_flow_async(conn, _retry_flow(self._q, filter, dry_run))
        if ids and not dry_run:
            await self._notify(conn)
        return ids

    async def cancel_matching(self, conn: psycopg.AsyncConnection[Any], filter: EventFilter, *,
                              dry_run: bool = False) -> list[int]:
        return await _run_flow_async(conn, _cancel_flow(self._q, filter, dry_run))

    async def cancel(self, conn: psycopg.AsyncConnection[Any], event_id: int) -> None:
        event_id = check_event_id(event_id)
        if await (await run_async(conn, self._q["event_cancel"], {"id": event_id})).fetchone() is None:
            state = await (await run_async(conn, self._q["event_state"], {"id": event_id})).fetchone()
            if _already_cancelled(state):
                return
            raise _not_changed(self._q, event_id, state, "cancelled",
                               "pending, running or failed")

    async def prune(self, conn: psycopg.AsyncConnection[Any], older_than: float,
                    states: Sequence[str] | None = None, *, dry_run: bool = False,
                    progress: Callable[[int], None] | None = None) -> int:
        params = _prune_params(older_than, states, progress)
        if dry_run:
            row = await (await run_async(conn, self._q["event_prune_count"], params)).fetchone()
            return _report(progress, int(row[0]) if row else 0)
        total = 0
        while True:
            cur = await run_async(conn, self._q["event_prune"], params)
            total = _report(progress, total + cur.rowcount)
            if cur.rowcount < PRUNE_BATCH:
                return total

    async def _notify(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await run_async(conn, self._q["event_notify"], {"channel": self._q.channel, "payload": "*"})
