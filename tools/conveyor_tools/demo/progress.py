"""The demo's live view of the events table.

On a terminal it redraws a small table (counts by topic and state, a progress
bar) in place about five times a second. When stdout is not a terminal (a
pipe, a CI log) or ``TERM=dumb``, it prints one plain line per second instead,
with no control characters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, TextIO

import psycopg
from psycopg import sql

from conveyor.types import EventState

STATES = [s.value for s in EventState]
PLAIN_INTERVAL = 1.0
BAR_WIDTH = 32

_SNAPSHOT_SQL = """
SELECT topic, state, count(*), coalesce(sum(jsonb_array_length(errors)), 0)
FROM {events}
GROUP BY topic, state
"""


@dataclass(slots=True)
class Snapshot:
    """Counts by topic and state, and how many attempts have failed so far."""

    by_topic: dict[str, dict[str, int]] = field(default_factory=dict)
    failed_attempts: int = 0

    def total(self, state: str | None = None) -> int:
        return sum(n for row in self.by_topic.values() for s, n in row.items()
                   if state is None or s == state)

    @property
    def finished(self) -> int:
        return sum(self.total(s.value) for s in EventState if s.finished)


def take_snapshot(conn: psycopg.Connection[Any], schema: str) -> Snapshot:
    query = sql.SQL(_SNAPSHOT_SQL).format(events=sql.Identifier(schema, "events"))
    snap = Snapshot()
    for topic, state, count, errors in conn.execute(query):
        snap.by_topic.setdefault(topic, {})[state] = int(count)
        snap.failed_attempts += int(errors)
    return snap


def is_live_terminal(stream: TextIO) -> bool:
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        return False
    return tty and os.environ.get("TERM", "") != "dumb"


class Progress:
    """Draws snapshots on ``stream``: in place on a terminal, as lines otherwise.

    Args:
        stream: where to draw. Usually ``sys.stdout``.
        expected: events the bar counts towards (finished ones fill it).
        live: redraw in place. Defaults to whether ``stream`` is a terminal.
    """

    def __init__(self, stream: TextIO, expected: int, *, live: bool | None = None) -> None:
        self.stream = stream
        self.expected = max(expected, 1)
        self.live = is_live_terminal(stream) if live is None else live
        self._drawn_lines = 0
        self._last_plain = float("-inf")
        encoding = (getattr(stream, "encoding", None) or "ascii").lower()
        self._full, self._empty = ("█", "░") if "utf" in encoding else ("#", ".")

    def update(self, snap: Snapshot, elapsed: float, note: str = "", *, force: bool = False) -> None:
        if self.live:
            self._redraw(self.table(snap, elapsed, note))
        elif force or elapsed - self._last_plain >= PLAIN_INTERVAL:
            self._last_plain = elapsed
            self.stream.write(self.line(snap, elapsed, note) + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Leave the last drawing on screen and give the cursor back."""
        if self.live:
            self.stream.write("\x1b[?25h")
            self.stream.flush()

    def _redraw(self, lines: list[str]) -> None:
        out = ["\x1b[?25l"]  # hide the cursor while drawing
        if self._drawn_lines:
            out.append(f"\x1b[{self._drawn_lines}F")  # back to the first line drawn
        out.extend(f"{line}\x1b[K\n" for line in lines)
        self.stream.write("".join(out))
        self.stream.flush()
        self._drawn_lines = len(lines)

    def line(self, snap: Snapshot, elapsed: float, note: str = "") -> str:
        counts = "  ".join(f"{s} {snap.total(s)}" for s in STATES)
        text = f"  {elapsed:5.1f}s  {counts}  failed attempts {snap.failed_attempts}"
        return f"{text}  {note}" if note else text

    def table(self, snap: Snapshot, elapsed: float, note: str = "") -> list[str]:
        width = max([len("topic"), *(len(t) for t in snap.by_topic)])
        head = f"  {'topic':<{width}}  " + "  ".join(f"{s:>9}" for s in STATES)
        rows = [head]
        for topic in sorted(snap.by_topic):
            counts = snap.by_topic[topic]
            rows.append(f"  {topic:<{width}}  "
                        + "  ".join(f"{counts.get(s, 0):>9}" for s in STATES))
        rows.append(f"  {'all':<{width}}  " + "  ".join(f"{snap.total(s):>9}" for s in STATES))
        done = min(snap.finished, self.expected)
        filled = round(BAR_WIDTH * done / self.expected)
        bar = self._full * filled + self._empty * (BAR_WIDTH - filled)
        rows.append("")
        rows.append(f"  {bar} {done}/{self.expected} finished  "
                    f"{snap.failed_attempts} failed attempts  {elapsed:4.1f}s"
                    + (f"  {note}" if note else ""))
        return rows
