"""``conveyor bench``, registered through the ``conveyor.commands`` entry points.

Every ``conveyor`` invocation imports this module (a worker serving
:mod:`conveyor_tools.bench.app` too, whose RSS the benchmark measures), so it
imports nothing heavy: the suite is imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from conveyor.cli.context import Context, positive_int
from conveyor.cli.options import add_command


def register(sub: Any) -> None:
    p = add_command(
        sub, "bench", "measure enqueue, drain and wake-up against a raw-SQL baseline",
        "Run the benchmark suite in one go against a raw-SQL baseline measured in the\n"
        "same run on the same database, and print figures and ratios.", run,
        examples=[("conveyor --database-url postgresql://localhost/bench bench --quick",
                   "a fast smoke run")])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--events", type=positive_int, default=20_000,
                   help="events per drain measurement (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="smaller sizes for a fast smoke run")
    p.add_argument("--consumers", action="store_true",
                   help="benchmark the consumers instead (needs no database): XLSX aggregation "
                        "vs openpyxl, hostile files, SMTP mails/s with and without connection "
                        "reuse; needs the test extras (openpyxl, XlsxWriter, aiosmtpd, trustme)")
    p.add_argument("--observability", action="store_true",
                   help="measure what --metrics-port and --tracing cost a draining worker "
                        "instead: drains at defaults with each, alternating with a plain "
                        "worker; needs the metrics and otel extras and the OpenTelemetry SDK")


def run(ctx: Context, args: argparse.Namespace) -> int:
    """``conveyor bench [--json] [--events N] [--quick] [--consumers | --observability]``."""
    if args.consumers:  # no database: never touch ctx.url()
        from conveyor_tools.bench.consumers import run as run_consumers

        return run_consumers(args)
    from conveyor_tools.bench.report import complete, format_table, rounded
    if args.observability:
        from conveyor_tools.bench import observability
        from conveyor_tools.bench.suite import stderr_progress

        found = observability.run(ctx.url(), ctx.schema,
                                  events=min(args.events, 5_000) if args.quick else args.events,
                                  reps=1 if args.quick else 5, say=stderr_progress)
        print(json.dumps(rounded(found)) if args.json else observability.format_table(found))
        return 0
    from conveyor_tools.bench.suite import Plan, Suite, stderr_progress

    plan = Plan.from_args(args.events, args.quick)
    result = complete(Suite(ctx.url(), ctx.schema, plan, stderr_progress).run())
    if args.json:
        print(json.dumps(rounded(result)))
    else:
        print(format_table(result))
    return 0
