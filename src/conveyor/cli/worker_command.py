"""``conveyor worker``: one worker process for one database, until SIGTERM."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from conveyor.cli.context import Context
from conveyor.cli.options import add_command, option
from conveyor.cli.process import (
    StopSignals,
    load_router,
    serve_until_stopped,
    tracing_middleware,
)
from conveyor.cli.worker_options import (
    add_worker_options,
    build_worker,
    refuse_without_database,
    report_exit,
)

Env = Callable[..., str | None]
Sub = Any  # argparse's private _SubParsersAction


def register_worker(sub: Sub, env: Env) -> None:
    p = add_command(sub, "worker", "run a worker process until SIGTERM/SIGINT",
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
    add_worker_options(p, env)


def run_worker(ctx: Context, args: argparse.Namespace) -> int:
    refuse_without_database(ctx, args, "the worker")
    middleware = tracing_middleware(args)   # a missing extra is refused before the import
    stop = StopSignals().install()   # before the app's import, which may take a while
    router = load_router(args.app)
    built = build_worker(ctx, args, router, middleware, stop)
    if built is None:
        return 0
    worker, metrics = built
    serve_until_stopped(worker, stop, args.event_loop, metrics)
    report_exit(ctx, worker)
    return 0


