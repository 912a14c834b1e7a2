"""``manage.py conveyor COMMAND ...``: the ``conveyor`` CLI on the project's database.

Every ``conveyor`` command (status, events, show, retry, cancel, pause,
migrate --check, ...) with the database URL and schema taken from Django's
settings: ``manage.py conveyor status``, ``manage.py conveyor events --state
failed``. ``manage.py conveyor --help`` lists them; ``--database ALIAS``
picks another Django database.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from conveyor.cli.main import main
from conveyor.contrib.django import conninfo, setting

# Options manage.py itself reads before the command runs (their values follow them).
_DJANGO_OPTIONS = ("--settings", "--pythonpath")


def run_conveyor(arguments: list[str], using: str | None = None) -> None:
    """Run the conveyor CLI on Django's database; a non-zero exit becomes CommandError."""
    code = main(["--database-url", conninfo(using), "--schema", setting("SCHEMA"), *arguments])
    if code:
        raise CommandError(f"conveyor {' '.join(arguments[:1])} exited with status {code}",
                           returncode=code)


def split_arguments(argv: list[str]) -> tuple[list[str], str | None]:
    """(the arguments for conveyor, the --database alias) from a command's own arguments."""
    rest, database = [], None
    items = iter(argv)
    for arg in items:
        if arg == "--database":
            database = next(items, None)
        elif arg.startswith("--database="):
            database = arg.split("=", 1)[1]
        elif arg in _DJANGO_OPTIONS:
            next(items, None)
        elif not arg.startswith(tuple(f"{o}=" for o in _DJANGO_OPTIONS)):
            rest.append(arg)
    return rest, database


class PassThroughCommand(BaseCommand):
    """A command whose arguments all go to the conveyor CLI (which parses and explains them)."""

    def conveyor_arguments(self, arguments: list[str]) -> list[str]:
        return arguments or ["--help"]

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.add_argument("--database", default=None,
                            help="Django database alias (default: CONVEYOR['DATABASE'])")
        parser.add_argument("arguments", nargs=argparse.REMAINDER)
        return parser

    def run_from_argv(self, argv: list[str]) -> None:
        # Not Django's parser: it would refuse conveyor's options before the command.
        arguments, database = split_arguments(argv[2:])
        try:
            run_conveyor(self.conveyor_arguments(arguments), database)
        except CommandError as exc:
            self.stderr.write(f"CommandError: {exc}")
            sys.exit(exc.returncode)
        finally:
            connections.close_all()

    def handle(self, *args: Any, **options: Any) -> None:
        # call_command("conveyor", "status", ...): the arguments arrive parsed.
        run_conveyor(self.conveyor_arguments(list(options["arguments"])), options["database"])


class Command(PassThroughCommand):
    help = "Run a conveyor CLI command on this project's database (manage.py conveyor status)."
