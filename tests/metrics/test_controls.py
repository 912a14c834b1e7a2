"""Cron, pause and flow-limit gauges, read from a real database by DatabaseGauges
(newcomer review M4): what an operator alerts on when schedules stop firing, a
pause is forgotten, or a limited pattern sits at its ceiling."""

from __future__ import annotations

import psycopg
from prometheus_client import CollectorRegistry

from conveyor.metrics import DatabaseGauges, MetricsConfig


async def _read(db: str, config: MetricsConfig | None = None) -> CollectorRegistry:
    gauges = DatabaseGauges(db, config=config)
    try:
        assert await gauges.refresh_once()
    finally:
        await gauges.close()
    registry = CollectorRegistry()
    registry.register(gauges)
    gauges.holds_lock = True   # closed above; the last read is what a scrape serves
    return registry


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def test_cron_gauges_show_missed_overdue_and_last_fire_per_schedule(
        db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO conveyor.cron_schedules (name, expression, timezone, topic, catch_up, "
            "next_fire_at, last_fired_at, missed) VALUES "
            "('stuck', '* * * * *', 'UTC', 'report.build', 300, now() - interval '90 seconds', "
            " now() - interval '1 hour', 3), "
            "('fresh', '0 6 * * *', 'UTC', 'mail.digest', 300, now() + interval '1 hour', "
            " NULL, 0)")
    registry = await _read(db)
    assert _value(registry, "conveyor_cron_missed_slots_total", schedule="stuck") == 3
    assert _value(registry, "conveyor_cron_missed_slots_total", schedule="fresh") == 0
    assert 90 <= _value(registry, "conveyor_cron_overdue_seconds",  # type: ignore[operator]
                        schedule="stuck") < 3600
    assert _value(registry, "conveyor_cron_overdue_seconds", schedule="fresh") == 0
    assert 3600 <= _value(registry,  # type: ignore[operator]
                          "conveyor_cron_last_fire_age_seconds", schedule="stuck") < 7200
    assert _value(registry, "conveyor_cron_last_fire_age_seconds", schedule="fresh") is None


async def test_pause_gauges_count_the_pauses_in_force_and_age_the_oldest(
        db: str) -> None:
    registry = await _read(db)
    assert (_value(registry, "conveyor_pauses"),
            _value(registry, "conveyor_pause_oldest_age_seconds")) == (0, 0)
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("INSERT INTO conveyor.pauses (pattern, tenant, paused_at) VALUES "
                     "('email.*', NULL, now() - interval '10 minutes'), ('*', 'acme', now())")
    registry = await _read(db)
    assert _value(registry, "conveyor_pauses") == 2
    assert 600 <= _value(registry,  # type: ignore[operator]
                         "conveyor_pause_oldest_age_seconds") < 3600


async def test_flow_gauges_show_running_against_max_running_and_the_tokens(
        db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO conveyor.flow_limits (pattern, max_running, rate, burst, tokens, "
            "refilled_at) VALUES ('mail.*', 3, NULL, NULL, 0, now()), "
            "('sms.send', NULL, 0.001, 10, 4, now()), ('*', 50, NULL, NULL, 0, now())")
        # Running events: two under mail.*, one sms.send, one matching only '*';
        # 'mailbox' shares mail.*'s letters but not its dot.
        conn.execute(
            "INSERT INTO conveyor.events (topic, payload, state, lease_owner, lease_expires_at) "
            "SELECT t, '{}', 'running', gen_random_uuid(), now() + interval '1 minute' "
            "FROM unnest(ARRAY['mail.a', 'mail.b.c', 'sms.send', 'mailbox']) AS t")
        conn.execute("INSERT INTO conveyor.events (topic, payload) VALUES ('mail.a', '{}')")
    registry = await _read(db)
    running = {p: _value(registry, "conveyor_flow_running", pattern=p)
               for p in ("mail.*", "sms.send", "*")}
    assert running == {"mail.*": 2, "sms.send": 1, "*": 4}
    assert _value(registry, "conveyor_flow_max_running", pattern="mail.*") == 3
    assert _value(registry, "conveyor_flow_max_running", pattern="sms.send") is None
    assert 4 <= _value(registry, "conveyor_flow_tokens",  # type: ignore[operator]
                       pattern="sms.send") < 5
    assert _value(registry, "conveyor_flow_tokens", pattern="mail.*") is None


async def test_the_gauges_show_an_operators_override_and_no_disabled_schedule_overdue(
        db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO conveyor.flow_limits (pattern, max_running, override_max_running, "
            "override_rate, override_burst, tokens, refilled_at) VALUES "
            "('mail.*', 3, 7, 0.001, 2, 1, now())")
        conn.execute(
            "INSERT INTO conveyor.cron_schedules (name, expression, timezone, topic, catch_up, "
            "next_fire_at, enabled) VALUES ('off', '* * * * *', 'UTC', 'report.build', 300, "
            "now() - interval '1 hour', false)")
    registry = await _read(db)
    assert _value(registry, "conveyor_flow_max_running", pattern="mail.*") == 7
    assert 1 <= _value(registry, "conveyor_flow_tokens",  # type: ignore[operator]
                       pattern="mail.*") < 2
    assert _value(registry, "conveyor_cron_overdue_seconds", schedule="off") == 0


async def test_schedules_and_patterns_past_the_cap_fold_into_other(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO conveyor.cron_schedules (name, expression, timezone, topic, catch_up, "
            "next_fire_at, missed) SELECT 's' || lpad(i::text, 3, '0'), '* * * * *', 'UTC', "
            "'t', 300, now() - i * interval '1 second', 1 FROM generate_series(1, 250) AS i")
        conn.execute("INSERT INTO conveyor.flow_limits (pattern, max_running) "
                     "SELECT 'p' || i || '.*', 2 FROM generate_series(1, 250) AS i")
    registry = await _read(db, MetricsConfig(max_topics=200))
    schedules = [s for f in registry.collect() for s in f.samples
                 if s.name == "conveyor_cron_missed_slots_total"]
    assert len(schedules) == 201
    assert sum(s.value for s in schedules) == 250
    assert _value(registry, "conveyor_cron_missed_slots_total", schedule="_other") == 50
    # The folded schedules' most overdue: s250, 250 s late.
    assert _value(registry, "conveyor_cron_overdue_seconds",  # type: ignore[operator]
                  schedule="_other") >= 250
    patterns = [s for f in registry.collect() for s in f.samples
                if s.name == "conveyor_flow_max_running"]
    assert len(patterns) == 201
    assert sum(s.value for s in patterns) == 500
