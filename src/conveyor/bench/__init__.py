"""``conveyor bench``: Conveyor against a raw-SQL baseline, in one run, on one database.

What is measured, each next to plain psycopg doing the same work:

* enqueue, one event per transaction (``Producer.enqueue`` + commit) vs one
  raw ``INSERT`` + commit; and 1000 per transaction (``enqueue_many``) vs raw
  ``COPY``;
* drain of pre-enqueued no-op events by a real ``conveyor worker`` process,
  at the defaults and at the best of a few ``batch_size``/``concurrency``
  settings, vs a raw claim/finish loop at batch 100 and 1000;
* wake-up latency of an idle worker (commit returned -> handler started);
* the worker's peak RSS (``VmHWM``).

Everything happens in scratch schemas that are dropped at the end; see
:mod:`conveyor.bench.measure` for the timing method. Progress goes to stderr;
stdout gets the table, or with ``--json`` exactly one JSON object.

``conveyor bench --consumers`` measures the consumers instead (the XLSX reader
against openpyxl, hostile files, SMTP with and without connection reuse); see
:mod:`conveyor.bench.consumers`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["run"]


def run(ctx: Any, args: argparse.Namespace) -> int:
    """Entry point of ``conveyor bench [--json] [--events N] [--quick] [--consumers]``."""
    if getattr(args, "consumers", False):  # no database: never touch ctx.url()
        from conveyor.bench.consumers import run as run_consumers

        return run_consumers(args)
    # Imported here so a worker importing conveyor.bench.app stays lean (its RSS is measured).
    from conveyor.bench.report import complete, format_table, rounded
    from conveyor.bench.suite import Plan, Suite, stderr_progress

    plan = Plan.from_args(args.events, args.quick)
    result = complete(Suite(ctx.url(), ctx.schema, plan, stderr_progress).run())
    if args.json:
        print(json.dumps(rounded(result)))
    else:
        print(format_table(result))
    return 0
