"""Flow control in the claim: max_running, rate and fair_by, across several workers.

Workers run in this process (the limits live in the database, so several
Worker objects are as many claimers as processes would be); the run with
worker processes is tests/acceptance/test_flow_processes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
import time
from typing import Any

import psycopg
import pytest

from claim_support import claim_params
from conveyor import BackoffPolicy, ConfigError, Event, NewEvent, Router, Worker
from conveyor.db.named_queries import queries_for
from conveyor.flow import parse_rate
from conveyor.patterns import sql_params
from waiting import wait_until
from worker_support import CallCounter, enqueue, enqueue_many, fast_config, query, running, wait_all_in

Q = queries_for("conveyor")


class Concurrency:
    """The most calls of a handler at once, counted inside the handler itself."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self.starts: list[float] = []
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.starts.append(time.monotonic())

    def leave(self) -> None:
        with self._lock:
            self.now -= 1


def test_route_options_are_checked_with_one_line_naming_the_value() -> None:
    router = Router()
    for bad, message in [
        ({"max_running": 0}, "expected max_running for 'a' to be an int from 1 to 1000000, got 0"),
        ({"max_running": True}, "expected max_running for 'a' to be an int"),
        ({"rate": "ten a second"}, "expected rate for 'a' like '10/s', '600/m' or '5/10s'"),
        ({"rate": "0/s"}, "expected rate for 'a' like"),
        ({"rate": 10}, "expected rate for 'a' like"),
        ({"fair_by": "customer"}, "expected fair_by for 'a' to be one of 'tenant', got 'customer'"),
    ]:
        with pytest.raises(ConfigError) as raised:
            router.add("a", print, **bad)  # type: ignore[arg-type]
        assert message in str(raised.value) and "\n" not in str(raised.value)
    assert router.routes == ()
    route = router.add("a", print, max_running=3, rate="600/m", fair_by="tenant")
    assert route.flow is not None
    assert (route.flow.max_running, route.flow.rate, route.flow.burst, route.flow.fair_by) == (
        3, 10.0, 10.0, "tenant")
    assert parse_rate("5/10s", "x") == 0.5 and parse_rate("1/h", "x") == 1 / 3600
    assert router.add("b", print).flow is None


async def test_max_running_holds_across_three_workers_and_is_reached(db: str) -> None:
    seen = Concurrency()

    async def render(event: Event) -> None:
        seen.enter()
        try:
            await asyncio.sleep(0.05)
        finally:
            seen.leave()

    router = Router()
    router.add("report.render", render, max_running=3)
    await enqueue_many(db, [NewEvent(topic="report.render", payload={"n": n}) for n in range(60)])
    samples: list[int] = []
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(3):
            await stack.enter_async_context(running(Worker(db, router, fast_config(concurrency=10))))

        async def sample() -> None:
            while True:
                rows = await query(db, "SELECT count(*) AS n FROM conveyor.events"
                                       " WHERE state = 'running'")
                samples.append(rows[0]["n"])
                await asyncio.sleep(0.01)
        sampler = asyncio.create_task(sample())
        await wait_all_in(db, {"succeeded"}, timeout=30)
        sampler.cancel()
    assert seen.most == 3, seen.most           # the limit holds, and is used
    assert max(samples) <= 3 and len(samples) > 20


async def test_a_limit_declared_by_one_worker_binds_a_worker_without_it(db: str) -> None:
    seen = Concurrency()

    async def send(event: Event) -> None:
        seen.enter()
        try:
            await asyncio.sleep(0.03)
        finally:
            seen.leave()

    limited, catch_all = Router(), Router()
    limited.add("email.*", send, max_running=2)
    catch_all.add("*", send)                   # knows nothing of the limit
    await enqueue_many(db, [NewEvent(topic="email.send", payload=n) for n in range(40)])
    async with running(Worker(db, limited, fast_config(concurrency=10))), \
            running(Worker(db, catch_all, fast_config(concurrency=10))):
        await wait_all_in(db, {"succeeded"}, timeout=30)
    assert seen.most == 2, seen.most


