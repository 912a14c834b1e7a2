"""One function per command: ``register_*`` adds the parser, ``run_*`` does the work."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg

from conveyor.admin import SCHEDULED, Admin
from conveyor.cli import events, multi
from conveyor.cli.context import Context, duration, positive_int
from conveyor.cli.options import add_command, add_json, boolean, label, option, usage_error
from conveyor.cli.output import emit_json, escape, escape_lines, say
from conveyor.cli.process import StopSignals
from conveyor.cli.progress import Ticker
from conveyor.config import (
    BATCH_SIZE_DEFAULT,
    CONCURRENCY_DEFAULT,
    HANDLER_TIMEOUT_DEFAULT,
    HEARTBEAT_INTERVAL_DEFAULT,
    HORIZON_ALERT_DEFAULT,
    LEASE_TTL_DEFAULT,
    POLL_INTERVAL_DEFAULT,
    RESCUE_INTERVAL_DEFAULT,
    RETENTION_DEFAULT,
    SHUTDOWN_TIMEOUT_DEFAULT,
    ProducerConfig,
    WorkerConfig,
)
from conveyor.db.execute import run
from conveyor.db.named_queries import queries_for
from conveyor.errors import (
    ConfigError,
    DatabaseError,
    InvalidInputError,
    MissingExtraError,
    WorkbookError,
)
from conveyor.producer import Producer
from conveyor.retry import BASE_DELAY_DEFAULT, MAX_DELAY_DEFAULT, BackoffPolicy
from conveyor.router import Router
from conveyor.schema.migrator import Migrator, migration_script
from conveyor.types import QueueStatus

Env = Callable[..., str | None]
Sub = Any  # argparse's private _SubParsersAction

log = logging.getLogger(__name__)


_add = add_command


# ------------------------------------------------------------------- migrate

def register_migrate(sub: Sub, env: Env) -> None:
    p = _add(sub, "migrate", "create or upgrade Conveyor's schema",
             "Apply the numbered migrations that are missing, once, under an advisory lock\n"
             "(safe when many processes start together). With --sql, print the SQL instead\n"
             "so it can go into Alembic, Django or any other migration tool.", run_migrate,
             examples=[("conveyor migrate", "create or upgrade the schema 'conveyor'"),
                       ("conveyor migrate --json", "the same; print the versions applied"),
                       ("conveyor --schema jobs migrate --sql > conveyor.sql",
                        "the SQL for your own migration tool")])
    p.add_argument("--sql", action="store_true",
                   help="print the full migration script and touch no database")
    add_json(p, '{"schema", "applied": [{"version", "name"}], "version"}')


def run_migrate(ctx: Context, args: argparse.Namespace) -> int:
    if args.sql:
        if args.json:
            usage_error(args, "--json does not apply with --sql, which prints SQL")
        sys.stdout.write(migration_script(ctx.schema))
        return 0
    conn = ctx.connect(check_schema=False)
    migrator = Migrator(ctx.schema)
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


# ------------------------------------------------------------------- enqueue

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
    p.add_argument("--delay", type=duration, default=0.0, metavar="DURATION",
                   help="run no earlier than this from now, e.g. 30s or 5m")
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
                                        priority=args.priority, max_attempts=args.max_attempts)
    finally:
        conn.isolation_level = None
    return event_id, existing is not None


# -------------------------------------------------------------------- status

def register_status(sub: Sub, env: Env) -> None:
    p = _add(sub, "status", "counts by state and topic, oldest pending, live workers",
             "Show how many events are in each state, per topic; the age of the oldest due\n"
             "pending event; the workers alive; and pending topics no live worker claims.",
             run_status, examples=[
                 ("conveyor status", "the summary for a human"),
                 ("conveyor status --json | jq .counts.failed", "one figure for a script")])
    add_json(p, "counts, by_topic, oldest_pending_age_s, workers, unhandled_topics, ...")


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
    for t in status.by_topic:
        row = topics.setdefault(escape(t.topic), {})
        row[t.state.value] = t.count
        if t.scheduled:     # carried on the topic's pending row (TopicCount.scheduled)
            row[SCHEDULED] = row.get(SCHEDULED, 0) + t.scheduled
    if topics:
        width = max(len("topic"), *(len(t) for t in topics))
        states = [s for s in c if not approx[s]]     # estimates have no per-topic split
        lines.append("")
        lines.append(f"{'topic':<{width}}  " + "  ".join(f"{s:>9}" for s in states))
        for topic in sorted(topics):
            row = topics[topic]
            lines.append(f"{topic:<{width}}  " + "  ".join(f"{row.get(s, 0):>9}" for s in states))
    if status.unhandled_topics:
        lines.append("")
        lines.append("pending with no live worker claiming them: "
                     + escape(", ".join(status.unhandled_topics)))
    return "\n".join(lines)


def run_status(ctx: Context, args: argparse.Namespace) -> int:
    status = Admin(ctx.schema).status(ctx.connect())
    if args.json:
        emit_json(status.to_json())
    else:
        say(format_status(status))
    return 0


# ---------------------------------------------------------------------- show

def register_show(sub: Sub, env: Env) -> None:
    p = _add(sub, "show", "one event with its error history",
             "Print one event: state, attempts, schedule, lease, payload and the error of\n"
             "every failed attempt (with tracebacks). Control characters and terminal\n"
             "escape sequences in stored text are shown escaped (ESC as \\x1b); --json\n"
             "prints the stored values exactly.", run_show, examples=[
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
    for key, value in data.items():
        say(f"{key:>16}: {'-' if value is None else escape(value)}")
    say(f"{'payload':>16}: {escape(json.dumps(payload))}")
    for e in errors:
        say(f"\nattempt {e['attempt']} at {escape(e['at'])}: {escape(e['error'])}")
        if e.get("traceback"):
            for line in escape_lines(e["traceback"].rstrip()):
                say(f"  {line}")
    return 0


# -------------------------------------------------------------------- worker

def register_worker(sub: Sub, env: Env) -> None:
    p = _add(sub, "worker", "run a worker process until SIGTERM/SIGINT",
             "Claim and run events for the topics of the router given by --app, a\n"
             "'module:attribute' naming a conveyor.Router (or a function taking no\n"
             "arguments that returns one). SIGTERM or SIGINT stops claiming, lets running\n"
             "handlers finish within --shutdown-timeout, hands the rest back without\n"
             "spending an attempt, exits 0.\n\n"
             "A worker needs --database-url (or CONVEYOR_DATABASE_URL): without one it\n"
             "refuses to start, unless --embedded asks for the embedded PostgreSQL.",
             run_worker, examples=[
                 ("CONVEYOR_DATABASE_URL=postgresql://app@db/app \\\n"
                  "    conveyor worker --app myapp.tasks:router", "serve a router"),
                 ("conveyor worker --app myapp.tasks:router --concurrency 20 --tenant acme",
                  "one tenant, 20 handlers at once"),
                 ("conveyor worker --app myapp.tasks:router --embedded",
                  "try it on the embedded PostgreSQL"),
             ])
    option(p, "--app", env="APP", required=True, metavar="MODULE:ROUTER",
           help="router to serve")
    p.add_argument("--embedded", action="store_true",
                   help="without a database URL, run on the embedded PostgreSQL (for trying "
                        "Conveyor: its data is private to this machine)")
    option(p, "--concurrency", env="CONCURRENCY", type=positive_int, default=CONCURRENCY_DEFAULT,
           help="handlers running at once")
    option(p, "--batch-size", env="BATCH_SIZE", type=positive_int, default=BATCH_SIZE_DEFAULT,
           help="events claimed per query")
    option(p, "--poll-interval", env="POLL_INTERVAL", type=duration, unit="s",
           default=POLL_INTERVAL_DEFAULT, help="fallback poll when no NOTIFY arrives")
    option(p, "--lease-ttl", env="LEASE_TTL", type=duration, unit="s", default=LEASE_TTL_DEFAULT,
           help="claim validity without heartbeat")
    option(p, "--shutdown-timeout", env="SHUTDOWN_TIMEOUT", type=duration, unit="s",
           default=SHUTDOWN_TIMEOUT_DEFAULT, help="grace for running handlers on SIGTERM")
    option(p, "--handler-timeout", env="HANDLER_TIMEOUT", type=duration, unit="s",
           default=HANDLER_TIMEOUT_DEFAULT, help="default limit for one handler call")
    option(p, "--rescue-interval", env="RESCUE_INTERVAL", type=duration, unit="s",
           default=RESCUE_INTERVAL_DEFAULT, help="scan for expired leases this often")
    option(p, "--backoff-base", env="BACKOFF_BASE", type=duration, unit="s",
           default=BASE_DELAY_DEFAULT,
           help="retry delay after the first failed attempt, doubling per attempt")
    option(p, "--backoff-max", env="BACKOFF_MAX", type=duration, unit="s",
           default=MAX_DELAY_DEFAULT, help="cap on any retry delay")
    option(p, "--retention", env="RETENTION", type=retention, unit="s", default=RETENTION_DEFAULT,
           help="prune succeeded/cancelled events older than this; 'forever' keeps them, "
                "0 deletes each succeeded event as it is acknowledged (fastest, no history)")
    p.add_argument("--tenant", action="append", dest="tenants", metavar="TENANT",
                   help="claim only this tenant's events (repeatable; default: every tenant)")
    option(p, "--name", env="WORKER_NAME", type=label, shown="host:pid",
           help="label shown by status")
    option(p, "--no-listen", dest="listen", action="store_false", env="LISTEN", env_type=boolean,
           default=True, shown="listen",
           help="do not LISTEN for notifications, find new events by polling only")
    option(p, "--transaction-pooler", action="store_const", const=True, env="TRANSACTION_POOLER",
           env_type=boolean, shown="find out on the first connection",
           help="the database URL goes through PgBouncer in transaction mode (or a similar "
                "pooler): keep no session state there and do not LISTEN through it")
    p.add_argument("--no-transaction-pooler", dest="transaction_pooler", action="store_const",
                   const=False,
                   help="the database URL reaches PostgreSQL directly or through a session "
                        "pooler: keep the worker's session state, skip the check")
    option(p, "--listen-url", env="LISTEN_URL", metavar="URL", secret=True,
           shown="the database URL",
           help="direct PostgreSQL URL for the LISTEN connection, bypassing the pooler")
    option(p, "--horizon-alert", env="HORIZON_ALERT", type=off_or_duration, unit="s",
           default=HORIZON_ALERT_DEFAULT,
           help="log an alert when a transaction holds back vacuum this long; 'off' disables "
                "the check")
    add_event_loop_arg(p, env)


def retention(text: str) -> float | None:
    """argparse type: a duration, or 'forever' (None: keep finished events)."""
    return None if text.strip().lower() == "forever" else duration(text)


def off_or_duration(text: str) -> float | None:
    """argparse type: a duration, or 'off' (None: the check is disabled)."""
    return None if text.strip().lower() == "off" else duration(text)


EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def add_event_loop_arg(p: argparse.ArgumentParser, env: Callable[..., str | None]) -> None:
    option(p, "--event-loop", env="EVENT_LOOP", choices=EVENT_LOOPS, default="auto",
           help="'uvloop' (the 'uvloop' extra, Linux and macOS: about 10-20 %% "
                "less CPU per event and a faster wake-up), 'asyncio' (the standard "
                "loop), or 'auto': uvloop when it can be imported")


def new_event_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """The worker's event loop: uvloop when asked for or, with ``auto``, when installed.

    ``uvloop`` without the extra raises MissingExtraError; ``auto`` falls back
    to asyncio's loop quietly. Defaults to ``auto``.
    """
    if kind not in EVENT_LOOPS:
        raise InvalidInputError(f"invalid event loop {kind!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError as exc:
            if kind == "uvloop":
                raise MissingExtraError("--event-loop uvloop", "uvloop", module=exc.name) from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def load_router(spec: str) -> Router:
    """The Router named by ``--app``: an attribute, or what a function of no arguments returns.

    Whatever goes wrong (the module raises at import, the target needs
    arguments or raises, it is no Router) is one InvalidInputError naming the
    target and the reason: user code must not turn into a traceback here.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidInputError(f"invalid --app {spec!r}: expected 'module:attribute'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInputError(f"cannot import module {module_name!r} for --app: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any error of user code at import
        raise InvalidInputError(f"--app {spec!r}: importing {module_name!r} raised "
                                f"{_describe_error(exc)}") from None
    target = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidInputError(f"module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(target, Router):
        return target
    if not callable(target) or isinstance(target, type):
        kind = f"class {target.__name__}" if isinstance(target, type) else type(target).__name__
        raise InvalidInputError(f"--app {spec!r} is a {kind}, not a conveyor.Router")
    return _build_router(spec, target)


def _build_router(spec: str, factory: Callable[..., object]) -> Router:
    try:
        inspect.signature(factory).bind()
    except TypeError as exc:
        raise InvalidInputError(f"--app {spec!r} needs arguments ({exc}); name a Router or "
                                "a function taking none") from None
    except ValueError:
        pass  # no signature to read (some builtins): calling it will tell
    try:
        built = factory()
    except Exception as exc:  # noqa: BLE001 - any error of user code building the router
        raise InvalidInputError(f"--app {spec!r} raised {_describe_error(exc)}") from None
    if not isinstance(built, Router):
        raise InvalidInputError(
            f"--app {spec!r} returned a {type(built).__name__}, not a conveyor.Router")
    return built


def _describe_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def run_until_stopped(main: Coroutine[Any, Any, None], event_loop: str = "auto") -> None:
    """Like asyncio.run, but never waits for threads a handler left running.

    asyncio.run joins the loop's default executor on the way out, so one handler
    still inside ``asyncio.to_thread`` would hold the process past its shutdown
    timeout. Here the default executor's threads carry the handler-thread name
    (so the exit path below sees them) and are not joined.
    """
    try:
        loop = new_event_loop(event_loop)
    except (InvalidInputError, MissingExtraError):
        main.close()  # never awaited: say so quietly instead of warning
        raise
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="conveyor-handler-default"))
    try:
        loop.run_until_complete(main)
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()  # shuts the default executor down without waiting for its threads


