"""``conveyor workflow register|status``: workflow definitions and one workflow event."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections import Counter
from typing import Any

from conveyor.admin import Admin
from conveyor.canvas import levels
from conveyor.cli.context import Context
from conveyor.cli.options import add_command, option
from conveyor.cli.output import emit_json, escape, say
from conveyor.cli.process import import_target
from conveyor.errors import ConfigError, InvalidInputError

# Every CLI run imports this module, the workflow package only a workflow
# command; these mirror the package's own defaults (a test checks).
REGISTRATION_TENANT_DEFAULT = "system"
# `workflow show` lists a level's steps of one topic one by one up to this many.
SHOW_EACH = 5
TOPIC_PREFIX_DEFAULT = "workflow"

Env = Any
Sub = Any  # argparse's private _SubParsersAction


def register_workflow(sub: Sub, env: Env) -> None:
    p = add_command(sub, "workflow", "show a workflow's steps; register, status: engine events",
             "'show' draws the steps of a workflow (chain, group, then: docs/workflows.md).\n"
             "Workflow-engine events: 'register' sends a module's object types and triggers\n"
             "to the workflow engine (idempotent; conflicts exit 1 naming each); 'status'\n"
             "shows one published event's state, attempts and last error.")
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
    _register_show(wsub)


def _register_show(wsub: Sub) -> None:
    sh = add_command(wsub, "show", "draw the graph of steps an event belongs to",
              "Draw the workflow (docs/workflows.md) that event ID belongs to: its steps by\n"
              "level (a step's level is one more than its deepest dependency's), each\n"
              "level's steps by topic with their states; a topic with more than\n"
              f"{SHOW_EACH} steps on a level is summed up. Exit 1 if no such event.")
    sh.set_defaults(handler=run_workflow_show)
    sh.add_argument("id", help="the id of any step of the workflow")
    sh.add_argument("--limit", type=int, default=10_001, metavar="N",
                    help="read at most N steps (default 10001)")
    sh.add_argument("--json", action="store_true",
                    help="print every step as JSON (id, topic, state, depends_on, ...)")


def run_workflow_show(ctx: Context, args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise InvalidInputError(f"--limit must be at least 1, not {args.limit}")
    steps = Admin(ctx.schema).workflow(ctx.connect(), args.id, limit=args.limit)
    if args.json:
        emit_json({"steps": [s.to_json() for s in steps]})
        return 0
    states = Counter(s.state.value if s.state else "pruned" for s in steps)
    say(f"workflow of event {args.id}: {len(steps)} steps ("
        + ", ".join(f"{n} {state}" for state, n in sorted(states.items())) + ")")
    for depth, on_level in enumerate(levels(steps)):
        say(f"level {depth}:")
        by_topic: dict[str, list[Any]] = {}
        for s in on_level:
            by_topic.setdefault(s.topic or "(pruned)", []).append(s)
        for topic, group in by_topic.items():
            if len(group) <= SHOW_EACH:
                for s in group:
                    waits = "" if not s.depends_on else " after " + ", ".join(
                        map(str, s.depends_on[:SHOW_EACH])) + (
                        f", ... ({len(s.depends_on)})" if len(s.depends_on) > SHOW_EACH else "")
                    error = f": {escape(s.error)}" if s.error and s.state \
                        and s.state.value in ("failed", "cancelled") else ""
                    say(f"  {s.id:>10} {s.state.value if s.state else 'pruned':<9} "
                        f"{escape(topic)}{waits}{error}")
            else:
                counts = Counter(s.state.value if s.state else "pruned" for s in group)
                say(f"  {len(group):>10} x {escape(topic)}: "
                    + ", ".join(f"{n} {state}" for state, n in sorted(counts.items())))
    return 0


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

