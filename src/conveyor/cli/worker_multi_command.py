"""``conveyor worker-multi``: one worker process for many tenant databases."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from conveyor.cli.context import Context, duration, positive_int
from conveyor.cli.options import add_command, label, option
from conveyor.cli.process import (
    StopSignals,
    add_event_loop_arg,
    add_metrics_args,
    add_tracing_arg,
    import_target,
    leave_stuck_handler_threads,
    serve_until_stopped,
    tracing_middleware,
)
from conveyor.config import (
    HANDLER_TIMEOUT_DEFAULT,
    HEARTBEAT_INTERVAL_DEFAULT,
    POLL_INTERVAL_DEFAULT,
    SHUTDOWN_TIMEOUT_DEFAULT,
    WorkerConfig,
)
from conveyor.errors import ConfigError, InvalidInputError
from conveyor.multitenant import (
    CONNECTIONS_PER_SERVER_DEFAULT,
    RESCAN_INTERVAL_DEFAULT,
    TENANT_CONCURRENCY_DEFAULT,
    TURN_LENGTH_DEFAULT,
    DirectoryTenants,
    MultiTenantConfig,
    MultiTenantWorker,
    StaticTenants,
    TenantSource,
    load_app,
)

Env = Any
Sub = Any  # argparse's private _SubParsersAction

log = logging.getLogger(__name__)


def register_worker_multi(sub: Sub, env: Env) -> None:
    p = add_command(sub, "worker-multi", "one worker process for many tenant databases",
             "Serve every tenant database with a worker of its own in this process, within\n"
             "--connections-per-server per database server (a tenant's worker runs while it\n"
             "has work or the room is not needed; docs/multitenant.md): a list of\n"
             "--dsn [TENANT=]URL, or --tenants-dir holding <tenant>.dsn files, re-scanned\n"
             "every --rescan-interval so tenants can be added or removed while it runs.\n"
             "Each tenant database is migrated when it is added. --app names a Router, or a\n"
             "function taking a conveyor.multitenant.TenantDatabase and returning one.\n"
             "Without tenant databases it refuses to start: it never uses the embedded\n"
             "PostgreSQL, nor the global --database-url.")
    p.set_defaults(handler=run_worker_multi)
    option(p, "--app", env="APP", required=True, metavar="MODULE:ROUTER",
           help="router or router factory")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--dsn", action="append", metavar="[TENANT=]URL",
                       help="a tenant database (repeatable); without TENANT= the database "
                            "name is the tenant")
    option(group, "--tenants-dir", env="TENANTS_DIR", metavar="DIR",
           help="directory of <tenant>.dsn files, each holding one URL")
    option(p, "--concurrency", type=positive_int, default=TENANT_CONCURRENCY_DEFAULT,
           help="handlers running at once per tenant")
    option(p, "--rescan-interval", type=duration, unit="s", default=RESCAN_INTERVAL_DEFAULT,
           help="re-read the tenant list this often")
    option(p, "--poll-interval", type=duration, unit="s", default=POLL_INTERVAL_DEFAULT,
           help="due check of each parked tenant, and fallback poll per tenant when no "
                "NOTIFY arrives")
    option(p, "--connections-per-server", env="CONNECTIONS_PER_SERVER", type=positive_int,
           default=CONNECTIONS_PER_SERVER_DEFAULT, metavar="N",
           help="the most connections held on one database server, all its tenants "
                "together; idle tenants give theirs up when others need them")
    option(p, "--turn-length", type=duration, unit="s", default=TURN_LENGTH_DEFAULT,
           help="how long a busy tenant keeps its worker while others wait for room")
    option(p, "--shutdown-timeout", type=duration, unit="s", default=SHUTDOWN_TIMEOUT_DEFAULT,
           help="grace for running handlers on SIGTERM")
    option(p, "--handler-timeout", type=duration, unit="s", default=HANDLER_TIMEOUT_DEFAULT,
           help="default limit for one handler call")
    option(p, "--name", env="WORKER_NAME", type=label, shown="host:pid",
           help="label shown by status, '/<tenant>' appended")
    add_metrics_args(p, every_tenant=True)
    add_tracing_arg(p)
    add_event_loop_arg(p, env)


NO_TENANTS = ("no tenant databases for worker-multi: pass --dsn TENANT=URL (repeatable) or "
              "--tenants-dir DIR (or set CONVEYOR_TENANTS_DIR); it never runs on the embedded "
              "PostgreSQL or the global --database-url")


def _tenant_source(args: argparse.Namespace) -> TenantSource:
    # --dsn flags win over a CONVEYOR_TENANTS_DIR default, as flags win everywhere.
    if args.dsn:
        return StaticTenants(args.dsn)
    if args.tenants_dir:
        source = DirectoryTenants(args.tenants_dir)
        source.scan()  # fail now, with the path in the message, if it is not a directory
        return source
    raise InvalidInputError(NO_TENANTS)


def run_worker_multi(ctx: Context, args: argparse.Namespace) -> int:
    try:
        source = _tenant_source(args)      # before the app's import: refuse at once
        middleware = tracing_middleware(args)
        stop = StopSignals().install()
        app = load_app(import_target(args.app))
        config = MultiTenantConfig(
            worker=WorkerConfig(
                schema=ctx.schema, name=args.name, concurrency=args.concurrency,
                poll_interval=args.poll_interval, shutdown_timeout=args.shutdown_timeout,
                handler_timeout=args.handler_timeout,
                heartbeat_interval=HEARTBEAT_INTERVAL_DEFAULT),
            rescan_interval=args.rescan_interval,
            connections_per_server=args.connections_per_server, turn_length=args.turn_length)
    except ConfigError as exc:
        raise InvalidInputError(str(exc)) from None
    if stop.requested:
        log.info("stopped before the worker started", extra={"action": "stopped"})
        return 0
    metrics = None
    if args.metrics_port is not None:
        from conveyor.cli.metrics_serving import TenantsMetrics
        metrics = TenantsMetrics(ctx.schema)
        middleware.append(metrics.middleware)
    worker = MultiTenantWorker(source, app, config, middleware=middleware)
    if metrics is not None:
        metrics.serve(worker, args.metrics_host, args.metrics_port)

    serve_until_stopped(worker, stop, args.event_loop, metrics)
    log.info("multi-tenant worker exiting", extra={"action": "exit"})
    leave_stuck_handler_threads(ctx)
    return 0

