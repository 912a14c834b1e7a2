"""Configuration dataclasses: every numeric field is checked on creation, for range.

A value PostgreSQL, the event loop or a timer could not take (``lease_ttl=1e300``
made every claim fail with "interval out of range", forever) is refused when the
config is built, with one line naming the field, the allowed range and the value.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import psycopg
import pytest

from conveyor import ConfigError, NewEvent, Producer, ProducerConfig, Router, WorkerConfig
from conveyor.config import PRODUCER_RANGES, WORKER_RANGES
from conveyor.worker import Worker

# Written out independently of the module, so a loosened range fails here; the
# table in docs/configuration.md says the same.
WORKER_EXPECTED = {
    "concurrency": (1, 10_000, "1", "10000"),
    "batch_size": (1, 10_000, "1", "10000"),
    "max_batch_size": (1, 10_000, "1", "10000"),
    "poll_interval": (0.01, 86_400.0, "0.01s", "1d"),
    "lease_ttl": (0.1, 604_800.0, "0.1s", "7d"),
    "heartbeat_interval": (0.01, 86_400.0, "0.01s", "1d"),
    "rescue_interval": (0.01, 86_400.0, "0.01s", "1d"),
    "shutdown_timeout": (0.01, 86_400.0, "0.01s", "1d"),
    "handler_timeout": (0.01, 604_800.0, "0.01s", "7d"),
    "reconnect_min": (0.01, 3_600.0, "0.01s", "1h"),
    "reconnect_max": (0.01, 86_400.0, "0.01s", "1d"),
    "ack_interval": (0.0001, 1.0, "0.0001s", "1s"),
    "claim_window": (0.0, 10.0, "0s", "10s"),
    "listener_ping_interval": (0.1, 86_400.0, "0.1s", "1d"),
    "retention": (0.0, 3650 * 86_400.0, "0s", "3650d"),
    "query_timeout": (0.1, 86_400.0, "0.1s", "1d"),
    "horizon_alert_after": (0.1, 604_800.0, "0.1s", "7d"),
    "failure_log_limit": (1, 1_000_000, "1", "1000000"),
    "failure_log_window": (1.0, 86_400.0, "1s", "1d"),
}
PRODUCER_EXPECTED = {
    "max_payload_bytes": (1, 64 * 1024 * 1024, "1", "67108864"),
    "max_payload_depth": (1, 500, "1", "500"),
    "max_attempts": (1, 1000, "1", "1000"),
}
INTEGER_FIELDS = {"concurrency", "batch_size", "max_batch_size", "max_payload_bytes", "max_payload_depth",
                  "max_attempts", "failure_log_limit"}


# heartbeat_interval must stay below lease_ttl and reconnect_max above
# reconnect_min: while one of them is probed, its partner is set out of the way.
PARTNERS: dict[str, dict[str, float]] = {
    "lease_ttl": {"heartbeat_interval": 0.01},
    "heartbeat_interval": {"lease_ttl": 604_800.0},
    "reconnect_min": {"reconnect_max": 86_400.0},
    "reconnect_max": {"reconnect_min": 0.01},
    "max_batch_size": {"batch_size": 1},
}


def _build(field: str, value: Any) -> object:
    if field in PRODUCER_EXPECTED:
        return ProducerConfig(**{field: value})
    return WorkerConfig(**PARTNERS.get(field, {}), **{field: value})


ALL_EXPECTED = {**WORKER_EXPECTED, **PRODUCER_EXPECTED}


def test_max_batch_size_below_batch_size_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"^expected max_batch_size to be >= batch_size "
                                          r"\(100\), got 99$"):
        WorkerConfig(max_batch_size=99)
    assert WorkerConfig(max_batch_size=100).claim_limit == 100
    assert WorkerConfig().claim_limit == 100            # None: up to half of concurrency
    assert WorkerConfig(concurrency=1000, batch_size=100).claim_limit == 500
    assert WorkerConfig(concurrency=10, batch_size=50).claim_limit == 50


def test_the_module_ranges_are_the_documented_ones() -> None:
    assert {name: r[:2] for name, r in WORKER_RANGES.items()} == {
        name: e[:2] for name, e in WORKER_EXPECTED.items()}
    assert {name: r[:2] for name, r in PRODUCER_RANGES.items()} == {
        name: e[:2] for name, e in PRODUCER_EXPECTED.items()}


@pytest.mark.parametrize("field", ALL_EXPECTED)
def test_both_ends_of_the_range_are_accepted(field: str) -> None:
    low, high = ALL_EXPECTED[field][:2]
    for value in (low, high):
        assert getattr(_build(field, value), field) == value


@pytest.mark.parametrize("field", ALL_EXPECTED)
def test_a_value_past_either_end_is_refused_naming_the_range(field: str) -> None:
    low, high, low_text, high_text = ALL_EXPECTED[field]
    step = 1 if field in INTEGER_FIELDS else low / 2 if low else 1e-3
    for value in (low - step, high + (1 if field in INTEGER_FIELDS else high)):
        with pytest.raises(ConfigError) as caught:
            _build(field, value)
        assert str(caught.value) == (
            f"expected {field} to be between {low_text} and {high_text}, got {value!r}")


def test_a_huge_lease_ttl_is_refused_with_its_range() -> None:
    """Regression (F10): accepted, then every claim failed with 'interval out of range'."""
    with pytest.raises(ConfigError) as caught:
        WorkerConfig(lease_ttl=1e300)
    assert str(caught.value) == "expected lease_ttl to be between 0.1s and 7d, got 1e+300"


def test_a_huge_concurrency_is_refused_with_its_range() -> None:
    with pytest.raises(ConfigError) as caught:
        WorkerConfig(concurrency=99_999_999_999_999)
    assert str(caught.value) == (
        "expected concurrency to be between 1 and 10000, got 99999999999999")


@pytest.mark.parametrize("field", [f for f in ALL_EXPECTED if f not in INTEGER_FIELDS])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_durations_are_refused_as_such(field: str, value: float) -> None:
    low_text, high_text = ALL_EXPECTED[field][2:]
    with pytest.raises(ConfigError) as caught:
        _build(field, value)
    assert str(caught.value) == (f"expected {field} to be a finite number of seconds between "
                                 f"{low_text} and {high_text}, got {value!r}")


@pytest.mark.parametrize("field", sorted(INTEGER_FIELDS))
@pytest.mark.parametrize("value", [True, 2.0, "3", None])
def test_counts_must_be_integers(field: str, value: Any) -> None:
    if field == "max_batch_size" and value is None:
        assert WorkerConfig(max_batch_size=None).max_batch_size is None  # None: half of concurrency
        return
    if field == "failure_log_limit" and value is None:
        assert WorkerConfig(failure_log_limit=None).failure_log_limit is None  # None: no limit
        return
    low_text, high_text = ALL_EXPECTED[field][2:]
    with pytest.raises(ConfigError) as caught:
        _build(field, value)
    assert str(caught.value) == (f"expected {field} to be an integer between "
                                 f"{low_text} and {high_text}, got {value!r}")


@pytest.mark.parametrize("field", [f for f in ALL_EXPECTED if f not in INTEGER_FIELDS])
@pytest.mark.parametrize("value", [True, "5", b"5"])
def test_durations_must_be_numbers(field: str, value: Any) -> None:
    low_text, high_text = ALL_EXPECTED[field][2:]
    with pytest.raises(ConfigError) as caught:
        _build(field, value)
    assert str(caught.value) == (f"expected {field} to be a number of seconds between "
                                 f"{low_text} and {high_text}, got {value!r}")


def test_optional_durations_still_take_none() -> None:
    config = WorkerConfig(retention=None, horizon_alert_after=None)
    assert (config.retention, config.horizon_alert_after) == (None, None)


def test_the_cross_field_rules_still_hold() -> None:
    with pytest.raises(ConfigError, match=r"^expected heartbeat_interval to be < lease_ttl"):
        WorkerConfig(lease_ttl=1.0, heartbeat_interval=1.0)
    with pytest.raises(ConfigError, match=r"^expected reconnect_max to be >= reconnect_min"):
        WorkerConfig(reconnect_min=10.0, reconnect_max=5.0)


async def test_a_worker_at_every_upper_limit_claims_and_acknowledges(fresh_db: str) -> None:
    """The maxima are what PostgreSQL's interval, integer and statement_timeout can carry.

    Every limit at once: the claim (lease), the registry row, the first upkeep
    pass (prune with the longest retention), and the acknowledgement on stop
    (the acknowledgement interval is a minute long).
    """
    highs = {name: high for name, (_low, high, *_rest) in WORKER_EXPECTED.items()}
    highs.update(heartbeat_interval=86_400.0, reconnect_min=3_600.0)
    config = WorkerConfig(**highs)
    done = asyncio.Event()

    async def handle(event: object) -> None:
        done.set()

    router = Router()
    router.add("limits.probe", handle)
    producer_highs = {name: high for name, (_low, high, *_rest) in PRODUCER_EXPECTED.items()}
    with psycopg.connect(fresh_db) as conn:
        Producer(ProducerConfig(**producer_highs)).enqueue_many(
            conn, [NewEvent(topic="limits.probe", payload={"n": 1}, max_attempts=1000,
                            delay=0, priority=32767)])
    worker = Worker(fresh_db, router, config)
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(done.wait(), 20)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 30)
    with psycopg.connect(fresh_db) as conn:
        assert conn.execute("SELECT state FROM conveyor.events").fetchall() == [("succeeded",)]
