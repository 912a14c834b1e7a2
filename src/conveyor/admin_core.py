"""The I/O-free core of the operator API: parameters, checks, decoding, flows.

:class:`~conveyor.admin.Admin` and :class:`~conveyor.admin.AsyncAdmin` are thin
drivers over it: they run the statements and hand the rows back here. The bulk
actions are generators that yield ``(query, params)`` steps and receive the
rows (httpx's ``auth_flow`` shape), so each driver is a loop of a few lines.
What ``status`` computes from its reads is :mod:`conveyor.admin_status`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

from conveyor.db.named_queries import Queries
from conveyor.errors import EventNotFoundError, InvalidInputError, InvalidStateError
from conveyor.filters import EventFilter
from conveyor.notify import PAUSE_NOTIFICATION as _PAUSE_NOTIFICATION
from conveyor.patterns import TopicPattern, check_topic_pattern
from conveyor.records import EventPage, EventSummary, Pause
from conveyor.states import FINISHED_STATES, EventState
from conveyor.validation import (
    DELAY_MAX_SECONDS,
    check_delay,
    check_event_id,
    check_run_at,
    check_tenant,
)

# Admin.wait() reads the event again at least this often (seconds), for ends
# no notification announces; and waits at most this long in one call.
WAIT_RECHECK = 5.0
WAIT_TIMEOUT_MAX = 7 * 86_400.0


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
                  progress: object, batch: int) -> dict[str, Any]:
    if progress is not None and not callable(progress):
        raise InvalidInputError(f"expected progress to be callable, got {progress!r:.60}")
    return {"older_than": _older_than(older_than), "states": _prune_states(states),
            "limit": batch}


def _already_cancelled(state_row: Sequence[Any] | None) -> bool:
    return state_row is not None and state_row[0] == EventState.CANCELLED.value


def _not_changed(q: Queries, event_id: int, state_row: Sequence[Any] | None, action: str,
                 allowed: str) -> Exception:
    if state_row is None:
        return EventNotFoundError(f"event {event_id} not found")
    return InvalidStateError(
        f"event {event_id} is {state_row[0]}; only {allowed} events can be {action}")


def _reschedule_params(event_id: int, run_at: object, delay: object) -> dict[str, Any]:
    """``event_reschedule``'s parameters: exactly one of an aware ``run_at`` and a ``delay``."""
    if (run_at is None) == (delay is None):
        raise InvalidInputError("give run_at or delay to reschedule to, not "
                                + ("both" if run_at is not None else "neither"))
    return {"id": event_id, "run_at": check_run_at(run_at),
            "delay": 0.0 if delay is None else check_delay(delay)}


def _report(progress: Callable[[int], None] | None, total: int) -> int:
    if progress is not None:
        progress(total)
    return total


# The largest page Admin.events returns.
LIST_LIMIT_MAX = 1000


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


def _check_wait_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
            or not 0 < timeout <= WAIT_TIMEOUT_MAX:
        raise InvalidInputError(f"expected timeout to be seconds above 0 and at most "
                                f"{WAIT_TIMEOUT_MAX:.0f}, got {timeout!r:.60}")
    return float(timeout)


def _check_newest(newest: object) -> int | None:
    if newest is None:
        return None
    if isinstance(newest, bool) or not isinstance(newest, int) or newest < 1:
        raise InvalidInputError(f"expected newest to be a positive integer or None, "
                                f"got {newest!r:.60}")
    return newest


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
                 scheduled_pending_only: bool = False,
                 newest: int | None = None) -> dict[str, Any]:
    """``event_list``'s parameters; an unset filter field binds the value that folds away."""
    exact, low, high = (None, None, None) if filter.topic is None \
        else TopicPattern(filter.topic).topic_range()
    return {
        "after": after, "ids": list(filter.ids),
        "states": list(filter.states if states is None else states),
        "topic": exact, "topic_from": low, "topic_to": high,
        "tenant": filter.tenant, "older_than": filter.older_than,
        "newer_than": filter.newer_than, "error": filter.error, "payload": filter.payload,
        "scheduled_pending_only": scheduled_pending_only or filter.scheduled,
        "limit": limit, "newest": newest, "span": None,
    }


# The states each bulk action can change (retry: pending only while scheduled).
RETRYABLE_STATES = ("pending", "failed", "cancelled")
CANCELLABLE_STATES = ("waiting", "pending", "running", "failed")

# A step of an I/O-free flow: a query and its parameters; the driver sends back the rows.
Step = tuple[str, dict[str, Any]]
Rows = list[dict[str, Any]]


# The states a row of the history (events_done, 0025) can be in: its CHECK.
HISTORY_STATES = frozenset({EventState.SUCCEEDED.value, EventState.CANCELLED.value})

# The id spans Admin.events reads a page in, one after the other until one holds a
# full page: most pages are among the newest ids, and a bounded read never
# starts at a partition's oldest rows (event_list says why).
LIST_SPANS = (10_000, 1_000_000, None)


