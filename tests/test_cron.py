"""Cron definitions and slot arithmetic (conveyor.cron), without a database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import pairwise

import pytest

from conveyor import ConfigError, Router
from conveyor.cron import SLOT_WALK_LIMIT, Schedule, fire_time
from conveyor.types import Event


def _at(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)


def test_router_cron_defines_a_schedule_with_a_default_name() -> None:
    router = Router()
    daily = router.cron("0  6 * * *", "report.build", {"kind": "daily"})
    madrid = router.cron("*/5 * * * *", "report.build", tz="Europe/Madrid", catch_up=60,
                         tenant="acme", priority=3, max_attempts=2)
    assert router.schedules == (daily, madrid)
    assert (daily.name, daily.expression, daily.payload, daily.timezone, daily.catch_up) == (
        "report.build 0 6 * * *", "0 6 * * *", '{"kind":"daily"}', "UTC", 300.0)
    assert madrid.name == "report.build */5 * * * * Europe/Madrid"
    assert (madrid.tenant, madrid.priority, madrid.max_attempts) == ("acme", 3, 2)
    with pytest.raises(ConfigError, match=r"cron schedule 'report.build 0 6 \* \* \*' is already "
                                          "declared; give the second one a name="):
        router.cron("0 6 * * *", "report.build")
    assert router.cron("0 6 * * *", "report.build", name="second").name == "second"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"expression": "61 * * * *"}, "invalid cron expression '61 * * * *': Bad minute"),
    ({"expression": "* * *"}, "invalid cron expression '* * *': Wrong number of fields"),
    ({"expression": "0 0 31 2 *"}, "invalid cron expression '0 0 31 2 *'"),
    ({"expression": 5}, "expected a cron expression string, got 5"),
    ({"tz": "Mars/Olympus"}, "unknown time zone 'Mars/Olympus'"),
    ({"tz": "../etc/passwd"}, "unknown time zone '../etc/passwd'"),
    ({"catch_up": -1}, "expected catch_up to be seconds from 0 to 604800, got -1"),
    ({"catch_up": float("nan")}, "expected catch_up to be seconds from 0 to 604800, got nan"),
    ({"catch_up": "60"}, "expected catch_up to be seconds from 0 to 604800, got '60'"),
    ({"name": ""}, "expected a schedule name of 1 to 100 printable characters, got ''"),
    ({"name": "a\nb"}, "expected a schedule name of 1 to 100 printable characters"),
    ({"topic": "bad topic!"}, "cron schedule for 'bad topic!': "),
    ({"payload": {1, 2}}, "payload is not JSON-serialisable"),
    ({"max_attempts": 0}, "cron schedule for 'report.build': "),
])
def test_bad_definitions_raise_one_line_naming_the_value(kwargs: dict[str, object],
                                                         message: str) -> None:
    args = {"expression": "* * * * *", "topic": "report.build", **kwargs}
    with pytest.raises(ConfigError) as raised:
        Schedule.define(args.pop("expression"), args.pop("topic"), **args)  # type: ignore[arg-type]
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_due_fires_the_window_and_counts_the_older_slots_as_skipped() -> None:
    every_minute = Schedule.define("* * * * *", "t", catch_up=150)
    now = _at(2026, 12, 1, 12, 10, 30)
    fire, skipped, through = every_minute.due(_at(2026, 12, 1, 12, 0), now)
    # 12:01 ... 12:10 are due; those before 12:08:00 (now - 150 s) are too old.
    assert fire == [_at(2026, 12, 1, 12, 8), _at(2026, 12, 1, 12, 9), _at(2026, 12, 1, 12, 10)]
    assert (skipped, through) == (7, now)
    # The cursor itself is settled: a slot exactly at it does not fire again.
    assert every_minute.due(_at(2026, 12, 1, 12, 10), now)[0] == []
    assert every_minute.next_after(now) == _at(2026, 12, 1, 12, 11)


def test_a_slot_found_within_seconds_is_on_time_even_without_catch_up() -> None:
    no_catch_up = Schedule.define("* * * * *", "t", catch_up=0)
    slot = _at(2026, 12, 1, 12, 1)
    assert no_catch_up.due(_at(2026, 12, 1, 12, 0), slot + timedelta(seconds=4)) == (
        [slot], 0, slot + timedelta(seconds=4))
    assert no_catch_up.due(_at(2026, 12, 1, 12, 0), slot + timedelta(seconds=6))[:2] == ([], 1)


def test_due_stops_a_long_walk_at_its_limit_and_says_how_far_it_settled() -> None:
    every_second = Schedule.define("* * * * * *", "t", catch_up=10)
    start = _at(2026, 12, 1)
    now = start + timedelta(days=3)
    fire, skipped, through = every_second.due(start, now)
    assert (fire, skipped) == ([], SLOT_WALK_LIMIT)
    assert through == start + timedelta(seconds=SLOT_WALK_LIMIT)


def test_seconds_field_comes_first_in_six_field_expressions() -> None:
    every_second = Schedule.define("*/15 * * * * *", "t")
    assert every_second.due(_at(2026, 12, 1, 12, 0), _at(2026, 12, 1, 12, 1))[0] == [
        _at(2026, 12, 1, 12, 0, 15), _at(2026, 12, 1, 12, 0, 30), _at(2026, 12, 1, 12, 0, 45),
        _at(2026, 12, 1, 12, 1)]


# Europe/Madrid in 2026: clocks go forward at 02:00 CET on 29 March (01:00 UTC)
# and back at 03:00 CEST on 25 October (01:00 UTC).
def test_interval_schedules_keep_real_time_across_both_dst_changes() -> None:
    five = Schedule.define("*/5 * * * *", "t", tz="Europe/Madrid", catch_up=86_400 * 2)
    spring, _, _ = five.due(_at(2026, 3, 28, 23, 0), _at(2026, 3, 29, 22, 0))    # local 00:00-00:00
    autumn, _, _ = five.due(_at(2026, 10, 24, 22, 0), _at(2026, 10, 25, 23, 0))
    assert (len(spring), len(autumn)) == (23 * 12, 25 * 12)
    for slots in (spring, autumn):
        assert {b - a for a, b in pairwise(slots)} == {timedelta(minutes=5)}


def test_fixed_time_schedules_follow_debian_cron_across_dst() -> None:
    half_past_two = Schedule.define("30 2 * * *", "t", tz="Europe/Madrid", catch_up=86_400 * 3)
    # 02:30 does not exist on 29 March: it fires when the clock jumps, 03:00 CEST.
    spring, _, _ = half_past_two.due(_at(2026, 3, 28, 12), _at(2026, 3, 30, 12))
    assert spring == [_at(2026, 3, 29, 1, 0), _at(2026, 3, 30, 0, 30)]
    # 02:30 happens twice on 25 October: it fires once, at the first (CEST).
    autumn, _, _ = half_past_two.due(_at(2026, 10, 24, 12), _at(2026, 10, 26, 12))
    assert autumn == [_at(2026, 10, 25, 0, 30), _at(2026, 10, 26, 1, 30)]


def test_fire_time_reads_the_slot_from_a_cron_events_key() -> None:
    def event(key: str | None) -> Event:
        return Event(id=1, topic="t", payload_text="null", idempotency_key=key)
    assert fire_time(event("cron:report.build 0 6 * * *@2026-12-01T06:00:00Z")) == _at(2026, 12, 1, 6)
    assert fire_time(event("order-42")) is None
    assert fire_time(event(None)) is None


def test_the_docs_example_runs_as_written() -> None:
    # Newcomer review L5: it called conveyor.cron.fire_time but imported only Router,
    # so a copy raised NameError in the handler.
    import asyncio
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "cron.md").read_text()
    example = re.search(r"```python\n(.*?)```", text, re.S)
    assert example is not None
    namespace: dict[str, object] = {}
    exec(compile(example.group(1), "docs/cron.md", "exec"), namespace)
    router = namespace["router"]
    assert isinstance(router, Router) and len(router.schedules) == 3
    fired = Event(id=1, topic="report.build", payload_text='{"kind":"5min"}',
                  idempotency_key="cron:report.build */5 * * * *@2026-12-01T06:05:00Z")
    route = router.resolve("report.build")
    assert route is not None
    asyncio.run(route.handler(fired))  # type: ignore[arg-type]
