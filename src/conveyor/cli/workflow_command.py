"""``conveyor workflow register|status``: workflow definitions and one workflow event."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from typing import Any

from conveyor.admin import Admin
from conveyor.cli.context import Context
from conveyor.cli.options import add_command, option
from conveyor.cli.output import emit_json, escape, say
from conveyor.cli.process import import_target
from conveyor.errors import ConfigError, InvalidInputError

# Every CLI run imports this module, the workflow package only a workflow
# command; these mirror the package's own defaults (a test checks).
REGISTRATION_TENANT_DEFAULT = "system"
TOPIC_PREFIX_DEFAULT = "workflow"

Env = Any
Sub = Any  # argparse's private _SubParsersAction


def register_workflow(sub: Sub, env: Env) -> None:
    p = add_command(sub, "workflow", "register definitions; the status of a workflow event",
             "Workflow events: 'register' sends a module's object types and triggers to the\n"
             "workflow engine (idempotent; conflicts exit 1 naming each); 'status' shows one\n"
             "published event's state, attempts and last error.")
    wsub = p.add_subparsers(dest="workflow_command", metavar="ACTION", required=True)

    reg = add_command(wsub, "register", "register a WorkflowRegistry with the workflow engine",
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

    st = add_command(wsub, "status", "state, attempts and last error of one workflow event",
              "Show one published workflow event by id: state, attempts, last error and the\n"
              "error of every failed attempt.")
    st.set_defaults(handler=run_workflow_status)
    st.add_argument("id", help="event id")
    option(st, "--topic-prefix", default=TOPIC_PREFIX_DEFAULT,
           help="the publisher's topic prefix")
    st.add_argument("--json", action="store_true", help="print one JSON object")


def run_workflow_register(ctx: Context, args: argparse.Namespace) -> int:
    from conveyor.consumers.engine_client import AsyncEngineClient, EngineConfig
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

