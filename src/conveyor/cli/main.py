"""Entry point of the ``conveyor`` command.

Every setting comes from a flag or the matching ``CONVEYOR_*`` environment
variable (flags win). Errors print one line to stderr and exit non-zero.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

import psycopg

from conveyor.cli import commands
from conveyor.cli.context import Context
from conveyor.cli.logsetup import configure
from conveyor.errors import ConveyorError

DESCRIPTION = """\
Conveyor: the transactional outbox and job queue for Python on PostgreSQL.

Without --database-url (or CONVEYOR_DATABASE_URL) every command runs against a
private embedded PostgreSQL whose data lives in --data-dir; it is started on
demand and migrated automatically.
"""

EPILOG = """\
examples:
  conveyor migrate                              create or upgrade the schema
  conveyor enqueue email.send '{"to": "a@example.com"}' --tenant acme
  conveyor worker --app myapp.tasks:router      run a worker until SIGTERM
  conveyor status --json                        counts, oldest pending, workers
  conveyor retry --failed --topic email.send    run failed events again
"""


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"CONVEYOR_{name}", default)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with Conveyor's error shape: one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"conveyor: error: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        # argparse checks the choices of values given on the command line, not of
        # defaults, and these defaults come from CONVEYOR_* variables: a bad one
        # would otherwise surface later as a traceback (log level) or not at all.
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if action.choices is None or isinstance(action, argparse._SubParsersAction) \
                    or not isinstance(value, str) or value in action.choices:
                continue
            option = action.option_strings[-1]
            variable = "CONVEYOR_" + option.lstrip("-").upper().replace("-", "_")
            self.error(f"invalid {variable}={value!r} (for {option}): expected one of "
                       + ", ".join(map(str, action.choices)))
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="conveyor", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--database-url", default=_env("DATABASE_URL"), metavar="URL",
        help="PostgreSQL URL or conninfo [env CONVEYOR_DATABASE_URL]; "
             "default: the embedded server")
    parser.add_argument(
        "--schema", default=_env("SCHEMA", "conveyor"),
        help="schema holding Conveyor's tables [env CONVEYOR_SCHEMA] (default: %(default)s)")
    parser.add_argument(
        "--data-dir", default=_env("DATA_DIR"), metavar="DIR",
        help="data directory of the embedded server [env CONVEYOR_DATA_DIR] "
             "(default: /var/lib/conveyor/pg18 as root, else the user data dir)")
    parser.add_argument(
        "--log-level", default=_env("LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="log verbosity [env CONVEYOR_LOG_LEVEL] (default: %(default)s)")
    parser.add_argument(
        "--log-format", default=_env("LOG_FORMAT", "text"), choices=["text", "json"],
        help="log lines as text or JSON objects [env CONVEYOR_LOG_FORMAT] (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in commands.REGISTRY:
        register(sub, _env)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure(args.log_level, args.log_format)
    handler: Callable[[Context, argparse.Namespace], int] = args.handler
    ctx: Context | None = None
    try:
        ctx = Context(database_url=args.database_url, schema=args.schema, data_dir=args.data_dir)
        return handler(ctx, args)
    except ConveyorError as exc:
        print(f"conveyor: error: {exc}", file=sys.stderr)
        return 1
    except psycopg.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"conveyor: database error: {first}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("conveyor: interrupted", file=sys.stderr)
        return 130
    finally:
        if ctx is not None:
            ctx.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