async def test_rate_limit_bounds_the_starts_in_every_window(db: str) -> None:
    seen = Concurrency()

    def ping(event: Event) -> None:
        seen.enter()
        seen.leave()

    router = Router()
    router.add("sms.send", ping, rate="20/s", blocking=False)
    await enqueue_many(db, [NewEvent(topic="sms.send", payload=n) for n in range(100)])
    async with running(Worker(db, router, fast_config(concurrency=50))), \
            running(Worker(db, router, fast_config(concurrency=50))):
        await wait_all_in(db, {"succeeded"}, timeout=60)
    starts = sorted(seen.starts)
    # From the first start to the last: neither the workers' start-up nor the
    # test's polling, which a loaded machine stretches, count against the rate.
    took = starts[-1] - starts[0]
    # A full bucket (burst = one second's worth, 20) at once, then 20 a second:
    # any window of w seconds holds at most 20 * w + 20 starts.
    for i, first in enumerate(starts):
        for w in (0.5, 1.0, 2.0):
            in_window = sum(1 for t in starts[i:] if t < first + w)
            assert in_window <= 20 * w + 20 + 1, (w, in_window)
    assert 3.5 < took < 8, took                  # 80 after the burst, at 20 a second


async def test_fair_by_tenant_starts_a_small_tenants_event_despite_a_big_backlog(db: str) -> None:
    started: dict[str, float] = {}

    async def export(event: Event) -> None:
        if event.tenant == "small":
            started["small"] = time.monotonic()
        await asyncio.sleep(0.02)

    router = Router()
    router.add("export.run", export, fair_by="tenant", max_running=4)
    await enqueue_many(db, [NewEvent(topic="export.run", payload=n, tenant="big") for n in range(3000)])
    async with running(Worker(db, router, fast_config(concurrency=8))), \
            running(Worker(db, router, fast_config(concurrency=8))):
        await asyncio.sleep(0.5)                  # the big tenant's backlog is being worked
        enqueued = time.monotonic()
        await enqueue(db, "export.run", "small one", tenant="small")
        deadline = time.monotonic() + 10
        while "small" not in started and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    assert "small" in started
    # At 4 running x 20 ms, the 3000 ahead of it would take 15 s in claim order (more
    # on a loaded machine): a third of that leaves a loaded machine room.
    assert started["small"] - enqueued < 5.0, started["small"] - enqueued
    left = await query(db, "SELECT count(*) AS n FROM conveyor.events WHERE state = 'pending'")
    assert left[0]["n"] > 1000                    # it did not wait for the backlog


async def test_unlimited_topics_are_not_held_back_by_a_saturated_limit(db: str) -> None:
    release = asyncio.Event()

    async def slow(event: Event) -> None:
        await release.wait()

    fast_done: list[float] = []

    def fast(event: Event) -> None:
        fast_done.append(time.monotonic())

    router = Router()
    router.add("slow.job", slow, max_running=2)
    router.add("fast.job", fast, blocking=False)
    await enqueue_many(db, [NewEvent(topic="slow.job", payload=n) for n in range(50)])
    await enqueue_many(db, [NewEvent(topic="fast.job", payload=n) for n in range(2000)])
    async with running(Worker(db, router, fast_config(concurrency=20, batch_size=20))):
        deadline = time.monotonic() + 60
        while len(fast_done) < 2000 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        rows = await query(db, "SELECT topic, state, count(*) AS n FROM conveyor.events"
                               " GROUP BY 1, 2 ORDER BY 1, 2")
        release.set()
    counts: dict[tuple[str, str], Any] = {(r["topic"], r["state"]): r["n"] for r in rows}
    assert len(fast_done) == 2000
    assert counts[("slow.job", "running")] == 2 and counts[("slow.job", "pending")] == 48


async def test_run_once_claims_limited_events_within_the_limit(db: str) -> None:
    seen = Concurrency()

    async def render(event: Event) -> None:
        seen.enter()
        await asyncio.sleep(0.01)
        seen.leave()

    router = Router()
    router.add("report.render", render, max_running=2)
    router.add("other", render)
    await enqueue_many(db, [NewEvent(topic="report.render", payload=n) for n in range(5)]
                       + [NewEvent(topic="other", payload=n) for n in range(3)])
    worker = Worker(db, router, fast_config(concurrency=10))
    try:
        first = await worker.run_once()
        total = first
        while handled := await worker.run_once():
            total += handled
    finally:
        await worker.close()
    assert first == 5 and total == 8            # 3 others and 2 limited, then the rest
    assert seen.most <= 5


