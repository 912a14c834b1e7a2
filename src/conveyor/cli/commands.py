"""One function per command: ``register_*`` adds the parser, ``run_*`` does the work."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from conveyor.admin import Admin
from conveyor.cli import multi
from conveyor.cli.context import Context, duration, positive_int
from conveyor.cli.durations import parse_duration
from conveyor.cli.process import StopSignals
from conveyor.config import (
    BATCH_SIZE_DEFAULT,
    CONCURRENCY_DEFAULT,
    HANDLER_TIMEOUT_DEFAULT,
    HEARTBEAT_INTERVAL_DEFAULT,
    HORIZON_ALERT_DEFAULT,
    LEASE_TTL_DEFAULT,
    POLL_INTERVAL_DEFAULT,
    RESCUE_INTERVAL_DEFAULT,
    SHUTDOWN_TIMEOUT_DEFAULT,
    ProducerConfig,
    WorkerConfig,
)
from conveyor.errors import ConfigError, InvalidInputError
from conveyor.producer import Producer
from conveyor.retry import BASE_DELAY_DEFAULT, MAX_DELAY_DEFAULT, BackoffPolicy
from conveyor.router import Router
from conveyor.schema.migrator import Migrator, migration_script
from conveyor.types import QueueStatus

Env = Callable[..., str | None]
Sub = Any  # argparse's private _SubParsersAction

log = logging.getLogger(__name__)


def _add(sub: Sub, name: str, help_text: str, description: str,
         run: Callable[[Context, argparse.Namespace], int]) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help_text, description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(handler=run)
    return parser


# ------------------------------------------------------------------- migrate

def register_migrate(sub: Sub, env: Env) -> None:
    p = _add(sub, "migrate", "create or upgrade Conveyor's schema",
             "Apply the numbered migrations that are missing, once, under an advisory lock\n"
             "(safe when many processes start together). With --sql, print the SQL instead\n"
             "so it can go into Alembic, Django or any other migration tool.", run_migrate)
    p.add_argument("--sql", action="store_true",
                   help="print the full migration script and touch no database")


def run_migrate(ctx: Context, args: argparse.Namespace) -> int:
    if args.sql:
        sys.stdout.write(migration_script(ctx.schema))
        return 0
    conn = ctx.connect(check_schema=False)
    applied = Migrator(ctx.schema).apply(conn)
    if applied:
        for m in applied:
            print(f"applied {m.version:04d}_{m.name}")
    else:
        print(f"schema {ctx.schema!r} is up to date")
    return 0


# ------------------------------------------------------------------- enqueue

def register_enqueue(sub: Sub, env: Env) -> None:
    p = _add(sub, "enqueue", "add one event and print its id",
             "Enqueue one event in its own transaction and print its id. With --key, a\n"
             "second enqueue of the same tenant and key prints the first event's id.",
             run_enqueue)
    p.add_argument("topic", help="dot-separated topic, e.g. email.send")
    p.add_argument("payload", nargs="?", default="{}", help="JSON payload (default: {})")
    p.add_argument("--tenant", help="owning tenant, a DNS label such as 'acme'")
    p.add_argument("--key", help="idempotency key")
    p.add_argument("--delay", type=duration, default=0.0,
                   help="run no earlier than this from now, e.g. 30s or 5m")
    p.add_argument("--priority", type=int, default=0, help="higher runs first (default: 0)")
    p.add_argument("--max-attempts", type=positive_int, default=None,
                   help="attempts before the event is parked failed (default: 5)")


def run_enqueue(ctx: Context, args: argparse.Namespace) -> int:
    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"payload is not valid JSON ({exc.msg}): {args.payload!r:.80}") from None
    producer = Producer(ProducerConfig(schema=ctx.schema))
    conn = ctx.connect()
    with conn.transaction():
        event_id = producer.enqueue(conn, args.topic, payload, tenant=args.tenant,
                                    idempotency_key=args.key, delay=args.delay,
                                    priority=args.priority, max_attempts=args.max_attempts)
    print(event_id)
    return 0


# -------------------------------------------------------------------- status

def register_status(sub: Sub, env: Env) -> None:
    p = _add(sub, "status", "counts by state and topic, oldest pending, live workers",
             "Show how many events are in each state, per topic; the age of the oldest due\n"
             "pending event; the workers alive; and pending topics no live worker claims.",
             run_status)
    p.add_argument("--json", action="store_true", help="print one JSON object")


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
        lines.append(f"  {w.name} (pid {w.pid}) topics: {', '.join(w.topics)}")
    topics: dict[str, dict[str, int]] = {}
    for t in status.by_topic:
        topics.setdefault(t.topic, {})[t.state.value] = t.count
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
                     + ", ".join(status.unhandled_topics))
    return "\n".join(lines)


def run_status(ctx: Context, args: argparse.Namespace) -> int:
    status = Admin(ctx.schema).status(ctx.connect())
    if args.json:
        print(json.dumps(status.to_json(), indent=None))
    else:
        print(format_status(status))
    return 0


# ---------------------------------------------------------------------- show

def register_show(sub: Sub, env: Env) -> None:
    p = _add(sub, "show", "one event with its error history",
             "Print one event: state, attempts, schedule, lease, payload and the error of\n"
             "every failed attempt (with tracebacks).", run_show)
    p.add_argument("id", help="event id")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_show(ctx: Context, args: argparse.Namespace) -> int:
    record = Admin(ctx.schema).show(ctx.connect(), args.id)
    if args.json:
        print(json.dumps(record.to_json(), default=str))
        return 0
    data = record.to_json()
    errors = data.pop("errors")
    payload = data.pop("payload")
    for key, value in data.items():
        print(f"{key:>16}: {'-' if value is None else value}")
    print(f"{'payload':>16}: {json.dumps(payload)}")
    for e in errors:
        print(f"\nattempt {e['attempt']} at {e['at']}: {e['error']}")
        if e.get("traceback"):
            print("  " + e["traceback"].rstrip().replace("\n", "\n  "))
    return 0


# --------------------------------------------------------------------- retry

def register_retry(sub: Sub, env: Env) -> None:
    p = _add(sub, "retry", "run a failed or cancelled event again",
             "Make one event (by id), or every failed event (--failed, optionally of one\n"
             "--topic), due now. An event whose attempts are spent gets one more.", run_retry)
    p.add_argument("id", nargs="?", help="event id")
    p.add_argument("--failed", action="store_true", help="retry every failed event")
    p.add_argument("--topic", help="with --failed: only this topic")


def run_retry(ctx: Context, args: argparse.Namespace) -> int:
    if (args.id is None) == (not args.failed):
        raise InvalidInputError("give either an event id or --failed")
    if args.topic and not args.failed:
        raise InvalidInputError("--topic only applies with --failed")
    admin = Admin(ctx.schema)
    conn = ctx.connect()
    if args.failed:
        ids = admin.retry_failed(conn, topic=args.topic)
        print(f"retrying {len(ids)} failed events")
    else:
        admin.retry(conn, args.id)
        print(f"event {args.id} will run again")
    return 0


# -------------------------------------------------------------------- cancel

def register_cancel(sub: Sub, env: Env) -> None:
    _add(sub, "cancel", "cancel a pending, running or failed event",
         "Mark an event cancelled so it never runs again. A worker still running it has\n"
         "its result discarded.", run_cancel).add_argument("id", help="event id")


def run_cancel(ctx: Context, args: argparse.Namespace) -> int:
    Admin(ctx.schema).cancel(ctx.connect(), args.id)
    print(f"event {args.id} cancelled")
    return 0


# --------------------------------------------------------------------- prune

def register_prune(sub: Sub, env: Env) -> None:
    p = _add(sub, "prune", "delete finished events older than a duration",
             "Delete succeeded, failed and cancelled events that finished longer ago than\n"
             "--older-than (e.g. 7d, 12h, 30m). Pending and running events are never touched.",
             run_prune)
    p.add_argument("--older-than", required=True, type=duration, metavar="DURATION",
                   help="e.g. 7d, 12h, 30m, 90s")
    p.add_argument("--state", action="append", choices=["succeeded", "failed", "cancelled"],
                   help="only this state (repeatable; default: all finished states)")


def run_prune(ctx: Context, args: argparse.Namespace) -> int:
    deleted = Admin(ctx.schema).prune(ctx.connect(), args.older_than, states=args.state)
    print(f"deleted {deleted} events")
    return 0


# -------------------------------------------------------------------- worker

def register_worker(sub: Sub, env: Env) -> None:
    p = _add(sub, "worker", "run a worker process until SIGTERM/SIGINT",
             "Claim and run events for the topics of the router given by --app, a\n"
             "'module:attribute' naming a conveyor.Router (or a function returning one).\n"
             "SIGTERM or SIGINT stops claiming, lets running handlers finish within\n"
             "--shutdown-timeout, hands the rest back without spending an attempt, exits 0.",
             run_worker)
    p.add_argument("--app", required=env("APP") is None, default=env("APP"), metavar="MODULE:ROUTER",
                   help="router to serve [env CONVEYOR_APP]")
    p.add_argument("--concurrency", type=positive_int,
                   default=env("CONCURRENCY", str(CONCURRENCY_DEFAULT)),
                   help="handlers running at once [env CONVEYOR_CONCURRENCY] (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int,
                   default=env("BATCH_SIZE", str(BATCH_SIZE_DEFAULT)),
                   help="events claimed per query [env CONVEYOR_BATCH_SIZE] (default: %(default)s)")
    p.add_argument("--poll-interval", type=duration,
                   default=env("POLL_INTERVAL", str(POLL_INTERVAL_DEFAULT)),
                   help="fallback poll when no NOTIFY arrives [env CONVEYOR_POLL_INTERVAL] "
                        "(default: %(default)ss)")
    p.add_argument("--lease-ttl", type=duration,
                   default=env("LEASE_TTL", str(LEASE_TTL_DEFAULT)),
                   help="claim validity without heartbeat [env CONVEYOR_LEASE_TTL] "
                        "(default: %(default)ss)")
    p.add_argument("--shutdown-timeout", type=duration,
                   default=env("SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_DEFAULT)),
                   help="grace for running handlers on SIGTERM [env CONVEYOR_SHUTDOWN_TIMEOUT] "
                        "(default: %(default)ss)")
    p.add_argument("--handler-timeout", type=duration,
                   default=env("HANDLER_TIMEOUT", str(HANDLER_TIMEOUT_DEFAULT)),
                   help="default limit for one handler call [env CONVEYOR_HANDLER_TIMEOUT] "
                        "(default: %(default)ss)")
    p.add_argument("--rescue-interval", type=duration,
                   default=env("RESCUE_INTERVAL", str(RESCUE_INTERVAL_DEFAULT)),
                   help="scan for expired leases this often [env CONVEYOR_RESCUE_INTERVAL] "
                        "(default: %(default)ss)")
    p.add_argument("--backoff-base", type=duration,
                   default=env("BACKOFF_BASE", str(BASE_DELAY_DEFAULT)),
                   help="retry delay after the first failed attempt, doubling per attempt "
                        "[env CONVEYOR_BACKOFF_BASE] (default: %(default)ss)")
    p.add_argument("--backoff-max", type=duration,
                   default=env("BACKOFF_MAX", str(MAX_DELAY_DEFAULT)),
                   help="cap on any retry delay [env CONVEYOR_BACKOFF_MAX] (default: %(default)ss)")
    p.add_argument("--retention", default=env("RETENTION", "7d"),
                   help="prune succeeded/cancelled events older than this; 'forever' keeps them, "
                        "0 deletes each succeeded event as it is acknowledged (fastest, no "
                        "history) [env CONVEYOR_RETENTION] (default: %(default)s)")
    p.add_argument("--tenant", action="append", dest="tenants", metavar="TENANT",
                   help="claim only this tenant's events (repeatable; default: every tenant)")
    p.add_argument("--name", default=env("WORKER_NAME"),
                   help="label shown by status [env CONVEYOR_WORKER_NAME] (default: host:pid)")
    p.add_argument("--no-listen", dest="listen", action="store_const", const="false",
                   default=env("LISTEN"),
                   help="do not LISTEN for notifications, find new events by polling only "
                        "[env CONVEYOR_LISTEN=false]")
    p.add_argument("--transaction-pooler", action="store_const", const="true",
                   default=env("TRANSACTION_POOLER"),
                   help="the database URL goes through PgBouncer in transaction mode (or a "
                        "similar pooler): keep no session state there and do not LISTEN through "
                        "it [env CONVEYOR_TRANSACTION_POOLER=true] (default: find out on the "
                        "first connection)")
    p.add_argument("--no-transaction-pooler", dest="transaction_pooler", action="store_const",
                   const="false",
                   help="the database URL reaches PostgreSQL directly or through a session "
                        "pooler: keep the worker's session state, skip the check "
                        "[env CONVEYOR_TRANSACTION_POOLER=false]")
    p.add_argument("--listen-url", default=env("LISTEN_URL"), metavar="URL",
                   help="direct PostgreSQL URL for the LISTEN connection, bypassing the pooler "
                        "[env CONVEYOR_LISTEN_URL] (default: the database URL)")
    p.add_argument("--horizon-alert", default=env("HORIZON_ALERT", f"{HORIZON_ALERT_DEFAULT:g}"),
                   metavar="DURATION",
                   help="log an alert when a transaction holds back vacuum this long; 'off' "
                        "disables the check [env CONVEYOR_HORIZON_ALERT] (default: %(default)ss)")
    add_event_loop_arg(p, env)


EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def add_event_loop_arg(p: argparse.ArgumentParser, env: Callable[..., str | None]) -> None:
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default=env("EVENT_LOOP", "auto"),
                   help="'uvloop' (installed with Conveyor on Linux and macOS: about 10-20 %% "
                        "less CPU per event and a faster wake-up), 'asyncio' (the standard "
                        "loop), or 'auto': uvloop when it can be imported "
                        "[env CONVEYOR_EVENT_LOOP] (default: %(default)s)")


def new_event_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """The worker's event loop: uvloop when asked for or, with ``auto``, when installed."""
    if kind not in EVENT_LOOPS:
        raise InvalidInputError(f"invalid event loop {kind!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise InvalidInputError(
                    "--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_flag(raw: str | None, name: str, default: bool | None) -> bool | None:
    """A boolean flag or CONVEYOR_<name>; anything but the usual spellings is refused by name."""
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise InvalidInputError(f"invalid CONVEYOR_{name} {raw!r}: expected true or false")


def load_router(spec: str) -> Router:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidInputError(f"invalid --app {spec!r}: expected 'module:attribute'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInputError(f"cannot import module {module_name!r} for --app: {exc}") from None
    target = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidInputError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(target, Router) and callable(target):
        target = target()
    if not isinstance(target, Router):
        raise InvalidInputError(f"--app {spec!r} is a {type(target).__name__}, not a conveyor.Router")
    return target


def run_until_stopped(main: Coroutine[Any, Any, None], event_loop: str = "auto") -> None:
    """Like asyncio.run, but never waits for threads a handler left running.

    asyncio.run joins the loop's default executor on the way out, so one handler
    still inside ``asyncio.to_thread`` would hold the process past its shutdown
    timeout. Here the default executor's threads carry the handler-thread name
    (so the exit path below sees them) and are not joined.
    """
    try:
        loop = new_event_loop(event_loop)
    except InvalidInputError:
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

    stop = StopSignals().install()   # before the app's import, which may take a while
    router = load_router(args.app)
    retention = None if args.retention == "forever" else parse_duration(args.retention)
    try:
        config = WorkerConfig(
            schema=ctx.schema, name=args.name, concurrency=args.concurrency,
            batch_size=args.batch_size, poll_interval=args.poll_interval,
            lease_ttl=args.lease_ttl, shutdown_timeout=args.shutdown_timeout,
            handler_timeout=args.handler_timeout, rescue_interval=args.rescue_interval,
            heartbeat_interval=min(HEARTBEAT_INTERVAL_DEFAULT, args.lease_ttl / 3),
            retention=retention,
            tenants=tuple(args.tenants) if args.tenants else None,
            backoff=BackoffPolicy(base_delay=args.backoff_base,
                                  max_delay=max(args.backoff_max, args.backoff_base)),
            listen=env_flag(args.listen, "LISTEN", True) is not False,  # never None here
            transaction_pooler=env_flag(args.transaction_pooler, "TRANSACTION_POOLER", None),
            horizon_alert_after=(None if args.horizon_alert.strip().lower() == "off"
                                 else parse_duration(args.horizon_alert)))
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


# ----------------------------------------------------------- bench and demo

def register_bench(sub: Sub, env: Env) -> None:
    p = _add(sub, "bench", "measure enqueue, drain and wake-up against a raw-SQL baseline",
             "Run the benchmark suite in one go against a raw-SQL baseline measured in the\n"
             "same run on the same database, and print figures and ratios.", run_bench)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--events", type=positive_int, default=20_000,
                   help="events per drain measurement (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="smaller sizes for a fast smoke run")
    p.add_argument("--consumers", action="store_true",
                   help="benchmark the consumers instead (needs no database): XLSX aggregation "
                        "vs openpyxl, hostile files, SMTP mails/s with and without connection "
                        "reuse; needs the test extras (openpyxl, XlsxWriter, aiosmtpd, trustme)")


def run_bench(ctx: Context, args: argparse.Namespace) -> int:
    from conveyor.bench import run as bench_run

    return int(bench_run(ctx, args))


def register_demo(sub: Sub, env: Env) -> None:
    p = _add(sub, "demo", "migrate, enqueue a realistic mix, run a worker with live progress",
             "The guided tour: migrates, enqueues a mix of events (some fail and retry, one\n"
             "is parked), runs a worker process while showing live progress, and ends with\n"
             "the status summary.", run_demo)
    p.add_argument("--events", type=positive_int, default=200,
                   help="events to enqueue (default: %(default)s)")


def run_demo(ctx: Context, args: argparse.Namespace) -> int:
    from conveyor.demo import run as demo_run

    return int(demo_run(ctx, args))


# ---------------------------------------------------------------------- xlsx

def register_xlsx(sub: Sub, env: Env) -> None:
    p = _add(sub, "xlsx", "aggregate a workbook: rows, total and sum per tipo, as JSON",
             "Stream the first sheet of an XLSX file and print {\"rows\", \"total\", \"by_type\"}:\n"
             "the data-row count, the sum of the 'monto' column, and that sum per 'tipo'.\n"
             "Corrupt, truncated, non-XLSX and hostile files (zip bombs, XML entities) are\n"
             "refused with a one-line reason and a non-zero exit. Needs no database.",
             run_xlsx)
    p.add_argument("file", help="path of the .xlsx file")


def run_xlsx(ctx: Context, args: argparse.Namespace) -> int:
    from conveyor.workbook import aggregate_workbook

    print(json.dumps(aggregate_workbook(args.file).to_json()))
    return 0


REGISTRY = [register_migrate, register_worker, register_enqueue, register_status, register_show,
            register_retry, register_cancel, register_prune, register_bench, register_demo,
            register_xlsx, *multi.REGISTRY]
