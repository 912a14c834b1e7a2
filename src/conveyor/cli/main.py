"""Entry point of the ``conveyor`` command.

Every setting comes from a flag or the matching ``CONVEYOR_*`` environment
variable (flags win). Errors print one line to stderr and exit non-zero.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import Any

import psycopg

from conveyor.cli import (
    commands,
    control_command,
    dashboard_command,
    events,
    history_command,
    pause_command,
    relay_command,
    worker_command,
    worker_multi_command,
    workflow_command,
)
from conveyor.cli.context import Context
from conveyor.cli.logsetup import configure
from conveyor.cli.options import ArgumentParser, option
from conveyor.cli.output import escape
from conveyor.errors import ConveyorError

DESCRIPTION = """\
Conveyor: the transactional outbox and job queue for Python on PostgreSQL.

Without --database-url (or CONVEYOR_DATABASE_URL) one-off commands run against a
private embedded PostgreSQL whose data lives in --data-dir; it is started on
demand and migrated automatically. A worker refuses to run without a database
URL unless --embedded asks for the embedded server.

Results go to stdout (text, or one JSON object with --json); errors, hints and
progress to stderr. Exit status: 0 done, 1 refused or failed, 2 usage, 141
stdout closed early (conveyor events | head).
"""

EPILOG = """\
examples:
  conveyor migrate                              create or upgrade the schema
  conveyor enqueue email.send '{"to": "a@example.com"}' --tenant acme
  conveyor worker --app myapp.tasks:router      run a worker until SIGTERM
  conveyor status --json                        counts, oldest pending, workers
  conveyor events --state failed --topic 'email.*'
                                                find failed email events
  conveyor retry --failed --topic email.send    run failed events again
  conveyor status --database-url URL            global options also go after
"""


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"CONVEYOR_{name}", default)


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


def add_global_options(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    """The options every command takes, before the command name or after it.

    After the command they default to argparse.SUPPRESS, so one not typed
    there leaves the value from before the command (or its variable) alone.
    """
    if after_command:
        group = parser.add_argument_group("global options (also accepted before the command)")
        for flag, kwargs in (("--database-url", {"metavar": "URL"}), ("--schema", {}),
                             ("--data-dir", {"metavar": "DIR"}),
                             ("--log-level", {"choices": LOG_LEVELS}),
                             ("--log-format", {"choices": LOG_FORMATS})):
            group.add_argument(flag, default=argparse.SUPPRESS, help="see 'conveyor --help'",
                               **kwargs)
        return
    group = parser.add_argument_group("global options (also accepted after the command)")
    option(group, "--database-url", env="DATABASE_URL", metavar="URL", secret=True,
           shown="none: one-off commands use the embedded server, 'worker' refuses",
           help="PostgreSQL URL or conninfo")
    option(group, "--schema", env="SCHEMA", default="conveyor",
           help="schema holding Conveyor's tables")
    option(group, "--data-dir", env="DATA_DIR", metavar="DIR",
           shown="/var/lib/conveyor/pg18 as root, else the user data dir",
           help="data directory of the embedded server")
    option(group, "--log-level", env="LOG_LEVEL", default="info", choices=LOG_LEVELS,
           help="log verbosity")
    option(group, "--log-format", env="LOG_FORMAT", default="text", choices=LOG_FORMATS,
           help="log lines as text or JSON objects")


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every command's parser, nested ones (``workflow status``) included."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found.append(child)
                found.extend(_subparsers(child))
    return found


# In the order `conveyor --help` lists them.
COMMANDS = [commands.register_migrate, worker_command.register_worker,
            commands.register_enqueue, commands.register_status, events.register_events,
            commands.register_show, events.register_retry, events.register_cancel,
            events.register_reschedule,
            events.register_prune, history_command.register_history, commands.register_xlsx,
            worker_multi_command.register_worker_multi, workflow_command.register_workflow,
            pause_command.register_pause, pause_command.register_resume,
            control_command.register_limits, control_command.register_cron,
            control_command.register_audit,
            dashboard_command.register_dashboard, relay_command.register_relay]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="conveyor", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"conveyor {_version()}",
                        help="print the version and exit")
    add_global_options(parser, after_command=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(sub, _env)
    add_plugin_commands(sub)
    for child in _subparsers(parser):
        add_global_options(child, after_command=True)
        # The innermost command's parser wins (nested ones parse last), so
        # refusals after parsing name the help of the command that was typed.
        child.set_defaults(command_parser=child)
    return parser


# Other distributions add commands here: in their pyproject.toml,
#   [project.entry-points."conveyor.commands"]
#   bench = "conveyor_tools.bench.command:register"
# register(subparsers) adds one parser whose defaults carry
# handler(ctx, args) -> exit status, as the built-in commands do.
COMMANDS_GROUP = "conveyor.commands"


def add_plugin_commands(sub: Any) -> None:
    """Each command of the ``conveyor.commands`` entry points, after the built-in ones.

    A plugin that fails to load or to register costs one warning line that
    names it; anything it registered before failing is taken back out, and
    every other command still works.
    """
    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        before = dict(sub.choices)
        shown = list(sub._choices_actions)
        try:
            entry.load()(sub)
        # A third party's code: whatever it raises, the rest of the CLI must run.
        except Exception as exc:  # noqa: BLE001
            sub.choices.clear()
            sub.choices.update(before)
            sub._choices_actions[:] = shown
            origin = entry.dist.name if entry.dist else "an unknown distribution"
            reason = (str(exc).strip().splitlines() or [""])[0]
            print(f"conveyor: warning: command {entry.name!r} from {origin} ({entry.value}) "
                  f"not loaded: {type(exc).__name__}: {escape(reason)}", file=sys.stderr)


def _version() -> str:
    try:
        return version("conveyor")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


# What a process killed by SIGPIPE reports (128 + 13), as `yes | head -1` does;
# only visible to a script that asks for it (set -o pipefail).
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status: 0, 1 (refused or failed), 2 (usage), 130, 141."""
    try:
        return _run(argv)
    except BrokenPipeError:
        # The reader went away (`conveyor status | head -1`): stop quietly. Point
        # stdout at /dev/null so the flush at interpreter exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:
            getattr(args, "command_parser", parser).error(
                "unrecognized arguments: " + " ".join(extras))
    except SystemExit:
        sys.stdout.flush()  # --help and --version into a closed pipe end like the rest
        raise
    configure(args.log_level, args.log_format)
    handler: Callable[[Context, argparse.Namespace], int] = args.handler
    ctx: Context | None = None
    try:
        ctx = Context(database_url=args.database_url, schema=args.schema, data_dir=args.data_dir)
        code = handler(ctx, args)
        sys.stdout.flush()  # a closed pipe shows here, where main() can catch it
        return code
    except ConveyorError as exc:
        print(f"conveyor: error: {escape(exc)}", file=sys.stderr)
        return 1
    except psycopg.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"conveyor: database error: {escape(first)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("conveyor: interrupted", file=sys.stderr)
        return 130
    finally:
        if ctx is not None:
            ctx.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