async def test_a_limited_backlog_leaves_the_plain_claims_lane(db: str) -> None:
    release = asyncio.Event()

    async def slow(event: Event) -> None:
        await release.wait()

    fast_done: list[int] = []
    router = Router()
    router.add("slow.job", slow, max_running=2)
    router.add("fast.job", lambda event: fast_done.append(event.id), blocking=False)
    # Older, so ahead of the unlimited events in claim order.
    await enqueue_many(db, [NewEvent(topic="slow.job", payload=n) for n in range(3000)])
    await enqueue_many(db, [NewEvent(topic="fast.job", payload=n) for n in range(200)])
    worker = Worker(db, router, fast_config(concurrency=20, batch_size=20))
    async with running(worker):
        deadline = time.monotonic() + 60
        while len(fast_done) < 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # Stopping before the two slow calls end: their freed slots would
        # otherwise take two more slow events before the stop (2,996 left).
        worker.request_stop()
        release.set()
    assert len(fast_done) == 200
    lanes = await query(db, "SELECT limited, count(*) AS n FROM conveyor.events"
                            " WHERE state = 'pending' GROUP BY 1")
    assert {r["limited"]: r["n"] for r in lanes} == {True: 2998}
    assert worker.flow.sorted >= 2998
    # The plain claim's walk, with five new unlimited events behind the
    # limited backlog: the five, none of the 2,998 limited ones.
    await enqueue_many(db, [NewEvent(topic="fast.job", payload=n) for n in range(5)])
    params = claim_params(limit=20, **sql_params(["slow.job"], prefix="except_"),
                          **sql_params([], prefix="fifo_"))
    async with await psycopg.AsyncConnection.connect(db) as conn:
        # The claim's plan on a busy table (tests/test_queries.py): an index scan
        # in claim order. On this small one the planner could pick a bitmap
        # scan, which also returns the moved rows' dead entries until a vacuum.
        await conn.execute("SET LOCAL enable_bitmapscan = off")
        cur = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + Q["event_claim_flow"], params)
        plan = (await cur.fetchone() or [None])[0]
        await conn.rollback()
    rows_read = _index_rows(plan[0]["Plan"])
    assert rows_read <= 10, (rows_read, _nodes(plan[0]["Plan"]))


def _nodes(node: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(node["Node Type"], node.get("Index Name"), node.get("Actual Rows"),
             node.get("Actual Loops"), node.get("Rows Removed by Filter"))] + [
        n for child in node.get("Plans", []) for n in _nodes(child)]


def _index_rows(node: dict[str, Any]) -> int:
    """Live rows the index scans of a plan read: those returned and those filtered out."""
    own = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0) \
        if node["Node Type"] == "Index Scan" else 0
    return own + sum(_index_rows(child) for child in node.get("Plans", []))


async def test_a_removed_limit_gives_its_waiting_events_back_to_every_worker(db: str) -> None:
    done: list[int] = []

    async def render(event: Event) -> None:
        done.append(event.id)

    limited = Router()
    limited.add("report.render", render, max_running=1)
    await enqueue_many(db, [NewEvent(topic="report.render", payload=n) for n in range(6)])
    worker = Worker(db, limited, fast_config(concurrency=10))
    try:
        assert await worker.run_once() == 1          # one within the limit, the rest sorted
    finally:
        await worker.close()
    lanes = await query(db, "SELECT count(*) AS n FROM conveyor.events"
                            " WHERE state = 'pending' AND limited")
    assert lanes[0]["n"] == 5
    await query(db, "DELETE FROM conveyor.flow_limits WHERE pattern = 'report.render'")
    plain = Router()
    plain.add("report.render", render)               # no limit any more
    worker = Worker(db, plain, fast_config(concurrency=10))
    try:
        assert await worker.run_once() == 5
    finally:
        await worker.close()
    assert len(done) == 6


async def test_fifo_by_runs_each_keys_events_one_at_a_time_in_order_despite_retries(
        db: str) -> None:
    runs: dict[str, list[tuple[int, float, float]]] = {}
    failed_once: set[int] = set()
    rng = random.Random(11)

    async def post(event: Event) -> None:
        started = time.monotonic()
        await asyncio.sleep(rng.uniform(0.001, 0.006))
        n = event.payload["n"]
        if n % 7 == 3 and n not in failed_once:     # every seventh fails once, then succeeds
            failed_once.add(n)
            raise RuntimeError("flaky")
        runs.setdefault(event.tenant or "", []).append((n, started, time.monotonic()))

    router = Router()
    router.add("ledger.post", post, fifo_by="tenant",
               backoff=BackoffPolicy(base_delay=0.05, max_delay=0.05, jitter=0))
    events = [NewEvent(topic="ledger.post", payload={"n": n}, tenant=f"t{n % 6}")
              for n in range(240)]
    await enqueue_many(db, events)
    async with running(Worker(db, router, fast_config(concurrency=10))), \
            running(Worker(db, router, fast_config(concurrency=10))), \
            running(Worker(db, router, fast_config(concurrency=10))):
        await wait_all_in(db, {"succeeded"}, timeout=60)
    assert len(failed_once) == 34
    for tenant, done in runs.items():
        numbers = [n for n, _, _ in done]
        # In enqueue order although every seventh event failed once and waited for its retry.
        assert numbers == sorted(numbers) and len(numbers) == 40, (tenant, numbers)
        # One at a time: each run starts after the previous one ended.
        for (_, _, ended), (_, started, _) in itertools.pairwise(done):
            assert started >= ended, tenant
    # Keys ran side by side: some runs of different tenants overlapped.
    spans = [(s, e) for done in runs.values() for _, s, e in done]
    spans.sort()
    assert any(b[0] < a[1] for a, b in itertools.pairwise(spans))


