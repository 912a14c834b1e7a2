"""The overview's outcome chart: buckets, totals and axes from event_counts rows."""

from __future__ import annotations

import pytest

from conveyor.dashboard.charts import HEIGHT, build, nice_ceiling

NOW = 1_764_620_000.0            # 2025-12-01 20:13:20 UTC
MINUTE = int(NOW) // 60 * 60


def test_missing_minutes_are_empty_bars_and_totals_add_up() -> None:
    rows = [(MINUTE - 120, 30, 2, 1, 0), (MINUTE, 10, 0, 3, 1), (MINUTE - 7200, 999, 0, 0, 0)]
    chart = build(rows, "1h", NOW)
    assert len(chart.bars) == 60
    assert (chart.succeeded, chart.retried, chart.failed, chart.cancelled) == (40, 2, 4, 1)
    assert chart.failure_rate == pytest.approx(4 / 44)
    last, two_before = chart.bars[-1], chart.bars[-3]
    assert last.title == "20:13 UTC: 10 succeeded, 0 retried, 3 failed, 1 cancelled"
    assert two_before.title.startswith("20:11 UTC: 30 succeeded, 2 retried, 1 failed")
    assert all(b.succeeded_h == b.retried_h == b.failed_h == 0 for b in chart.bars[:-3])
    # The tallest bar (33) fits under the axis maximum (40), stacked from the base up.
    assert [t.label for t in chart.y_ticks] == ["0", "20", "40"]
    bottom = HEIGHT - 26
    assert two_before.succeeded_y + two_before.succeeded_h == pytest.approx(bottom)
    assert two_before.retried_y + two_before.retried_h == pytest.approx(two_before.succeeded_y)
    assert two_before.failed_y == pytest.approx(chart.y_ticks[2].position + (40 - 33) * (
        chart.y_ticks[0].position - chart.y_ticks[2].position) / 40)
    assert [t.label for t in chart.x_ticks] == ["19:14", "19:44", "20:13"]


def test_a_day_is_96_bars_of_15_minutes_and_nothing_is_an_empty_chart() -> None:
    chart = build([], "24h", NOW)
    assert len(chart.bars) == 96 and chart.unit == "per 15 min"
    assert chart.empty and chart.failure_rate is None


@pytest.mark.parametrize(("value", "top"), [(0, 2), (3, 4), (9, 10), (33, 40), (101, 150),
                                            (510, 600), (1001, 1500), (12_345, 15_000)])
def test_axis_maxima_are_round_and_never_below_the_tallest_bar(value: int, top: int) -> None:
    assert nice_ceiling(value) == top