def _list_flow(q: Queries, filter: EventFilter, after: int | None, rows: int, *,
               newest: int | None = None) -> Generator[Step, Rows, Rows]:
    """Up to ``rows`` events ``filter`` matches, newest first: read over the newest
    ids first, then over more (:data:`LIST_SPANS`). A read that fills the page is
    the page, since every id outside its span is lower. Read in one go: with no
    filter (each partition's read begins with a match), with ``ids`` or
    ``newest`` (bounded already), and for states the history never holds (only
    the live partition is read, through the index that suits the filter)."""
    one_go = (filter.is_empty() or filter.ids or newest is not None
              or (filter.states and not HISTORY_STATES.intersection(filter.states)))
    spans = (None,) if one_go else LIST_SPANS
    for span in spans:
        found = yield q["event_list"], {**_list_params(filter, after, rows, newest=newest),
                                        "span": span}
        if len(found) >= rows:
            break
    return found


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
                   scheduled_pending_only: bool, dry_run: bool, batch: int,
                   ) -> Generator[Step, Rows, list[int]]:
    """The batches of a bulk action, newest first: select up to ``batch`` matching
    ids (keyset on id), then change them (the UPDATE checks each row's state again).
    Changed rows stop matching or lie past the keyset, so none is visited twice."""
    changed: list[int] = []
    after = None
    while True:
        rows = yield q["event_list"], _list_params(
            filter, after, batch, states=states,
            scheduled_pending_only=scheduled_pending_only)
        ids = [r["id"] for r in rows]
        if ids and not dry_run:
            done = yield q[update], {"ids": ids, "states": states}
            ids = sorted((r["id"] for r in done), reverse=True)
        changed += ids
        if len(rows) < batch:
            return changed
        after = rows[-1]["id"]


def _retry_flow(q: Queries, filter: object, dry_run: bool,
                batch: int) -> Generator[Step, Rows, list[int]]:
    checked = _check_matching(filter)
    states = _matching_states(checked, RETRYABLE_STATES, "retried")
    return _matching_flow(q, checked, "event_retry_ids", states, scheduled_pending_only=True,
                          dry_run=dry_run, batch=batch)


def _cancel_flow(q: Queries, filter: object, dry_run: bool,
                 batch: int) -> Generator[Step, Rows, list[int]]:
    checked = _check_matching(filter)
    states = _matching_states(checked, CANCELLABLE_STATES, "cancelled")
    return _matching_flow(q, checked, "event_cancel_ids", states, scheduled_pending_only=False,
                          dry_run=dry_run, batch=batch)


def _count_query(q: Queries) -> str:
    """``event_list``'s statement counting its matches instead of listing a page.

    Derived from the listing's own text, so a count and the batches it
    announces can never filter differently. Without ORDER BY and LIMIT the
    planner reads the index that suits the filter (the failed events of a
    prefix through events_stopped_topic_idx) instead of walking the primary
    key newest first (measured: docs/dashboard.md, "At 5 million events").
    """
    head, found, _ = q["event_list"].rpartition("ORDER BY id DESC")
    assert found, "event_list no longer ends with its ORDER BY"
    return f"SELECT count(*) AS n FROM ({head}) AS matching"


def _count_step(q: Queries, filter: object, action: str) -> Step:
    """The one statement of ``count_matching``: what ``action``'s flow would select."""
    checked = _check_matching(filter)
    if action == "retry":
        states = _matching_states(checked, RETRYABLE_STATES, "retried")
    elif action == "cancel":
        states = _matching_states(checked, CANCELLABLE_STATES, "cancelled")
    else:
        raise InvalidInputError(f"unknown bulk action {action!r}: expected 'retry' or 'cancel'")
    return _count_query(q), _list_params(checked, None, 0, states=states,
                                        scheduled_pending_only=action == "retry")


def _page(rows: Sequence[Mapping[str, Any]], limit: int) -> EventPage:
    """A page from up to ``limit + 1`` rows: the extra row only says another page exists."""
    events = [_summary_from_row(r) for r in rows[:limit]]
    return EventPage(events=events, next_after=events[-1].id if len(rows) > limit else None)


# Pauses (0005). A reason is a line for people reading `conveyor status`; the
# table's check holds the same limit.
PAUSE_REASON_MAX_LENGTH = 500
PAUSE_COLUMNS = ("pattern", "tenant", "reason", "paused_at")
# The NOTIFY payload that tells workers the pauses changed (conveyor.notify); a
# worker that predates pauses at most claims once more (it finds the same events).
PAUSE_NOTIFICATION = _PAUSE_NOTIFICATION


def pause_from_row(row: Sequence[Any]) -> Pause:
    """A pause_upsert or pause_list row, its columns in PAUSE_COLUMNS order."""
    pattern, tenant, reason, paused_at = row
    return Pause(pattern=pattern, tenant=tenant, reason=reason, paused_at=paused_at)


def _check_reason(reason: object) -> str | None:
    if reason is None:
        return None
    if not isinstance(reason, str):
        raise InvalidInputError(f"reason must be a string, got {reason!r:.60}")
    if len(reason) > PAUSE_REASON_MAX_LENGTH:
        raise InvalidInputError(f"reason is {len(reason)} characters, the limit is "
                                f"{PAUSE_REASON_MAX_LENGTH}: {reason!r:.60}")
    if any(ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029" for c in reason):
        raise InvalidInputError(f"reason contains control characters: {reason!r:.60}")
    return reason


def _pause_params(pattern: object, tenant: object, reason: object = None) -> dict[str, Any]:
    return {"pattern": check_topic_pattern(pattern), "tenant": check_tenant(tenant),
            "reason": _check_reason(reason)}
