"""One function per command: ``register_*`` adds the parser, ``run_*`` does the work."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg

from conveyor.admin import SCHEDULED, Admin
from conveyor.cli.context import Context, duration, moment, positive_int
from conveyor.cli.control_command import format_schedules
from conveyor.cli.options import add_command, add_json, usage_error
from conveyor.cli.output import emit_json, escape, escape_lines, note, say
from conveyor.cli.progress import Ticker
from conveyor.config import (
    ProducerConfig,
)
from conveyor.db.execute import run
from conveyor.db.named_queries import queries_for
from conveyor.errors import (
    DatabaseError,
    InvalidInputError,
    WorkbookError,
)
from conveyor.producer import Producer
from conveyor.schema.migrator import Migrator, migration_script
from conveyor.types import Pause, QueueStatus
from conveyor.vacuum_health import vacuum_warnings

Env = Callable[..., str | None]
Sub = Any  # argparse's private _SubParsersAction

log = logging.getLogger(__name__)


_add = add_command



def register_migrate(sub: Sub, env: Env) -> None:
    p = _add(sub, "migrate", "create or upgrade Conveyor's schema",
             "Apply the numbered migrations that are missing, once, under an advisory lock\n"
             "(safe when many processes start together). With --sql, print the SQL instead\n"
             "so it can go into Alembic, Django or any other migration tool.", run_migrate,
             examples=[("conveyor migrate", "create or upgrade the schema 'conveyor'"),
                       ("conveyor migrate --json", "the same; print the versions applied"),
                       ("conveyor --schema jobs migrate --sql > conveyor.sql",
                        "the SQL for your own migration tool"),
                       ("conveyor migrate --sql --from 9 --to 9",
                        "only migration 9: the body of one Alembic revision"),
                       ("conveyor migrate --check", "exit 1 while migrations are pending")])
    p.add_argument("--sql", action="store_true",
                   help="print the full migration script and touch no database")
    p.add_argument("--from", dest="first", type=positive_int, default=1, metavar="N",
                   help="with --sql: start at migration N (default: 1)")
    p.add_argument("--to", dest="last", type=positive_int, default=None, metavar="M",
                   help="with --sql: end at migration M (default: the latest)")
    p.add_argument("--check", action="store_true",
                   help="apply nothing: exit 0 when the schema is current, 1 (naming the "
                        "pending migrations) when it is not")
    add_json(p, '{"schema", "applied": [{"version", "name"}], "version"}; with --check '
                '{"schema", "current", "pending"}')


def run_migrate(ctx: Context, args: argparse.Namespace) -> int:
    if args.sql:
        if args.json or args.check:
            usage_error(args, "--json and --check do not apply with --sql, which prints SQL")
        sys.stdout.write(migration_script(ctx.schema, args.first, args.last))
        return 0
    if args.first != 1 or args.last is not None:
        usage_error(args, "--from and --to choose what --sql prints; add --sql")
    conn = ctx.connect(check_schema=False)
    migrator = Migrator(ctx.schema)
    if args.check:
        pending = migrator.pending(conn)
        if args.json:
            emit_json({"schema": ctx.schema, "current": not pending,
                       "pending": [{"version": m.version, "name": m.name} for m in pending]})
        elif pending:
            note(f"schema {ctx.schema!r} is behind: pending "
                 + ", ".join(f"{m.version:04d}_{m.name}" for m in pending))
        else:
            say(f"schema {ctx.schema!r} is current")
        return 1 if pending else 0
    applied = migrator.apply(conn)
    if args.json:
        emit_json({"schema": ctx.schema,
                   "applied": [{"version": m.version, "name": m.name} for m in applied],
                   "version": max(migrator.applied_versions(conn), default=None)})
    elif applied:
        for m in applied:
            say(f"applied {m.version:04d}_{m.name}")
    else:
        say(f"schema {ctx.schema!r} is up to date")
    return 0



def register_enqueue(sub: Sub, env: Env) -> None:
    p = _add(sub, "enqueue", "add one event and print its id",
             "Enqueue one event in its own transaction and print its id. With --key, a\n"
             "second enqueue of the same tenant and key prints the first event's id\n"
             "(--json says which happened: \"deduplicated\": true).",
             run_enqueue, examples=[
                 ("conveyor enqueue email.send '{\"to\": \"a@example.com\"}' --tenant acme",
                  "enqueue now, print the id"),
                 ("conveyor enqueue billing.charge '{}' --key inv-7 --delay 1h --json",
                  "once per key, in an hour; print {\"id\", \"deduplicated\"}")])
    p.add_argument("topic", help="dot-separated topic, e.g. email.send")
    p.add_argument("payload", nargs="?", default="{}", help="JSON payload (default: {})")
    p.add_argument("--tenant", help="owning tenant, a DNS label such as 'acme'")
    p.add_argument("--key", help="idempotency key")
    due = p.add_mutually_exclusive_group()
    due.add_argument("--delay", type=duration, default=0.0, metavar="DURATION",
                     help="run no earlier than this from now, e.g. 30s or 5m")
    due.add_argument("--at", type=moment, default=None, metavar="TIME",
                     help="run no earlier than this moment, ISO 8601 with its offset, e.g. "
                          "2031-03-30T09:00:00+02:00")
    p.add_argument("--priority", type=int, default=0, help="higher runs first (default: 0)")
    p.add_argument("--max-attempts", type=positive_int, default=None, metavar="N",
                   help="attempts before the event is parked failed (default: 5)")
    add_json(p, '{"id", "deduplicated"}')


def run_enqueue(ctx: Context, args: argparse.Namespace) -> int:
    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"payload is not valid JSON ({exc.msg}): {args.payload!r:.80}") from None
    producer = Producer(ProducerConfig(schema=ctx.schema))
    conn = ctx.connect()
    for attempt in range(3):
        try:
            event_id, deduplicated = _enqueue_once(ctx, conn, producer, payload, args)
            break
        except DatabaseError as exc:
            if attempt == 2 or not isinstance(exc.__cause__, psycopg.errors.SerializationFailure):
                raise
    if args.json:
        emit_json({"id": event_id, "deduplicated": deduplicated})
    else:
        say(event_id)
    return 0


def _enqueue_once(ctx: Context, conn: psycopg.Connection[Any], producer: Producer, payload: Any,
                  args: argparse.Namespace) -> tuple[int, bool]:
    """Enqueue in one REPEATABLE READ transaction; (id, whether the key deduplicated).

    The key is looked up first in the same snapshot the insert then works in,
    so the answer cannot be wrong: an event with that key committed after the
    snapshot makes the insert fail with a serialization error (the caller
    tries again) instead of being taken for a new one.
    """
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    try:
        with conn.transaction():
            existing = None
            if args.key is not None:
                existing = run(conn, queries_for(ctx.schema)["event_id_by_key"],
                               {"tenant": args.tenant, "idempotency_key": args.key}).fetchone()
            event_id = producer.enqueue(conn, args.topic, payload, tenant=args.tenant,
                                        idempotency_key=args.key, delay=args.delay,
                                        priority=args.priority, max_attempts=args.max_attempts,
                                        run_at=args.at)
    finally:
        conn.isolation_level = None
    return event_id, existing is not None



def register_status(sub: Sub, env: Env) -> None:
    p = _add(sub, "status", "counts by state and topic, oldest pending, live workers",
             "Show how many events are in each state, per topic; the age of the oldest due\n"
             "pending event; the workers alive; pending topics no live worker claims; and\n"
             "the topic patterns paused (`conveyor pause`).",
             run_status, examples=[
                 ("conveyor status", "the summary for a human"),
                 ("conveyor status --json | jq .counts.failed", "one figure for a script")])
    add_json(p, "counts, by_topic, oldest_pending_age_s, workers, unhandled_topics, ..., "
                "paused: [{pattern, tenant, reason, paused_at}]")


def format_status(status: QueueStatus) -> str:
    c = status.counts
    # "~": an estimate from the planner's statistics (see Admin.status).
    approx = {s: "~" if s in status.estimated_states else "" for s in c}
    lines = [
        "events: " + "  ".join(f"{state} {approx[state]}{c[state]}" for state in c),
        "oldest pending: " + ("-" if status.oldest_pending_age_s is None
                              else f"{status.oldest_pending_age_s:.1f}s"),
        f"workers alive: {len(status.workers)}",
    ]
    for w in status.workers:
        lines.append(f"  {escape(w.name)} (pid {w.pid}) topics: "
                     + escape(", ".join(w.topics)))
    topics: dict[str, dict[str, int]] = {}
    lags: dict[str, float] = {}
    for t in status.by_topic:
        row = topics.setdefault(escape(t.topic), {})
        row[t.state.value] = t.count
        if t.scheduled:     # carried on the topic's pending row (TopicCount.scheduled)
            row[SCHEDULED] = row.get(SCHEDULED, 0) + t.scheduled
        if t.oldest_due_s is not None:
            lags[escape(t.topic)] = t.oldest_due_s
    if topics:
        width = max(len("topic"), *(len(t) for t in topics))
        states = [s for s in c if not approx[s]]     # estimates have no per-topic split
        lines.append("")
        lines.append(f"{'topic':<{width}}  " + "  ".join(f"{s:>9}" for s in states)
                     + "  oldest due")
        for topic in sorted(topics):
            row = topics[topic]
            lag = f"{lags[topic]:.1f}s" if topic in lags else "-"
            lines.append(f"{topic:<{width}}  " + "  ".join(f"{row.get(s, 0):>9}" for s in states)
                         + f"  {lag:>10}")
    if status.unhandled_topics:
        lines.append("")
        lines.append("pending with no live worker claiming them: "
                     + escape(", ".join(status.unhandled_topics)))
    return "\n".join(lines)


def format_pauses(pauses: Sequence[Pause]) -> list[str]:
    """The lines about pauses in force, oldest pattern first; none when nothing is paused."""
    if not pauses:
        return []
    lines = ["", f"paused ({len(pauses)}): no worker claims these"]
    for p in pauses:
        who = "every tenant" if p.tenant is None else f"tenant {escape(p.tenant)}"
        lines.append(f"  {escape(p.pattern)} ({who}) since {_utc(p.paused_at)}"
                     + (f": {escape(p.reason)}" if p.reason else ""))
    return lines


def _utc(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def run_status(ctx: Context, args: argparse.Namespace) -> int:
    admin, conn = Admin(ctx.schema), ctx.connect()
    status = admin.status(conn)
    pauses = admin.paused(conn)
    schedules = admin.schedules(conn)
    warnings = vacuum_warnings(conn, ctx.schema)
    if args.json:
        emit_json({**status.to_json(), "paused": [p.to_json() for p in pauses],
                   "schedules": [s.to_json() for s in schedules],
                   "warnings": [{"action": w.action, "message": w.message} for w in warnings]})
    else:
        say("\n".join([format_status(status), *format_pauses(pauses),
                       *format_schedules(schedules),
                       *(f"warning: {escape(w.message)}" for w in warnings)]))
    return 0



def register_show(sub: Sub, env: Env) -> None:
    p = _add(sub, "show", "one event with its error history",
             "Print one event: state, attempts, schedule, lease, payload, its stored result\n"
             "(routes with store_result) and the error of every failed attempt (with\n"
             "tracebacks). Control characters and terminal escape sequences in stored\n"
             "text are shown escaped (ESC as \\x1b); --json prints the stored values exactly.",
             run_show, examples=[
                 ("conveyor show 42", "the event and its error history"),
                 ("conveyor show 42 --json | jq -r .last_error", "one field for a script")])
    p.add_argument("id", help="event id")
    add_json(p, "every column, and errors: [{attempt, at, error, traceback, worker}]")


def run_show(ctx: Context, args: argparse.Namespace) -> int:
    record = Admin(ctx.schema).show(ctx.connect(), args.id)
    if args.json:
        emit_json(record.to_json())
        return 0
    data = record.to_json()
    errors = data.pop("errors")
    payload = data.pop("payload")
    result = data.pop("result")
    for key, value in data.items():
        say(f"{key:>16}: {'-' if value is None else escape(value)}")
    say(f"{'payload':>16}: {escape(json.dumps(payload))}")
    if result is not None:   # a store_result route's return value (docs/results.md)
        say(f"{'result':>16}: {escape(json.dumps(result))}")
    for e in errors:
        say(f"\nattempt {e['attempt']} at {escape(e['at'])}: {escape(e['error'])}")
        if e.get("traceback"):
            for line in escape_lines(e["traceback"].rstrip()):
                say(f"  {line}")
    return 0



def register_xlsx(sub: Sub, env: Env) -> None:
    p = _add(sub, "xlsx", "aggregate a workbook: rows, total and sum per tipo, as JSON",
             "Stream the first sheet of an XLSX file and print {\"rows\", \"total\", \"by_type\"}:\n"
             "the data-row count, the sum of the 'monto' column, and that sum per 'tipo'.\n"
             "Corrupt, truncated, non-XLSX and hostile files (zip bombs, XML entities) are\n"
             "refused with a one-line reason and a non-zero exit. Needs no database.\n"
             "On a terminal, stderr shows how far the reading is.",
             run_xlsx, examples=[("conveyor xlsx ventas.xlsx | jq .total", "the sum of 'monto'")])
    p.add_argument("file", help="path of the .xlsx file")


def run_xlsx(ctx: Context, args: argparse.Namespace) -> int:
    from conveyor.consumers.workbook import aggregate_workbook

    if not sys.stderr.isatty():
        emit_json(aggregate_workbook(args.file).to_json())
        return 0
    # On a terminal: how far the reader is through the file, from its position.
    try:
        source = open(args.file, "rb")  # noqa: SIM115 - closed by the with below
    except OSError as exc:   # the words Workbook uses for a path it cannot open
        raise WorkbookError(f"cannot open workbook: {exc.strerror or exc}") from None
    size = os.fstat(source.fileno()).st_size
    with source, Ticker(f"reading {os.path.basename(args.file)}",
                        lambda: source.tell() / size if size else None):
        result = aggregate_workbook(source)
    emit_json(result.to_json())
    return 0

