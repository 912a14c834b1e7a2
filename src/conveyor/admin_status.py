"""What :meth:`~conveyor.admin.Admin.status` computes from its reads, without I/O.

A status call reads four things: the open events by topic, tenant and state
(exact, each state through its partial index; or, for a bounded status, the
failed ones counted only up to a bound), a bounded sample of the finished
ones, the planner's estimate when the sample overflows, and the live
workers. This module turns them into a :class:`~conveyor.records.QueueStatus`:
the counts (estimated for succeeded and cancelled beyond the sample, capped
for failed beyond the bound), the per-topic rows, and the topics whose due
events no live worker may claim.
Kept apart from the rest of the operator API's core because it is the one
piece that reasons about estimates and worker coverage rather than about
checking an operator's input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conveyor.db.named_queries import Queries
from conveyor.db.rows import worker_from_row
from conveyor.patterns import matches_any
from conveyor.records import QueueStatus, TopicCount
from conveyor.states import EventState

# A worker that has not renewed its heartbeat for this long is not counted alive.
WORKER_ALIVE_WITHIN = 30.0

# The states whose counts may be estimates; pending, running and failed are
# always exact (each has a partial index holding only its rows).
ESTIMABLE_STATES = (EventState.SUCCEEDED.value, EventState.CANCELLED.value)

# A bounded status counts the failed events exactly up to FAILED_EXACT_LIMIT, and
# beyond it each topic's up to FAILED_TOPIC_EXACT_LIMIT, so its cost stops growing
# with them (measured: docs/dashboard.md). A bound, not an estimate: after a bulk
# retry the count falls at once, where the planner's statistics lag until the
# next ANALYZE.
FAILED_EXACT_LIMIT = 10_000
FAILED_TOPIC_EXACT_LIMIT = 1_000


def failed_cap(total: int) -> int:
    """How far a bounded status counts each topic's failed events, given their total
    counted up to ``FAILED_EXACT_LIMIT + 1``: all of them while the total is within
    the limit (every count exact), else ``FAILED_TOPIC_EXACT_LIMIT``."""
    return FAILED_EXACT_LIMIT if total <= FAILED_EXACT_LIMIT else FAILED_TOPIC_EXACT_LIMIT


def _capped_failed(open_rows: Sequence[Sequence[Any]], failed_total: int | None
                   ) -> tuple[list[Sequence[Any]], set[str]]:
    """The open rows with each failed count cut at its cap, and the topics cut."""
    if failed_total is None:
        return list(open_rows), set()
    cap = failed_cap(failed_total)
    rows: list[Sequence[Any]] = []
    capped: set[str] = set()
    for row in open_rows:
        topic, tenant, state, n, oldest_due = row
        if state == EventState.FAILED.value and n > cap:
            capped.add(topic)
            row = (topic, tenant, state, cap, oldest_due)
        rows.append(row)
    return rows, capped


def estimate_finished(estimate: Sequence[Any] | None, open_total: int,
                      floor: dict[str, int], *, capped_failed: bool = False) -> dict[str, int]:
    """Succeeded and cancelled counts from the planner's statistics.

    Finished-but-not-failed rows = estimated live rows - the exact open and
    failed counts, split by the states' shares in pg_stats (all succeeded when
    neither share is known); plus the history's (0025), split by its days'
    own shares; never below what the sample already saw. ``capped_failed``:
    ``open_total`` holds only the bound of the failed events (a bounded
    status), so their share in pg_stats stands in for them when it is more.
    """
    live_rows, states, shares, history_rows, history_cancelled = (
        estimate if estimate is not None else (None, None, None, None, None))
    share = dict(zip(states or [], shares or [], strict=False))
    uncounted = 0.0
    if capped_failed:
        uncounted = max(0.0, float(live_rows or 0) * share.get(EventState.FAILED.value, 0.0)
                        - FAILED_EXACT_LIMIT)
    finished = max(0.0, float(live_rows or 0) - open_total - uncounted)
    succeeded_share = share.get(EventState.SUCCEEDED.value, 0.0)
    cancelled_share = share.get(EventState.CANCELLED.value, 0.0)
    if succeeded_share + cancelled_share <= 0:
        succeeded_share = 1.0
    succeeded = round(finished * succeeded_share / (succeeded_share + cancelled_share))
    cancelled = round(finished) - succeeded
    in_history, cancelled_in_history = float(history_rows or 0), float(history_cancelled or 0)
    succeeded += round(in_history - cancelled_in_history)
    cancelled += round(cancelled_in_history)
    return {EventState.SUCCEEDED.value: max(succeeded, floor[EventState.SUCCEEDED.value]),
            EventState.CANCELLED.value: max(cancelled, floor[EventState.CANCELLED.value])}


# The key of QueueStatus.counts (and TopicCount.scheduled) for pending events
# whose run_at is still in the future: not an EventState, a part of pending.
SCHEDULED = "scheduled"


def empty_counts() -> dict[str, int]:
    """Every count at 0, "scheduled" right after "pending" (the order status prints).

    "waiting" (a workflow's steps, 0022) is not among them: it is added, after
    "scheduled", only when some event waits, so a queue without workflows
    reads and prints as it did before them.
    """
    counts = {EventState.PENDING.value: 0, SCHEDULED: 0}
    counts.update({s.value: 0 for s in EventState
                   if s not in (EventState.PENDING, EventState.WAITING)})
    return counts


def queue_status(open_rows: Sequence[Sequence[Any]], sample: Sequence[Sequence[Any]],
                 estimate: Sequence[Any] | None, oldest: float | None,
                 workers: Sequence[Sequence[Any]], exact_limit: int,
                 failed_total: int | None = None) -> QueueStatus:
    """The status from its four reads (see the module docstring); ``oldest``: the oldest
    due pending event's age in seconds. ``failed_total``: for a bounded status, the
    failed events counted up to ``FAILED_EXACT_LIMIT + 1`` (the failed rows of
    ``open_rows`` then counted up to :func:`failed_cap` of it plus one); None when
    ``open_rows`` counts them exactly."""
    open_rows, capped_topics = _capped_failed(open_rows, failed_total)
    counts = empty_counts()
    per_topic: dict[tuple[str, str], int] = {}
    scheduled_per_topic: dict[str, int] = {}
    oldest_per_topic: dict[str, float] = {}
    due_pairs = set()
    for topic, tenant, state, n, oldest_due in open_rows:
        if state == EventState.WAITING.value and state not in counts:
            counts = {**{k: v for k, v in counts.items() if k in (EventState.PENDING.value,
                                                                  SCHEDULED)},
                      state: 0, **counts}
        counts[state] += n
        if oldest_due is not None:
            oldest_per_topic[topic] = max(oldest_due, oldest_per_topic.get(topic, 0.0))
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
    capped_states = []
    if failed_total is not None and failed_total > FAILED_EXACT_LIMIT:
        counts[EventState.FAILED.value] = FAILED_EXACT_LIMIT
        capped_states = [EventState.FAILED.value]
    estimated: list[str] = []
    if not needs_estimate(sample, exact_limit):
        counts.update(seen)               # the sample held every finished row
        per_topic.update(seen_per_topic)
    else:
        counts.update(estimate_finished(estimate, sum(counts.values()), seen,
                                        capped_failed=bool(capped_states)))
        estimated = list(ESTIMABLE_STATES)
    by_topic = [TopicCount(topic, EventState(state), n,
                           scheduled_per_topic.get(topic, 0) if state == "pending" else 0,
                           oldest_per_topic.get(topic) if state == "pending" else None,
                           capped=state == EventState.FAILED.value and topic in capped_topics)
                for (topic, state), n in sorted(per_topic.items())]
    infos = [worker_from_row(w) for w in workers]

    def claimable(topic: str, tenant: str | None) -> bool:
        return any(matches_any(w.topics, topic)
                   and (w.tenants is None or tenant in w.tenants) for w in infos)

    # A topic is unhandled when some tenant's due events of it have no live
    # worker allowed to claim them (a tenant-limited worker covers only its own).
    # Events not yet due wait anyway: a worker started before they fall due is in time.
    unhandled = sorted({topic for topic, tenant in due_pairs if not claimable(topic, tenant)})
    return QueueStatus(counts=counts, by_topic=by_topic, oldest_pending_age_s=oldest,
                       workers=infos, unhandled_topics=unhandled, estimated_states=estimated,
                       capped_states=capped_states)


def needs_estimate(sample: Sequence[Sequence[Any]], exact_limit: int) -> bool:
    return sum(int(row[2]) for row in sample) > exact_limit


def estimate_params(q: Queries) -> dict[str, Any]:
    return {"schema": q.schema, "table": q.live_table, "history": q.history_table}

