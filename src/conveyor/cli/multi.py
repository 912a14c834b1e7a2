"""``conveyor worker-multi`` and ``conveyor workflow register|status``.

Thin like the other commands: parse flags and ``CONVEYOR_*`` variables, build
the configuration, call the library.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import sys
from typing import Any

from conveyor.admin import Admin
from conveyor.cli.context import Context, duration, positive_int
from conveyor.cli.options import label, option
from conveyor.cli.output import emit_json, escape, say
from conveyor.cli.process import StopSignals
from conveyor.config import (
    HANDLER_TIMEOUT_DEFAULT,
    HEARTBEAT_INTERVAL_DEFAULT,
    POLL_INTERVAL_DEFAULT,
    SHUTDOWN_TIMEOUT_DEFAULT,
    WorkerConfig,
)
from conveyor.errors import ConfigError, InvalidInputError
from conveyor.multitenant import (
    RESCAN_INTERVAL_DEFAULT,
    TENANT_CONCURRENCY_DEFAULT,
    DirectoryTenants,
    MultiTenantConfig,
    MultiTenantWorker,
    StaticTenants,
    TenantSource,
    load_app,
)

# The workflow modules pull in httpx and PyJWT (about 15 MB); every worker
# imports this module through the CLI, so they are imported only when a
# workflow command runs. These mirror the modules' own defaults (a test checks).
REGISTRATION_TENANT_DEFAULT = "system"
TOPIC_PREFIX_DEFAULT = "workflow"

Env = Any
Sub = Any

log = logging.getLogger(__name__)


def _add(sub: Sub, name: str, help_text: str, description: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help_text, description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


def import_target(spec: str, flag: str = "--app") -> object:
    """The object named by ``'module:attribute'`` (the current directory is importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidInputError(f"invalid {flag} {spec!r}: expected 'module:attribute'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInputError(f"cannot import module {module_name!r} for {flag}: {exc}") from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidInputError(f"module {module_name!r} has no attribute {attr!r}") from None
    return target


# -------------------------------------------------------------- worker-multi

def register_worker_multi(sub: Sub, env: Env) -> None:
    p = _add(sub, "worker-multi", "one worker process for many tenant databases",
             "Serve every tenant database with its own worker in this process: a list of\n"
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
           help="fallback poll per tenant when no NOTIFY arrives")
    option(p, "--shutdown-timeout", type=duration, unit="s", default=SHUTDOWN_TIMEOUT_DEFAULT,
           help="grace for running handlers on SIGTERM")
    option(p, "--handler-timeout", type=duration, unit="s", default=HANDLER_TIMEOUT_DEFAULT,
           help="default limit for one handler call")
    option(p, "--name", env="WORKER_NAME", type=label, shown="host:pid",
           help="label shown by status, '/<tenant>' appended")
    from conveyor.cli.commands import add_event_loop_arg  # commands imports this module

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
        stop = StopSignals().install()
        app = load_app(import_target(args.app))
        config = MultiTenantConfig(
            worker=WorkerConfig(
                schema=ctx.schema, name=args.name, concurrency=args.concurrency,
                poll_interval=args.poll_interval, shutdown_timeout=args.shutdown_timeout,
                handler_timeout=args.handler_timeout,
                heartbeat_interval=HEARTBEAT_INTERVAL_DEFAULT),
            rescan_interval=args.rescan_interval)
    except ConfigError as exc:
        raise InvalidInputError(str(exc)) from None
    if stop.requested:
        log.info("stopped before the worker started", extra={"action": "stopped"})
        return 0
    worker = MultiTenantWorker(source, app, config)

    async def serve() -> None:
        worker.install_signal_handlers()
        stop.forward_to(worker.request_stop)
        await worker.run()

    from conveyor.cli.commands import run_until_stopped  # commands imports this module

    run_until_stopped(serve(), args.event_loop)
    stop.install()   # closing the loop restored the default handlers; the exit is under way
    log.info("multi-tenant worker exiting", extra={"action": "exit"})
    from conveyor.cli.commands import leave_stuck_handler_threads

    leave_stuck_handler_threads(ctx)
    return 0


# ------------------------------------------------------------------ workflow

def register_workflow(sub: Sub, env: Env) -> None:
    p = _add(sub, "workflow", "register definitions; the status of a workflow event",
             "Workflow events: 'register' sends a module's object types and triggers to the\n"
             "workflow engine (idempotent; conflicts exit 1 naming each); 'status' shows one\n"
             "published event's state, attempts and last error.")
    wsub = p.add_subparsers(dest="workflow_command", metavar="ACTION", required=True)

    reg = _add(wsub, "register", "register a WorkflowRegistry with the workflow engine",
               "Register every object type and trigger of --app (a 'module:attribute' naming a\n"
               "conveyor.workflow.WorkflowRegistry) and print what was created, updated or\n"
               "unchanged. The HS256 secret comes from CONVEYOR_WORKFLOW_JWT_SECRET only.")
    reg.set_defaults(handler=run_workflow_register)
    reg.add_argument("--app", required=True, metavar="MODULE:REGISTRY")
    option(reg, "--engine-url", env="WORKFLOW_ENGINE_URL", required=True, metavar="URL",
           help="workflow engine base URL")
    option(reg, "--tenant-domain", env="WORKFLOW_TENANT_DOMAIN", default="workflow.test",
           help="engine's tenant domain")
    option(reg, "--role", env="WORKFLOW_ROLE", default="conveyor-workflow",
           help="scoped service role")
    option(reg, "--audience", env="WORKFLOW_AUDIENCE", default="workflow", help="token audience")
    option(reg, "--registration-tenant", default=REGISTRATION_TENANT_DEFAULT,
           help="tenant whose Host carries registrations")
    reg.add_argument("--json", action="store_true", help="print the report as JSON")
    reg.set_defaults(jwt_secret=env("WORKFLOW_JWT_SECRET"))

    st = _add(wsub, "status", "state, attempts and last error of one workflow event",
              "Show one published workflow event by id: state, attempts, last error and the\n"
              "error of every failed attempt.")
    st.set_defaults(handler=run_workflow_status)
    st.add_argument("id", help="event id")
    option(st, "--topic-prefix", default=TOPIC_PREFIX_DEFAULT,
           help="the publisher's topic prefix")
    st.add_argument("--json", action="store_true", help="print one JSON object")


def run_workflow_register(ctx: Context, args: argparse.Namespace) -> int:
    from conveyor.engine_client import AsyncEngineClient, EngineConfig
    from conveyor.workflow.adapters import HttpWorkflowAdapter
    from conveyor.workflow.registry import WorkflowRegistry

    registry = import_target(args.app)
    if not isinstance(registry, WorkflowRegistry):
        raise InvalidInputError(
            f"--app {args.app!r} is a {type(registry).__name__}, not a WorkflowRegistry")
    if not args.jwt_secret:
        raise InvalidInputError("set CONVEYOR_WORKFLOW_JWT_SECRET to the engine's HS256 secret")
    try:
        config = EngineConfig(base_url=args.engine_url, tenant_domain=args.tenant_domain,
                              jwt_secret=args.jwt_secret, role=args.role, audience=args.audience)
    except ConfigError as exc:
        raise InvalidInputError(str(exc)) from None

    # httpx logs every request at INFO; the report below says the same, once.
    logging.getLogger("httpx").setLevel(logging.WARNING)

    async def register() -> Any:
        async with AsyncEngineClient(config) as engine:
            adapter = HttpWorkflowAdapter(engine, registration_tenant=args.registration_tenant)
            return await registry.register_all(adapter)

    report = asyncio.run(register())
    if args.json:
        print(json.dumps(report.to_json()))
        return 0
    for name in report.created:
        say(f"created   {escape(name)}")
    for name in report.updated:
        say(f"updated   {escape(name)}")
    for name in report.unchanged:
        say(f"unchanged {escape(name)}")
    print(report.summary())
    return 0


def run_workflow_status(ctx: Context, args: argparse.Namespace) -> int:
    from conveyor.workflow.publisher import status_of

    record = Admin(ctx.schema).show(ctx.connect(), args.id)
    data = status_of(record, args.topic_prefix).to_json()
    if args.json:
        emit_json(data)
        return 0
    # Stored errors carry upstream text: escaped, so none can move the cursor
    # or forge a line.
    for key in ("event_id", "trigger", "tenant", "state", "attempts", "max_attempts", "last_error"):
        value = data[key]
        say(f"{key:>12}: {'-' if value is None else escape(value)}")
    for e in data["errors"]:
        say(f"  attempt {e['attempt']} at {escape(e['at'])}: {escape(e['error'])}")
    return 0


REGISTRY = [register_worker_multi, register_workflow]
