"""The overview's outcome chart, drawn on the server as SVG geometry.

Bars per time bucket from ``event_counts`` (migration 0008): succeeded at the
bottom, retried and failed stacked on top, with a y axis in events per
bucket and clock times under the x axis. No JavaScript and no chart library:
the page stays a plain document that works air-gapped and under a strict
Content-Security-Policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

# span name -> (seconds shown, seconds per bar, how a bar's unit reads)
SPANS = {"1h": (3600, 60, "per minute"), "24h": (86_400, 900, "per 15 min")}

WIDTH, HEIGHT = 960, 220
LEFT, RIGHT, TOP, BOTTOM = 56, 8, 26, 26


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    width: float
    succeeded_y: float
    succeeded_h: float
    retried_y: float
    retried_h: float
    failed_y: float
    failed_h: float
    title: str


@dataclass(frozen=True, slots=True)
class Tick:
    position: float
    label: str
    anchor: str = "middle"      # SVG text-anchor: the outer labels stay inside the chart


@dataclass(frozen=True, slots=True)
class Chart:
    span: str
    unit: str
    bars: list[Bar]
    y_ticks: list[Tick]
    x_ticks: list[Tick]
    succeeded: int
    retried: int
    failed: int
    cancelled: int
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    bottom: float = HEIGHT - BOTTOM

    @property
    def failure_rate(self) -> float | None:
        """Parked failures among finished attempts (succeeded + failed), or None."""
        done = self.succeeded + self.failed
        return self.failed / done if done else None

    @property
    def empty(self) -> bool:
        return not (self.succeeded or self.retried or self.failed or self.cancelled)


# Round axis maxima: a bar never reaches above the top, and never less than
# two thirds of the way up on its tallest bar.
NICE_STEPS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)


def nice_ceiling(value: int) -> int:
    """The smallest of 1, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 x 10^k, as an even integer
    (the middle tick is whole), at or above ``value``; at least 2."""
    if value <= 2:
        return 2
    power: int = 10 ** math.floor(math.log10(value))
    for step in NICE_STEPS:
        top = math.ceil(step * power)
        if top >= value and top % 2 == 0:
            return top
    return 10 * power


def _label(n: int) -> str:
    return f"{n:,}".replace(",", "\u2009")


def build(rows: Sequence[Sequence[Any]], span: str, now: float) -> Chart:
    """The chart of ``event_counts_series`` rows (bucket epoch, succeeded, retried,
    failed, cancelled) for the ``span`` ending at ``now`` (epoch seconds, database clock)."""
    seconds, step, unit = SPANS[span]
    last = int(now) // step * step
    first = last - seconds + step
    by_bucket = {int(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows}
    buckets = list(range(first, last + 1, step))
    counts = [by_bucket.get(b, (0, 0, 0, 0)) for b in buckets]
    top = nice_ceiling(max((s + r + f for s, r, f, _ in counts), default=0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / len(buckets)
    scale = plot_h / top
    base = HEIGHT - BOTTOM
    bars = []
    for i, (bucket, (s, r, f, c)) in enumerate(zip(buckets, counts, strict=True)):
        sh, rh, fh = s * scale, r * scale, f * scale
        when = datetime.fromtimestamp(bucket, UTC).strftime("%H:%M UTC")
        bars.append(Bar(x=LEFT + i * slot + slot * 0.12, width=max(slot * 0.76, 1.0),
                        succeeded_y=base - sh, succeeded_h=sh,
                        retried_y=base - sh - rh, retried_h=rh,
                        failed_y=base - sh - rh - fh, failed_h=fh,
                        title=f"{when}: {_label(s)} succeeded, {_label(r)} retried, "
                              f"{_label(f)} failed, {_label(c)} cancelled"))
    y_ticks = [Tick(base - plot_h * k / 2, _label(top * k // 2)) for k in range(3)]
    def clock(i: int) -> str:
        return datetime.fromtimestamp(buckets[i], UTC).strftime("%H:%M")

    middle = len(buckets) // 2
    x_ticks = [Tick(LEFT, clock(0), "start"), Tick(LEFT + (middle + 0.5) * slot, clock(middle)),
               Tick(WIDTH - RIGHT, clock(len(buckets) - 1), "end")]
    totals = [sum(c[k] for c in counts) for k in range(4)]
    return Chart(span=span, unit=unit, bars=bars, y_ticks=y_ticks, x_ticks=x_ticks,
                 succeeded=totals[0], retried=totals[1], failed=totals[2], cancelled=totals[3])
