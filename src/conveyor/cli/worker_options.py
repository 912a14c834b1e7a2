"""A worker process's options and its construction from them: shared by
``conveyor worker`` and ``conveyor relay`` (the command modules import no
other command module; only main gathers them)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from conveyor.cli.context import Context, duration, positive_int
from conveyor.cli.options import boolean, label, option
from conveyor.cli.process import (
    StopSignals,
    add_event_loop_arg,
    add_metrics_args,
    add_tracing_arg,
    leave_stuck_handler_threads,
)
from conveyor.config import (
    BATCH_SIZE_DEFAULT,
    CONCURRENCY_DEFAULT,
    FAILURE_LOG_LIMIT_DEFAULT,
    HANDLER_TIMEOUT_DEFAULT,
    HEARTBEAT_INTERVAL_DEFAULT,
    HORIZON_ALERT_DEFAULT,
    LEASE_TTL_DEFAULT,
    POLL_INTERVAL_DEFAULT,
    QUERY_TIMEOUT_DEFAULT,
    RESCUE_INTERVAL_DEFAULT,
    RETENTION_DEFAULT,
    SHUTDOWN_TIMEOUT_DEFAULT,
    WorkerConfig,
)
from conveyor.errors import ConfigError, InvalidInputError
from conveyor.retry import BASE_DELAY_DEFAULT, MAX_DELAY_DEFAULT, BackoffPolicy

if TYPE_CHECKING:
    from conveyor.cli.metrics_serving import WorkerMetrics
    from conveyor.middleware import Middleware
    from conveyor.router import Router
    from conveyor.worker import Worker
    from conveyor.worker.service import Service

Env = Callable[..., str | None]

log = logging.getLogger(__name__)


def add_worker_options(p: argparse.ArgumentParser, env: Env, *, embedded: bool = True) -> None:
    """The options of a worker process, but --app (conveyor worker and conveyor relay).

    ``embedded=False`` leaves out ``--embedded`` (``manage.py conveyor_worker``,
    whose database is Django's).
    """
    if embedded:
        p.add_argument("--embedded", action="store_true",
                       help="without a database URL, run on the embedded PostgreSQL (for "
                            "trying Conveyor: its data is private to this machine)")
    option(p, "--concurrency", env="CONCURRENCY", type=positive_int, default=CONCURRENCY_DEFAULT,
           help="handlers running at once")
    option(p, "--batch-size", env="BATCH_SIZE", type=positive_int, default=BATCH_SIZE_DEFAULT,
           help="events claimed per query while the worker keeps up")
    option(p, "--max-batch-size", env="MAX_BATCH_SIZE", type=positive_int, default=None,
           help="most events claimed per query: with a backlog, claims grow from "
                "--batch-size toward the free slots up to this (default: half of "
                "--concurrency, so the next claim runs while a batch does; equal to "
                "--batch-size keeps claims fixed)")
    option(p, "--claim-window", env="CLAIM_WINDOW", type=duration, unit="s", default=0.0,
           help="hold a claimed batch in the claim's transaction this long, writing the "
                "outcomes of its fast events with it (each written once, not twice) and "
                "leasing the rest at its end; 0 leases every claim")
    option(p, "--poll-interval", env="POLL_INTERVAL", type=duration, unit="s",
           default=POLL_INTERVAL_DEFAULT, help="fallback poll when no NOTIFY arrives")
    option(p, "--lease-ttl", env="LEASE_TTL", type=duration, unit="s", default=LEASE_TTL_DEFAULT,
           help="claim validity without heartbeat")
    option(p, "--shutdown-timeout", env="SHUTDOWN_TIMEOUT", type=duration, unit="s",
           default=SHUTDOWN_TIMEOUT_DEFAULT, help="grace for running handlers on SIGTERM")
    option(p, "--handler-timeout", env="HANDLER_TIMEOUT", type=duration, unit="s",
           default=HANDLER_TIMEOUT_DEFAULT, help="default limit for one handler call")
    option(p, "--query-timeout", env="QUERY_TIMEOUT", type=duration, unit="s",
           default=QUERY_TIMEOUT_DEFAULT,
           help="longest wait for one worker statement before its connection is replaced "
                "(also how long /healthz tolerates no claim, with twice --poll-interval)")
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
    option(p, "--failure-log-limit", env="FAILURE_LOG_LIMIT", type=off_or_count,
           default=FAILURE_LOG_LIMIT_DEFAULT,
           help="log lines of failures per topic and outcome a minute; the rest are counted "
                "in one line a minute; 'off' logs every one")
    add_metrics_args(p)
    add_tracing_arg(p)
    add_event_loop_arg(p, env)


def retention(text: str) -> float | None:
    """argparse type: a duration, or 'forever' (None: keep finished events)."""
    return None if text.strip().lower() == "forever" else duration(text)


def off_or_duration(text: str) -> float | None:
    """argparse type: a duration, or 'off' (None: the check is disabled)."""
    return None if text.strip().lower() == "off" else duration(text)


def off_or_count(text: str) -> int | None:
    """argparse type: a whole number, or 'off' (None: no limit)."""
    if text.strip().lower() == "off":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'off', got {text!r}") from None


def refuse_without_database(ctx: Context, args: argparse.Namespace, what: str) -> None:
    if ctx.embedded and not args.embedded:
        raise InvalidInputError(
            f"no database for {what}: set --database-url or CONVEYOR_DATABASE_URL, or pass "
            "--embedded to run on the embedded PostgreSQL")


def build_worker(ctx: Context, args: argparse.Namespace, router: Router,
                 middleware: list[Middleware], stop: StopSignals, *,
                 services: Sequence[Service] = ()
                 ) -> tuple[Worker, WorkerMetrics | None] | None:
    """The worker (and its metrics server) the options ask for, running ``services``
    beside its own (and the metrics refresher); None if a stop came first."""
    from conveyor.worker import Worker

    try:
        config = WorkerConfig(
            schema=ctx.schema, name=args.name, concurrency=args.concurrency,
            batch_size=args.batch_size, max_batch_size=args.max_batch_size,
            poll_interval=args.poll_interval, claim_window=args.claim_window,
            lease_ttl=args.lease_ttl, shutdown_timeout=args.shutdown_timeout,
            handler_timeout=args.handler_timeout, rescue_interval=args.rescue_interval,
            heartbeat_interval=min(HEARTBEAT_INTERVAL_DEFAULT, args.lease_ttl / 3),
            retention=args.retention,
            tenants=tuple(args.tenants) if args.tenants else None,
            backoff=BackoffPolicy(base_delay=args.backoff_base,
                                  max_delay=max(args.backoff_max, args.backoff_base)),
            listen=args.listen, transaction_pooler=args.transaction_pooler,
            horizon_alert_after=args.horizon_alert, query_timeout=args.query_timeout,
            failure_log_limit=args.failure_log_limit)
    except ConfigError as exc:
        raise InvalidInputError(str(exc)) from None
    if stop.requested:
        log.info("stopped before the worker started", extra={"action": "stopped"})
        return None
    metrics = None
    if args.metrics_port is not None:
        from conveyor.cli.metrics_serving import WorkerMetrics
        metrics = WorkerMetrics(ctx.url(), ctx.schema)
        middleware.append(metrics.middleware)
        services = [*services, metrics.gauges]
    worker = Worker(ctx.url(), router, config, listen_conninfo=args.listen_url,
                    middleware=middleware, services=services)
    if metrics is not None:
        metrics.serve(worker, args.metrics_host, args.metrics_port)
    return worker, metrics


def report_exit(ctx: Context, worker: Worker) -> None:
    s = worker.stats
    log.info("worker exiting: %d succeeded, %d retried, %d failed, %d handed back",
             s.succeeded, s.retried, s.failed, s.handed_back, extra={"action": "exit"})
    leave_stuck_handler_threads(ctx)

