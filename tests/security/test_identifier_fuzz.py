"""S2: 10,000 fuzzed identifiers (schema, topic, tenant, idempotency key, topic
pattern) are refused before any SQL, or accepted only when they match the
strict patterns. A refusal is proven to happen before SQL by a connection
stand-in that fails on any use."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import AsyncProducer, Producer, ProducerConfig, Router, Worker, WorkerConfig
from conveyor.admin import Admin
from conveyor.errors import ConfigError, InvalidInputError
from conveyor.validation import IDEMPOTENCY_KEY_MAX_LENGTH, TOPIC_MAX_LENGTH

from .conftest import Tripwire

SCHEMA_RE = re.compile(r"(?!pg_)[a-z_][a-z0-9_]{0,39}")
TOPIC_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9][A-Za-z0-9_-]*)*")
TENANT_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# C0, DEL, C1 and the Unicode line and paragraph separators, as docs/producing.md says.
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")

HOSTILE = ['"', "'", "%", ";", "\x00", " ", "\t", "\n", "\r", "\\", "--", "/*", "*/", "$$", "`",
           "é", "ß", "İ", "\u0130", "\u212a", "\u2028", "\u0085", "\ufeff", "😀", "\ud800",
           ".", "-", "_", "*", "a", "z", "A", "0", "9", "pg_", "%s", "%(x)s", "{", "}", "|"]
ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789_-."


def _boundary(n_bytes: int) -> st.SearchStrategy[str]:
    # Strings whose UTF-8 length straddles the 63/64-byte identifier limit.
    return st.sampled_from(["a", "é", "😀", "_", "-"]).map(
        lambda c: c * max(1, n_bytes // len(c.encode())))


IDENTIFIERS = st.one_of(
    st.lists(st.sampled_from(HOSTILE + list(ALNUM)), max_size=60).map("".join),
    st.text(max_size=70),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=60, max_size=70),
    st.sampled_from([62, 63, 64, 65, 200, 201, 255, 256]).flatmap(_boundary),
    st.lists(st.sampled_from(["a", "b1", "x-y", "q_", "", "*", "é", "%"]), max_size=6).map(".".join),
)

SEEN = {"schema": [0, 0], "topic": [0, 0], "tenant": [0, 0], "key": [0, 0], "pattern": [0, 0]}
FUZZ = settings(max_examples=2100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def _count(kind: str, accepted: bool) -> None:
    SEEN[kind][0 if accepted else 1] += 1


@FUZZ
@given(IDENTIFIERS)
def test_schema_names(name: str) -> None:
    ok = SCHEMA_RE.fullmatch(name) is not None
    _count("schema", ok)
    for build in (lambda: ProducerConfig(schema=name), lambda: WorkerConfig(schema=name),
                  lambda: Admin(schema=name)):
        if ok:
            build()
        else:
            with pytest.raises((ConfigError, InvalidInputError)):
                build()
    if ok:
        assert len(name.encode()) <= 40     # the channel "<schema>.events" stays <= 63 bytes


@FUZZ
@given(IDENTIFIERS)
def test_topics(topic: str) -> None:
    ok = len(topic) <= TOPIC_MAX_LENGTH and TOPIC_RE.fullmatch(topic) is not None
    _count("topic", ok)
    wire = Tripwire()
    if ok:
        with pytest.raises(AssertionError, match="touched"):
            Producer().enqueue(wire, topic)   # type: ignore[arg-type]
    else:
        with pytest.raises(InvalidInputError):
            Producer().enqueue(wire, topic)   # type: ignore[arg-type]
        assert wire.touched == []


@FUZZ
@given(IDENTIFIERS)
def test_tenants(tenant: str) -> None:
    ok = TENANT_RE.fullmatch(tenant) is not None
    _count("tenant", ok)
    wire = Tripwire()
    if ok:
        assert len(tenant.encode()) <= 63
        WorkerConfig(tenants=(tenant,))
        with pytest.raises(AssertionError, match="touched"):
            Producer().enqueue(wire, "ok.topic", tenant=tenant)   # type: ignore[arg-type]
    else:
        with pytest.raises(InvalidInputError):
            Producer().enqueue(wire, "ok.topic", tenant=tenant)   # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            Producer().enqueue_many(wire, [{"topic": "ok", "tenant": tenant}])  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            WorkerConfig(tenants=(tenant,))
        assert wire.touched == []


@FUZZ
@given(IDENTIFIERS)
def test_idempotency_keys(key: str) -> None:
    try:
        key.encode()
        encodable = True
    except UnicodeEncodeError:
        encodable = False
    ok = (0 < len(key) <= IDEMPOTENCY_KEY_MAX_LENGTH and not CONTROL_RE.search(key) and encodable)
    _count("key", ok)
    wire = Tripwire()
    if ok:
        with pytest.raises(AssertionError, match="touched"):
            Producer().enqueue(wire, "ok.topic", idempotency_key=key)   # type: ignore[arg-type]
    else:
        with pytest.raises(InvalidInputError):
            Producer().enqueue(wire, "ok.topic", idempotency_key=key)   # type: ignore[arg-type]
        assert wire.touched == []


@FUZZ
@given(IDENTIFIERS)
def test_topic_patterns(pattern: str) -> None:
    base = pattern[:-2] if pattern.endswith(".*") else pattern
    ok = pattern == "*" or (len(base) <= TOPIC_MAX_LENGTH and TOPIC_RE.fullmatch(base) is not None)
    _count("pattern", ok)

    async def handle(_: Any) -> None:
        return None
    router = Router()
    if ok:
        router.add(pattern, handle)
    else:
        with pytest.raises((ConfigError, InvalidInputError)):
            router.add(pattern, handle)


def test_async_producer_and_a_closed_connection_refuse_before_sql(fresh_db: str) -> None:
    # A real but closed connection: any SQL would raise psycopg's OperationalError
    # (wrapped as DatabaseError); only InvalidInputError proves nothing was sent.
    conn = psycopg.connect(fresh_db)
    conn.close()
    bad = ['a"; DROP TABLE conveyor.events; --', "x\x00y", "é" * 32, "a" * 64, "Tenant", " t"]
    for value in [*bad, "a" * 201, "a.", "a..b", "*"]:
        if value in ("a" * 64, "Tenant"):
            continue   # fine topics, not fine tenants
        with pytest.raises(InvalidInputError):
            Producer().enqueue(conn, value)
    for value in bad:
        with pytest.raises(InvalidInputError):
            Producer().enqueue(conn, "ok", tenant=value)
        with pytest.raises(InvalidInputError):
            asyncio.run(AsyncProducer().enqueue(Tripwire(), "ok", tenant=value))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        Producer().enqueue(conn, "ok", idempotency_key="k\x00")


def test_zz_report_the_counts() -> None:
    total = sum(a + r for a, r in SEEN.values())
    print(f"\nS2: {total} fuzzed identifiers; accepted/refused per kind: {SEEN}")
    if all(a + r for a, r in SEEN.values()):
        assert total >= 10_000
    # Each kind saw both outcomes, so the strategies are not degenerate.
        assert all(r > 0 for _, r in SEEN.values())


def test_worker_refuses_a_bad_schema_before_connecting() -> None:
    async def handle(_: Any) -> None:
        return None
    router = Router()
    router.add("ok", handle)
    with pytest.raises(ConfigError):
        Worker("host=192.0.2.1 connect_timeout=1", router, WorkerConfig(schema='bad"schema'))
