"""S3: payload limits at enqueue (typed errors, before SQL), and caps on what a
failing handler can make Conveyor store."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import psycopg
import pytest

from conveyor import (
    AsyncCommittingProducer,
    BackoffPolicy,
    Cancel,
    Event,
    PermanentFailure,
    Producer,
    RetryAfter,
    Router,
    Worker,
    WorkerConfig,
)
from conveyor.errors import InvalidInputError, PayloadTooLargeError
from conveyor.worker.executor import ERROR_MAX_CHARS, TRACEBACK_MAX_CHARS

from .conftest import Tripwire

KIB = 1024


def _sized(n_bytes: int) -> dict[str, str]:
    # {"d":"xxx..."} is 8 bytes of JSON around the string.
    return {"d": "x" * (n_bytes - 8)}


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


async def test_64_kib_payload_is_accepted_and_stored_intact(fresh_db: str) -> None:
    payload = _sized(64 * KIB)
    assert len(json.dumps(payload, separators=(",", ":")).encode()) == 64 * KIB
    async with AsyncCommittingProducer(fresh_db) as producer:
        event_id = await producer.enqueue("s3.ok", payload)
    async with await psycopg.AsyncConnection.connect(fresh_db) as conn:
        row = await (await conn.execute("SELECT payload FROM conveyor.events WHERE id = %s",
                                        (event_id,))).fetchone()
    assert row is not None and row[0] == payload


def test_exactly_256_kib_is_accepted_one_byte_more_is_refused_before_sql() -> None:
    wire = Tripwire()
    with pytest.raises(AssertionError, match="touched"):
        Producer().enqueue(wire, "s3.edge", _sized(256 * KIB))       # type: ignore[arg-type]
    wire = Tripwire()
    with pytest.raises(PayloadTooLargeError, match="262145 bytes"):
        Producer().enqueue(wire, "s3.big", _sized(256 * KIB + 1))    # type: ignore[arg-type]
    assert wire.touched == []


def test_ten_mib_payload_is_refused_fast() -> None:
    wire = Tripwire()
    payload = _sized(10 * KIB * KIB)
    # Baseline: encoding the payload once, which the refusal may need to do. A loaded
    # machine slows both alike; the 0.5 s bound stands when the machine is idle.
    started = time.perf_counter()
    json.dumps(payload, separators=(",", ":")).encode()
    encode = time.perf_counter() - started
    started = time.perf_counter()
    with pytest.raises(PayloadTooLargeError):
        Producer().enqueue(wire, "s3.huge", payload)                  # type: ignore[arg-type]
    took = time.perf_counter() - started
    print(f"\nS3: a 10 MiB payload refused in {took * 1000:.1f} ms (one encoding "
          f"{encode * 1000:.1f} ms)")
    assert took < max(0.5, 10 * encode)
    assert wire.touched == []


@pytest.mark.parametrize("depth", [65, 10_000, 200_000])
def test_over_deep_payload_is_refused_with_a_typed_error(depth: int) -> None:
    wire = Tripwire()
    # Baseline: building the payload, a walk of the same depth. A loaded machine
    # slows both alike (CI: 1.8 s for depth 200,000 against a fixed 1.0 s bound);
    # the 1.0 s bound stands when the machine is idle.
    started = time.perf_counter()
    payload = {"k": _nested(depth - 1)}
    build = time.perf_counter() - started
    started = time.perf_counter()
    with pytest.raises(PayloadTooLargeError):
        Producer().enqueue(wire, "s3.deep", payload)   # type: ignore[arg-type]
    assert time.perf_counter() - started < max(1.0, 10 * build)
    assert wire.touched == []


def test_depth_64_is_accepted() -> None:
    with pytest.raises(AssertionError, match="touched"):
        Producer().enqueue(Tripwire(), "s3.deep", {"k": _nested(63)})   # type: ignore[arg-type]


def test_enqueue_many_refuses_one_oversized_event_and_writes_none() -> None:
    wire = Tripwire()
    events = [{"topic": "s3.many", "payload": {}} for _ in range(5)]
    events.append({"topic": "s3.many", "payload": _sized(256 * KIB + 1)})
    with pytest.raises(PayloadTooLargeError, match="event #5"):
        Producer().enqueue_many(wire, events)   # type: ignore[arg-type]
    assert wire.touched == []


def test_payload_too_large_is_an_invalid_input_error() -> None:
    assert issubclass(PayloadTooLargeError, InvalidInputError)


HUGE = "E" * (1024 * 1024)


def _recurse(n: int) -> None:
    if n == 0:
        raise RuntimeError(HUGE)
    _recurse(n - 1)


async def test_stored_errors_and_tracebacks_stay_under_the_caps(fresh_db: str) -> None:
    async def handle(event: Event) -> None:
        kind = event.topic.split(".")[1]
        if kind == "raise":
            raise ValueError(HUGE)
        if kind == "deep":
            _recurse(500)
        if kind == "permanent":
            raise PermanentFailure(HUGE)
        if kind == "cancel":
            raise Cancel(HUGE)
        if kind == "retry":
            raise RetryAfter(0.01, HUGE)

    router = Router()
    router.add("cap.*", handle)
    config = WorkerConfig(concurrency=10, batch_size=10, poll_interval=0.2, lease_ttl=2.0,
                          heartbeat_interval=0.5, rescue_interval=0.5, shutdown_timeout=2.0,
                          backoff=BackoffPolicy(base_delay=0.01, max_delay=0.02, jitter=0.0))
    kinds = ["raise", "deep", "permanent", "cancel", "retry"]
    async with AsyncCommittingProducer(fresh_db) as producer:
        for kind in kinds:
            await producer.enqueue(f"cap.{kind}", {}, max_attempts=2)
    worker = Worker(fresh_db, router, config)
    for _ in range(40):
        await worker.run_once()
        async with await psycopg.AsyncConnection.connect(fresh_db) as conn:
            left = await (await conn.execute(
                "SELECT count(*) FROM conveyor.events WHERE state NOT IN "
                "('failed', 'cancelled')")).fetchone()
        if left == (0,):
            break
        await asyncio.sleep(0.05)
    await worker.close()
    async with await psycopg.AsyncConnection.connect(fresh_db) as conn:
        rows = await (await conn.execute(
            "SELECT topic, state, length(last_error), errors, pg_column_size(errors) "
            "FROM conveyor.events")).fetchall()
    report = {}
    for topic, state, last_len, errors, size in rows:
        assert state in ("failed", "cancelled"), (topic, state)
        assert last_len is not None and last_len <= ERROR_MAX_CHARS
        for entry in errors:
            assert len(entry["error"]) <= ERROR_MAX_CHARS
            assert entry["traceback"] is None or len(entry["traceback"]) <= TRACEBACK_MAX_CHARS
        report[topic] = (last_len, len(errors), size)
    print(f"\nS3 stored error sizes (last_error chars, entries, errors bytes): {report}")
    assert max(size for _, _, size in report.values()) < 64 * KIB


# Found here: unbounded history (fixed in 07101b8, 10 entries), then caps in
# characters rather than bytes (~165 KB with CJK text; fixed in dfd7a49).
async def test_error_history_of_one_event_stays_under_64_kib(fresh_db: str) -> None:
    import secrets

    def handle(event: Event) -> None:
        # Incompressible 3-byte characters, so neither TOAST compression nor a
        # character count can hide the size.
        rng = secrets.SystemRandom()
        raise RuntimeError("".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(5000)))

    router = Router()
    router.add("cap.history", handle)
    config = WorkerConfig(concurrency=1, batch_size=1, poll_interval=0.2, lease_ttl=2.0,
                          heartbeat_interval=0.5, rescue_interval=0.5,
                          backoff=BackoffPolicy(base_delay=0.001, max_delay=0.001, jitter=0.0))
    async with AsyncCommittingProducer(fresh_db) as producer:
        event_id = await producer.enqueue("cap.history", {}, max_attempts=40)
    worker = Worker(fresh_db, router, config)
    try:
        for _ in range(400):
            await worker.run_once()
            async with await psycopg.AsyncConnection.connect(fresh_db) as conn:
                row = await (await conn.execute(
                    "SELECT state, pg_column_size(errors), octet_length(errors::text), "
                    "jsonb_array_length(errors), attempts "
                    "FROM conveyor.events WHERE id = %s", (event_id,))).fetchone()
            assert row is not None
            if row[0] == "failed":
                break
            await asyncio.sleep(0.01)
    finally:
        await worker.close()
    print(f"\nS3: {row[4]} attempts, {row[3]} entries: {row[2]} bytes of error history "
          f"({row[1]} bytes on disk)")
    assert row[0] == "failed"
    assert row[3] <= 10
    assert row[2] <= 64 * KIB and row[1] <= 64 * KIB