def run_worker(ctx: Context, args: argparse.Namespace) -> int:
    from conveyor.worker import Worker

    if ctx.embedded and not args.embedded:
        raise InvalidInputError(
            "no database for the worker: set --database-url or CONVEYOR_DATABASE_URL, or pass "
            "--embedded to run on the embedded PostgreSQL")
    stop = StopSignals().install()   # before the app's import, which may take a while
    router = load_router(args.app)
    try:
        config = WorkerConfig(
            schema=ctx.schema, name=args.name, concurrency=args.concurrency,
            batch_size=args.batch_size, poll_interval=args.poll_interval,
            lease_ttl=args.lease_ttl, shutdown_timeout=args.shutdown_timeout,
            handler_timeout=args.handler_timeout, rescue_interval=args.rescue_interval,
            heartbeat_interval=min(HEARTBEAT_INTERVAL_DEFAULT, args.lease_ttl / 3),
            retention=args.retention,
            tenants=tuple(args.tenants) if args.tenants else None,
            backoff=BackoffPolicy(base_delay=args.backoff_base,
                                  max_delay=max(args.backoff_max, args.backoff_base)),
            listen=args.listen, transaction_pooler=args.transaction_pooler,
            horizon_alert_after=args.horizon_alert)
    except ConfigError as exc:
        raise InvalidInputError(str(exc)) from None
    if stop.requested:
        log.info("stopped before the worker started", extra={"action": "stopped"})
        return 0
    worker = Worker(ctx.url(), router, config, listen_conninfo=args.listen_url)

    async def serve() -> None:
        worker.install_signal_handlers()
        stop.forward_to(worker.request_stop)
        await worker.run()

    run_until_stopped(serve(), args.event_loop)
    stop.install()   # closing the loop restored the default handlers; the exit is under way
    s = worker.stats
    log.info("worker exiting: %d succeeded, %d retried, %d failed, %d handed back",
             s.succeeded, s.retried, s.failed, s.handed_back, extra={"action": "exit"})
    leave_stuck_handler_threads(ctx)
    return 0


def leave_stuck_handler_threads(ctx: Context) -> None:
    """Exit at once if plain handlers still run in threads; their events were handed back.

    Such threads cannot be interrupted, and waiting for them would hold the
    process past its shutdown timeout. Idle pool threads exit as soon as they
    see the shutdown; one shared deadline bounds the wait however many are stuck.
    """
    handler_threads = [t for t in threading.enumerate() if t.name.startswith("conveyor-handler")]
    deadline = time.monotonic() + 0.5
    for thread in handler_threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [t for t in handler_threads if t.is_alive()]
    if stuck:
        log.warning("%d handler threads still running at exit; leaving them", len(stuck),
                    extra={"action": "exit_abandon_threads"})
        ctx.close()
        logging.shutdown()
        os._exit(0)


# ---------------------------------------------------------------------- xlsx

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
    from conveyor.workbook import aggregate_workbook

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


REGISTRY = [register_migrate, register_worker, register_enqueue, register_status,
            events.register_events, register_show, events.register_retry,
            events.register_cancel, events.register_prune, register_xlsx, *multi.REGISTRY]
