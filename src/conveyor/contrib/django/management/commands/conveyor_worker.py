"""``manage.py conveyor_worker [WORKER OPTIONS]``: a Conveyor worker inside the Django project.

It serves :mod:`conveyor.contrib.django.worker`'s router: every Django task
(the ``django.*`` topics of :class:`~conveyor.contrib.django.backend.ConveyorBackend`)
and the routes of ``CONVEYOR["ROUTER"]``. The options are ``conveyor
worker``'s (``--concurrency``, ``--metrics-port``, ...) but those the project's
settings decide (``--app``, the database, the embedded server): ``manage.py
conveyor_worker --help`` lists them. SIGTERM drains it like any worker.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from django.core.management.base import CommandError

from conveyor.cli.main import LOG_FORMATS, LOG_LEVELS
from conveyor.cli.options import option
from conveyor.cli.worker_options import add_worker_options
from conveyor.contrib.django.management.commands.conveyor import PassThroughCommand

ROUTER = "conveyor.contrib.django.worker:router"
DESCRIPTION = """\
Run a Conveyor worker for this project: every Django task of the
ConveyorBackend's queues (the django.* topics) and the routes of
CONVEYOR['ROUTER']. The database is Django's (CONVEYOR['DATABASE'], or
--database), the schema CONVEYOR['SCHEMA']. SIGTERM or SIGINT stops claiming,
lets running handlers finish within --shutdown-timeout, hands the rest back
without spending an attempt, exits 0."""
# conveyor worker's options that the project's settings decide here.
_NOT_HERE = {"--app": "it serves the project's Django tasks and CONVEYOR['ROUTER']",
             "--database-url": "its database is Django's: pass --database ALIAS",
             "--schema": "the schema is CONVEYOR['SCHEMA']",
             "--embedded": "its database is Django's: pass --database ALIAS",
             "--data-dir": "its database is Django's: pass --database ALIAS"}


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"CONVEYOR_{name}", default)


def worker_parser() -> argparse.ArgumentParser:
    """The options ``manage.py conveyor_worker`` takes, for its ``--help``."""
    parser = argparse.ArgumentParser(prog="manage.py conveyor_worker", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database", metavar="ALIAS",
                        help="Django database alias (default: CONVEYOR['DATABASE'])")
    add_worker_options(parser, _env, embedded=False)
    option(parser, "--log-level", env="LOG_LEVEL", default="info", choices=LOG_LEVELS,
           help="log verbosity")
    option(parser, "--log-format", env="LOG_FORMAT", default="text", choices=LOG_FORMATS,
           help="log lines as text or JSON objects")
    return parser


class Command(PassThroughCommand):
    help = "Run a Conveyor worker for this project's Django tasks and CONVEYOR['ROUTER']."

    def conveyor_arguments(self, arguments: list[str]) -> list[str]:
        for arg in arguments:
            flag = arg.split("=", 1)[0]
            if flag in _NOT_HERE:
                raise CommandError(f"manage.py conveyor_worker takes no {flag}: "
                                   f"{_NOT_HERE[flag]}", returncode=1)
        return ["worker", "--app", ROUTER, *arguments]

    def run_from_argv(self, argv: list[str]) -> None:
        if {"-h", "--help"} & set(argv[2:]):
            self.stdout.write(worker_parser().format_help(), ending="")
            return
        super().run_from_argv(argv)

    def handle(self, *args: Any, **options: Any) -> None:
        if {"-h", "--help"} & set(options["arguments"]):
            self.stdout.write(worker_parser().format_help(), ending="")
            return
        super().handle(*args, **options)
