"""``history``: the partitions finished events move into, and how long the next ones span.

Succeeded and cancelled events move into the history's partitions (0025), a
day each unless ``--span`` set another length (0026); retention drops whole
partitions (docs/history-partitions.md).
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any

from conveyor.admin import Admin
from conveyor.cli.context import Context, duration
from conveyor.cli.options import add_command, add_json, format_seconds
from conveyor.cli.output import emit_json, say
from conveyor.errors import InvalidInputError
from conveyor.records import HistoryLayout
from conveyor.validation import check_history_span

Sub = Any  # argparse's private _SubParsersAction


def register_history(sub: Sub, env: Any) -> None:
    p = add_command(
        sub, "history", "the history's partitions, and the span of the next ones",
        "Succeeded and cancelled events move into the history: partitions of a day\n"
        "each (UTC) by default, which the workers make ahead and drop whole once past\n"
        "their --retention. This lists them (rows are the server's estimate; no row is\n"
        "read) with the span and the end of the last partition made. --span sets how\n"
        "long the partitions made from now on are: a whole number of minutes that\n"
        "divides a day. A queue that finishes millions of events an hour keeps each\n"
        "partition smaller, and drops them closer to the retention, with an hour;\n"
        "every read of the whole history opens each partition, so keep their number\n"
        "(retention / span) in the hundreds at most. --replayable gives the partitions\n"
        "made from now on the index a relay's replay reads (conveyor relay does it).",
        run_history,
        examples=[("conveyor history", "the span and every partition"),
                  ("conveyor history --span 1h", "partitions of an hour from the next one on"),
                  ("conveyor history --json", "as JSON")])
    p.add_argument("--span", type=span, metavar="DURATION",
                   help="make the next partitions this long, e.g. 1d, 6h, 1h, 15m")
    p.add_argument("--replayable", action="store_true",
                   help="give the partitions the index a relay's replay reads (about 1 us "
                        "of the server's CPU per acknowledged event; `conveyor relay` sets "
                        "it as it starts)")
    add_json(p, '{"span", "until", "replayable", "partitions": [{"name", "starts", "ends", '
                '"rows", "bytes"}]}')


def span(text: str) -> int:
    """argparse type: a partition span (a duration: a whole number of minutes that divides a day)."""
    try:
        return check_history_span(duration(text), shown=repr(text))
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_history(ctx: Context, args: argparse.Namespace) -> int:
    admin, conn = Admin(ctx.schema), ctx.connect()
    with conn.transaction():
        if args.span is not None:
            admin.set_history_span(conn, args.span)
        if args.replayable:
            admin.set_history_replayable(conn)
        layout = admin.history(conn)
    if args.json:
        emit_json(layout.to_json())
    else:
        say("\n".join(format_history(layout, changed=args.span is not None)))
    return 0


def format_history(layout: HistoryLayout, *, changed: bool = False) -> list[str]:
    """The span, the end of what is made, then a line per partition."""
    lines = [f"span {format_seconds(layout.span)}"
             + (" (set: the partitions made from now on)" if changed else "")
             + ("; replayable" if layout.replayable else "")
             + (f"; made until {_utc(layout.until)}" if layout.until else
                "; no partition made yet (a worker makes them as it starts)")]
    for part in layout.partitions:
        lines.append(f"  {part.name:<28} {_utc(part.starts)} to {_utc(part.ends)}"
                     f"  {part.rows:>12,} rows  {_size(part.bytes):>9}")
    return lines


def _utc(moment: datetime) -> str:
    return f"{moment.astimezone(UTC):%Y-%m-%d %H:%M} UTC"


def _size(count: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"
