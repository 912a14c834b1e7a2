"""``conveyor demo``, registered through the ``conveyor.commands`` entry points.

Every ``conveyor`` invocation imports this module, so the demo itself is
imported only when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from conveyor.cli.context import Context, positive_int
from conveyor.cli.options import add_command


def register(sub: Any) -> None:
    p = add_command(
        sub, "demo", "migrate, enqueue a realistic mix, run a worker with live progress",
        "The guided tour: migrates, enqueues a mix of events (some fail and retry, one\n"
        "is parked), runs a worker process while showing live progress, and ends with\n"
        "the status summary. Without --database-url it uses the embedded PostgreSQL\n"
        "and says so on stderr.", run,
        examples=[("conveyor demo", "the tour on the embedded PostgreSQL"),
                  ("conveyor --schema conveyor_demo demo --events 50", "a shorter one")])
    p.add_argument("--events", type=positive_int, default=200,
                   help="events to enqueue (default: %(default)s)")


def run(ctx: Context, args: argparse.Namespace) -> int:
    """``conveyor demo [--events N]``."""
    from conveyor_tools.demo.runner import run as run_demo

    return run_demo(ctx, args)
