"""``events``, ``retry``, ``cancel`` and ``prune``: find events, and act on one or many.

``events`` and the bulk forms of ``retry`` and ``cancel`` share one set of
filters (``--state``, ``--topic``, ``--tenant``, ``--older-than``,
``--newer-than``, ``--error``), which become a :class:`conveyor.EventFilter`.
Ids alone act on exactly those events, all or none, with the single-event
errors (unknown id, wrong state); filters act on whatever matches, in
batches, and ``--dry-run`` lists it without changing anything.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from conveyor.admin import PRUNE_DEFAULT_STATES, Admin
from conveyor.cli import progress
from conveyor.cli.context import Context, duration, moment, positive_int
from conveyor.cli.options import add_command, add_json, format_seconds, usage_error
from conveyor.cli.output import emit_json, escape, note, say
from conveyor.filters import FILTER_STATES
from conveyor.types import FINISHED_STATES, EventFilter, EventSummary
from conveyor.validation import check_event_id

Sub = Any  # argparse's private _SubParsersAction

STATES = list(FILTER_STATES)
FILTERS = ("states", "topic", "tenant", "older_than", "newer_than", "error", "payload")
# Text output lists the ids of a bulk action up to this many; --json lists all.
IDS_SHOWN = 20
ERROR_WIDTH = 60


def add_filter_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("filters (each one given narrows the match)")
    group.add_argument("--state", action="append", dest="states", choices=STATES,
                       metavar="STATE", help="in this state (repeatable): " + ", ".join(STATES)
                       + " (scheduled: pending, not due yet)")
    group.add_argument("--topic", help="this topic, or every topic under a prefix: 'email.*'")
    group.add_argument("--tenant", help="of this tenant")
    group.add_argument("--older-than", type=duration, metavar="DURATION",
                       help="created longer ago than this, e.g. 2h or 7d")
    group.add_argument("--newer-than", type=duration, metavar="DURATION",
                       help="created within this, e.g. 15m")
    group.add_argument("--error", metavar="TEXT",
                       help="whose last error contains TEXT (case-insensitive)")
    group.add_argument("--payload", metavar="JSONPATH",
                       help="whose payload satisfies this SQL/JSON path predicate, e.g. "
                            "'$.customer == \"acme\"' or 'exists($.refund)'")


def has_filter(args: argparse.Namespace) -> bool:
    return any(getattr(args, name) is not None for name in FILTERS)


def filter_from(args: argparse.Namespace, *, states: Sequence[str] = (),
                ids: Sequence[int] = ()) -> EventFilter:
    return EventFilter(states=tuple(states or args.states or ()), topic=args.topic,
                       tenant=args.tenant, older_than=args.older_than,
                       newer_than=args.newer_than, error=args.error, ids=tuple(ids),
                       payload=args.payload)


def parse_ids(texts: Sequence[str]) -> list[int]:
    return list(dict.fromkeys(check_event_id(text) for text in texts))



def register_events(sub: Sub, env: Any) -> None:
    p = add_command(
        sub, "events", "list events, newest first, with filters",
        "List events newest first (highest id first), 50 to a page, with their state,\n"
        "attempts, topic, tenant, creation time and last error. When more match, the\n"
        "command for the next page is printed on stderr (--after, keyset paging: an\n"
        "event enqueued meanwhile never shifts a page).", run_events, examples=[
            ("conveyor events --state failed", "what failed, newest first"),
            ("conveyor events --topic 'email.*' --error timeout --newer-than 1h",
             "recent email events that timed out"),
            ("conveyor events --state failed --json | jq '.events[].id'", "ids for a script"),
            ("conveyor events --limit 100 --after 5120", "the next page after id 5120")])
    add_filter_options(p)
    p.add_argument("--limit", type=positive_int, default=50, metavar="N",
                   help="events per page, 1 to 1000 (default: 50)")
    p.add_argument("--after", metavar="ID",
                   help="the page after this id (the last id of the page before)")
    add_json(p, '{"events": [{id, tenant, topic, state, attempts, max_attempts, priority, '
                'run_at, created_at, updated_at, last_error}], "next_after"}')


def run_events(ctx: Context, args: argparse.Namespace) -> int:
    after = None if args.after is None else check_event_id(args.after)
    page = Admin(ctx.schema).events(ctx.connect(), filter_from(args), after=after,
                                    limit=args.limit)
    if args.json:
        emit_json(page.to_json())
    else:
        for line in format_events(page.events):
            say(line)
    if page.next_after is not None and not args.json:
        note("more events: " + next_page_command(args, page.next_after))
    return 0


def format_events(events: Sequence[EventSummary]) -> list[str]:
    header = ("id", "state", "attempts", "topic", "tenant", "created (UTC)", "last error")
    rows = [(str(e.id), e.state.value, f"{e.attempts}/{e.max_attempts}", escape(e.topic),
             escape(e.tenant) if e.tenant is not None else "-", _utc(e.created_at),
             _clip(escape(e.last_error)) if e.last_error else "-") for e in events]
    if not rows:
        return ["no events match"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header[:-1])]
    return ["  ".join([*(cell.ljust(w) for cell, w in zip(cells, widths, strict=False)),
                       cells[-1]]) for cells in [header, *rows]]


def _utc(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _clip(text: str) -> str:
    return text if len(text) <= ERROR_WIDTH else text[:ERROR_WIDTH - 3] + "..."


def next_page_command(args: argparse.Namespace, after: int) -> str:
    """The command for the next page: the same filters and limit, ``--after`` the last id."""
    words = ["conveyor", "events"]
    for state in args.states or ():
        words += ["--state", state]
    for flag, value in (("--topic", args.topic), ("--tenant", args.tenant),
                        ("--error", args.error), ("--payload", args.payload)):
        if value is not None:
            words += [flag, value]
    for flag, seconds in (("--older-than", args.older_than), ("--newer-than", args.newer_than)):
        if seconds is not None:
            words += [flag, format_seconds(seconds)]
    words += ["--limit", str(args.limit), "--after", str(after)]
    return " ".join(shlex.quote(word) for word in words)



def _add_bulk_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("ids", nargs="*", metavar="ID", help="event ids (all or none are changed)")
    add_filter_options(p)
    p.add_argument("--dry-run", action="store_true",
                   help="print which events would change and change nothing")
    add_json(p, '{"ids", "count", "dry_run"}')


def register_retry(sub: Sub, env: Any) -> None:
    p = add_command(
        sub, "retry", "run failed or cancelled events again",
        "Make events due now: by id, or every event the filters match (then --state or\n"
        "--failed says which: failed, cancelled, or pending events still scheduled).\n"
        "An event whose attempts are spent gets one more. Ids alone change all or\n"
        "none; an unknown id or a running or succeeded event is refused.", run_retry,
        examples=[("conveyor retry 13 14", "two events"),
                  ("conveyor retry --failed --topic 'email.*' --dry-run",
                   "which failed email events would run again"),
                  ("conveyor retry --failed --error 'SMTP 421' --newer-than 1h",
                   "failed in the last hour with that error"),
                  ("conveyor retry --state cancelled --tenant acme --json", "print the ids")])
    p.add_argument("--failed", action="store_true", help="same as --state failed")
    _add_bulk_options(p)


def run_retry(ctx: Context, args: argparse.Namespace) -> int:
    ids = parse_ids(args.ids)
    states = [*(args.states or ()), *(["failed"] if args.failed else [])]
    by_filter = has_filter(args) or args.failed
    if not ids and not by_filter:
        usage_error(args, "give event ids, or --failed / --state STATE (with any filters)")
    if by_filter and not states:
        given = " ".join("--" + name.replace("_", "-") for name in FILTERS
                         if getattr(args, name) is not None)
        usage_error(args, f"retry {given} needs --failed or --state: which events should run "
                          "again (failed, cancelled, or scheduled pending ones)?")
    admin, conn = Admin(ctx.schema), ctx.connect()
    if by_filter or args.dry_run:
        changed = admin.retry_matching(conn, filter_from(args, states=states, ids=ids),
                                       dry_run=args.dry_run)
    else:
        with conn.transaction():
            for event_id in ids:
                admin.retry(conn, event_id)
        changed = ids
    return _report(args, changed, "retry", "retried", "will run again", by_filter)


def register_cancel(sub: Sub, env: Any) -> None:
    p = add_command(
        sub, "cancel", "cancel pending, running or failed events",
        "Mark events cancelled so they never run again: by id, or every pending,\n"
        "running or failed event the filters match. A worker still running one is told\n"
        "at once: it cancels an async handler, a plain one sees event.cancelled, and its\n"
        "result is discarded. Cancelling a cancelled event again is no error; ids alone\n"
        "change all or none.", run_cancel,
        examples=[("conveyor cancel 9 10", "two events"),
                  ("conveyor cancel --topic 'spam.*' --dry-run", "which events would go"),
                  ("conveyor cancel --state pending --tenant acme --json",
                   "every pending event of one tenant; print the ids")])
    _add_bulk_options(p)


def run_cancel(ctx: Context, args: argparse.Namespace) -> int:
    ids = parse_ids(args.ids)
    by_filter = has_filter(args)
    if not ids and not by_filter:
        usage_error(args, "give event ids, or filters such as --topic or --state")
    admin, conn = Admin(ctx.schema), ctx.connect()
    if by_filter or args.dry_run:
        changed = admin.cancel_matching(conn, filter_from(args, ids=ids), dry_run=args.dry_run)
    else:
        with conn.transaction():
            for event_id in ids:
                admin.cancel(conn, event_id)
        changed = ids
    return _report(args, changed, "cancel", "cancelled", "cancelled", by_filter)


def register_reschedule(sub: Sub, env: Any) -> None:
    p = add_command(
        sub, "reschedule", "make an event due at another time",
        "Make a pending, failed or cancelled event due at --at (a moment with its UTC\n"
        "offset) or --in (a duration from now). A failed or cancelled event becomes\n"
        "pending again, with one more attempt if all are spent, as `conveyor retry`\n"
        "grants. Workers hear of it when the command commits.", run_reschedule,
        examples=[("conveyor reschedule 42 --in 2h", "two hours from now"),
                  ("conveyor reschedule 42 --at 2031-03-30T09:00:00+02:00 --json",
                   "at that moment; print {\"id\", \"run_at\"}")])
    p.add_argument("id", metavar="ID", help="the event's id")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--at", type=moment, metavar="TIME",
                      help="ISO 8601 date and time with its offset (Z or +HH:MM)")
    when.add_argument("--in", dest="delay", type=duration, metavar="DURATION",
                      help="from now, e.g. 90s, 2h or 1d")
    add_json(p, '{"id", "run_at"}')


def run_reschedule(ctx: Context, args: argparse.Namespace) -> int:
    event_id = check_event_id(args.id)
    conn = ctx.connect()
    with conn.transaction():
        due = Admin(ctx.schema).reschedule(conn, event_id, run_at=args.at, delay=args.delay)
    if args.json:
        emit_json({"id": event_id, "run_at": due.isoformat()})
    else:
        say(f"event {event_id} is due at {due.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC")
    return 0


def _report(args: argparse.Namespace, ids: list[int], verb: str, done: str, each: str,
            by_filter: bool) -> int:
    if args.json:
        emit_json({"ids": ids, "count": len(ids), "dry_run": args.dry_run})
    elif by_filter or args.dry_run:
        head = f"would {verb}" if args.dry_run else done
        shown = ", ".join(map(str, ids[:IDS_SHOWN])) + (", ..." if len(ids) > IDS_SHOWN else "")
        say(f"{head} {_events(len(ids))}" + (f": {shown}" if ids else ""))
    else:
        for event_id in ids:
            say(f"event {event_id} {each}")
    return 0


def _events(n: int) -> str:
    return f"{n} event" if n == 1 else f"{n} events"



def register_prune(sub: Sub, env: Any) -> None:
    finished = sorted(s.value for s in FINISHED_STATES)
    p = add_command(
        sub, "prune", "delete finished events older than a duration",
        "Delete succeeded and cancelled events that finished longer ago than\n"
        "--older-than (e.g. 7d, 12h, 30m). Failed events are kept unless --state failed\n"
        "is given: they wait for an operator. Pending and running events are never\n"
        "touched. Deletes in batches; a long run reports progress on stderr (on a\n"
        "terminal as it goes, otherwise every 10 batches).", run_prune,
        examples=[("conveyor prune --older-than 30d", "succeeded and cancelled, older than 30d"),
                  ("conveyor prune --older-than 90d --state failed --dry-run",
                   "how many old failed events would go"),
                  ("conveyor prune --older-than 12h --state succeeded --json",
                   "print {\"deleted\", ...}")])
    p.add_argument("--older-than", required=True, type=duration, metavar="DURATION",
                   help="finished longer ago than this, e.g. 7d, 12h, 30m, 90s")
    p.add_argument("--state", action="append", dest="states", choices=finished, metavar="STATE",
                   help="only this state (repeatable): " + ", ".join(finished)
                        + " (default: succeeded and cancelled)")
    p.add_argument("--dry-run", action="store_true",
                   help="count what would be deleted and delete nothing")
    add_json(p, '{"deleted", "dry_run", "states", "older_than_s"}')


def run_prune(ctx: Context, args: argparse.Namespace) -> int:
    from conveyor import admin as admin_module

    states = sorted(dict.fromkeys(args.states or PRUNE_DEFAULT_STATES))
    report = progress.BatchProgress("prune", "events deleted", lambda: admin_module.PRUNE_BATCH)
    try:
        deleted = Admin(ctx.schema).prune(ctx.connect(), args.older_than, states=states,
                                          dry_run=args.dry_run,
                                          progress=None if args.dry_run else report)
    finally:
        report.finish()
    if args.json:
        emit_json({"deleted": deleted, "dry_run": args.dry_run, "states": states,
                   "older_than_s": args.older_than})
    else:
        say(f"{'would delete' if args.dry_run else 'deleted'} {_events(deleted)}")
    return 0