def test_fifo_by_is_checked_with_one_line_naming_the_value() -> None:
    router = Router()
    for bad, message in [
        ({"fifo_by": "customer"}, "expected fifo_by for 'a' to be 'tenant' or 'payload.<key>'"),
        ({"fifo_by": "payload."}, "got 'payload.'"),
        ({"fifo_by": "payload.a..b"}, "got 'payload.a..b'"),
        ({"fifo_by": "tenant", "fair_by": "tenant"}, "fair_by and fifo_by for 'a' do not go "
                                                     "together"),
    ]:
        with pytest.raises(ConfigError) as raised:
            router.add("a", print, **bad)  # type: ignore[arg-type]
        assert message in str(raised.value) and "\n" not in str(raised.value)
    route = router.add("a", print, fifo_by="payload.customer.id")
    assert route.flow is not None
    assert route.flow.fifo_params == {"fifo_tenant": False, "fifo_path": ["customer", "id"]}


async def test_fifo_by_runs_one_keys_backlog_back_to_back(db: str) -> None:
    # A key's next event may run as soon as its previous one finished. The flow
    # claim of a fifo pattern that took fewer than it asked for (the other heads
    # were running) counted as "nothing due" and looked again only after
    # FLOW_IDLE_RECHECK: one key's backlog ran one event a second.
    done: list[int] = []

    async def post(event: Event) -> None:
        await asyncio.sleep(0.06)       # longer than a recheck of a full pattern (50 ms)
        done.append(event.payload["n"])

    router = Router()
    router.add("ledger.post", post, fifo_by="tenant")
    await enqueue_many(db, [NewEvent(topic="ledger.post", payload={"n": n}, tenant="t0")
                            for n in range(20)])
    started = time.monotonic()
    async with running(Worker(db, router, fast_config(concurrency=10))):
        await wait_all_in(db, {"succeeded"}, timeout=60)
    took = time.monotonic() - started
    assert done == list(range(20))
    # Back to back, each 60 ms and a claim: under 2 s on a quiet machine; one a
    # second took 19 s or more.
    assert took < 8, f"20 events of one key took {took:.1f} s"


async def test_fifo_by_does_not_claim_over_and_over_while_a_key_runs(db: str) -> None:
    # While a key's event runs, its next one cannot start: the worker waits for
    # the finish (or a NOTIFY) rather than sending a flow claim every
    # FLOW_RECHECK (50 ms) for as long as the handler takes.
    release = asyncio.Event()
    started: list[int] = []

    async def post(event: Event) -> None:
        started.append(event.payload["n"])
        if event.payload["n"] == 0:
            await release.wait()

    router = Router()
    router.add("ledger.post", post, fifo_by="tenant")
    await enqueue_many(db, [NewEvent(topic="ledger.post", payload={"n": n}, tenant="t0")
                            for n in range(3)])
    worker = Worker(db, router, fast_config(concurrency=10))
    claims = CallCounter(worker.flow, "_claim_one")
    async with running(worker):
        await wait_until(lambda: _true(started == [0]), timeout=10, what="the first event")
        before = claims.count
        await asyncio.sleep(1.5)       # the window counted: the handler holds its key
        during = claims.count - before
        release.set()
        await wait_all_in(db, {"succeeded"}, timeout=10)
    assert started == [0, 1, 2]
    # One recheck a FLOW_IDLE_RECHECK (1 s) at most; every 50 ms would be 30.
    assert during <= 3, f"{during} flow claims in 1.5 s while the key's event ran"


async def _true(value: bool) -> bool:
    return value
