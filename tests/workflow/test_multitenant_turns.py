"""Many tenant databases, few connections: 200 tenants served within 40 connections,
turns that keep every tenant's wait bounded under a backlog, and two servers each
within its own budget, one of them stopped and started again.

Connections are counted where they are: in the server's pg_stat_activity, by
database and application_name, sampled while the worker runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from conveyor import Producer, Router, WorkerConfig
from conveyor.embedded import EmbeddedPostgres
from conveyor.metrics.tenants import TenantsCollector
from conveyor.multitenant import (
    DirectoryTenants,
    MultiTenantConfig,
    MultiTenantWorker,
    TenantDatabase,
    current_tenant,
)
from conveyor.schema.migrator import Migrator
from conveyor.types import Event
from server_support import private_postgres
from waiting import wait_until

from .conftest import running

TENANTS = 200
BUDGET = 40
POLL = 0.5
RECONNECT: dict[str, Any] = {"reconnect_min": 0.05, "reconnect_max": 0.5}
APPLICATION = "mtt-test"      # the test's own connections, never counted as the worker's


def _admin(url: str, statement: sql.Composable) -> None:
    with psycopg.connect(url, autocommit=True, application_name=APPLICATION) as conn:
        conn.execute(statement)


def _create_many(server_url: str, template: str, names: list[str]) -> None:
    def create(name: str) -> None:
        _admin(server_url, sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)))
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(create, names))


def _drop_many(server_url: str, names: list[str]) -> None:
    def drop(name: str) -> None:
        _admin(server_url, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))
    # In parallel: each drop waits for a checkpoint, and concurrent ones share it.
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(drop, names))


@pytest.fixture(scope="module")
def many_server() -> Iterator[str]:
    """A private embedded PostgreSQL for the TENANTS databases, with fsync off.

    On the machine's server their files were fsynced, one device flush each,
    by the checkpoint that every DROP DATABASE forces: a teardown once waited
    246 s for it (2026-12-05; pytest's timeout is 300). A private server is
    thrown away whole, and its checkpoints sync nothing.
    """
    with private_postgres("conveyor-mtt-many-") as url:
        _admin(url, sql.SQL("ALTER SYSTEM SET fsync = off"))
        _admin(url, sql.SQL("SELECT pg_reload_conf()"))
        yield url


@pytest.fixture(scope="module")
def many(many_server: str) -> dict[str, str]:
    """TENANTS databases cloned from a migrated template, on many_server."""
    return _tenants_on(many_server, "mtt", TENANTS)[0]


def _each(urls: dict[str, str], work: Callable[[str, str], Any]) -> dict[str, Any]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(urls, pool.map(work, urls, urls.values()), strict=True))


def _empty(urls: dict[str, str]) -> None:
    def empty(_name: str, url: str) -> None:
        with psycopg.connect(url, autocommit=True, application_name=APPLICATION) as conn:
            conn.execute("TRUNCATE conveyor.events")
    _each(urls, empty)


def _enqueue(urls: dict[str, str], n: int) -> dict[str, tuple[list[int], float]]:
    """``n`` events in each tenant's database; each tenant's ids and commit time."""
    def enqueue(name: str, url: str) -> tuple[list[int], float]:
        with psycopg.connect(url, application_name=APPLICATION) as conn:
            ids = [Producer().enqueue(conn, "job.run", {"tenant": name}, tenant=name)
                   for _ in range(n)]
            conn.commit()
            return [i for i in ids if i is not None], time.monotonic()
    return _each(urls, enqueue)


class Done:
    """What the handlers ran: (tenant, event id) -> monotonic time, and every run in order."""

    def __init__(self) -> None:
        self.at: dict[tuple[str, int], float] = {}
        self.runs: list[tuple[str, int]] = []

    def router(self, *, slow: str | None = None) -> Router:
        async def handle(event: Event) -> None:
            tenant = current_tenant()
            assert tenant is not None and event.tenant == tenant.name == event.payload["tenant"]
            if tenant.name == slow:
                await asyncio.sleep(0.01)     # a backlog that lasts the measurement
            self.runs.append((tenant.name, event.id))
            self.at[tenant.name, event.id] = time.monotonic()
        router = Router()
        router.add("job.*", handle)
        return router

    def count(self, tenant: str | None = None) -> int:
        return sum(1 for name, _ in self.runs if tenant is None or name == tenant)


class Sampler:
    """The worker's connections to some databases, counted in pg_stat_activity every 10 ms."""

    def __init__(self, server_url: str, databases: list[str]) -> None:
        self.server_url = server_url
        self.databases = databases
        self.samples: list[int] = []

    async def run(self, stop: asyncio.Event) -> None:
        async with await psycopg.AsyncConnection.connect(
                self.server_url, autocommit=True, application_name=APPLICATION) as conn:
            while not stop.is_set():
                row = await (await conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = ANY(%s) "
                    "AND application_name LIKE 'conveyor-%%'", (self.databases,))).fetchone()
                self.samples.append(int(row[0]) if row else 0)
                await asyncio.sleep(0.01)

    @property
    def most(self) -> int:
        return max(self.samples, default=0)


@asynccontextmanager
async def sampling(*samplers: Sampler) -> AsyncIterator[None]:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(s.run(stop)) for s in samplers]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)


def _dbnames(urls: dict[str, str]) -> list[str]:
    return [str(conninfo_to_dict(url)["dbname"]) for url in urls.values()]


def _config(**overrides: Any) -> MultiTenantConfig:
    worker = WorkerConfig(concurrency=5, poll_interval=POLL, query_timeout=5.0, **RECONNECT)
    return MultiTenantConfig(worker=worker, rescan_interval=60, **overrides)


def _tenants(urls: dict[str, str]) -> list[TenantDatabase]:
    return [TenantDatabase(name, url) for name, url in urls.items()]


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


# serial: 200 databases and a worker serving them load the machine's CPU and its
# server's connections; the budget is asserted against pg_stat_activity.
@pytest.mark.serial
@pytest.mark.slow
async def test_200_tenant_databases_are_served_within_40_connections(
        many: dict[str, str], many_server: str) -> None:
    _empty(many)
    first = _enqueue(many, 2)
    done = Done()
    worker = MultiTenantWorker(_tenants(many), done.router(), _config(connections_per_server=BUDGET))
    sampler = Sampler(many_server, _dbnames(many))
    async with sampling(sampler), running(worker):
        await wait_until(lambda: _ran(done, 2 * TENANTS), timeout=45, what="the first 400 events")
        # Every tenant parked by now or soon: the next events wake them by their due checks.
        second = await asyncio.to_thread(_enqueue, many, 1)
        await wait_until(lambda: _ran(done, 3 * TENANTS), timeout=45, what="the next 200 events")
        (server,) = worker.servers.values()
        stats, peak = server.stats, server.ledger.peak
    print(f"\n{TENANTS} tenants, budget {BUDGET}: at most {sampler.most} connections seen in "
          f"{len(sampler.samples)} samples; the turns' ledger peaked at {peak} (+ "
          f"{server.plan.wake} wake); {stats.turns} turns, longest {stats.longest_turn:.2f}s; "
          f"{stats.checks} due checks, longest {stats.longest_check:.3f}s")
    assert 0 < sampler.most <= BUDGET, sampler.most
    assert peak + server.plan.wake <= BUDGET
    assert not server.plan.listen                 # 200 LISTENs would not fit in 40
    expected = {(name, i) for name, (ids, _) in first.items() for i in ids}
    expected |= {(name, i) for name, (ids, _) in second.items() for i in ids}
    assert len(done.runs) == len(set(done.runs)) == len(expected) == 3 * TENANTS
    assert set(done.runs) == expected
    # Each tenant's first turn made its history's days (0025): its successes
    # are in today's, none left live (a turn is too short for a prune pass).
    where = _each(many, _partitions)
    assert {name: parts for name, parts in where.items()
            if parts != {"conveyor.events_done_" + time.strftime("%Y%m%d", time.gmtime())}
            } == {}


def _partitions(_name: str, url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True, application_name=APPLICATION) as conn:
        return {str(r[0]) for r in conn.execute(
            "SELECT DISTINCT tableoid::regclass::text FROM conveyor.events"
            " WHERE state = 'succeeded'")}


async def _ran(done: Done, n: int) -> bool:
    return len(done.runs) >= n


# serial: as above, and it measures waits.
@pytest.mark.serial
@pytest.mark.slow
async def test_a_backlog_takes_bounded_turns_while_199_single_events_wait_within_the_bound(
        many: dict[str, str], many_server: str) -> None:
    _empty(many)
    busy = "mtt000"
    with psycopg.connect(many[busy], autocommit=True, application_name=APPLICATION) as conn:
        conn.execute("INSERT INTO conveyor.events (tenant, topic, payload) "
                     "SELECT %s, 'job.run', jsonb_build_object('tenant', %s::text) "
                     "FROM generate_series(1, 20000)", (busy, busy))
    others = {name: url for name, url in many.items() if name != busy}
    done = Done()
    turn_length = 1.0
    worker = MultiTenantWorker(_tenants(many), done.router(slow=busy),
                               _config(connections_per_server=BUDGET, turn_length=turn_length))
    sampler = Sampler(many_server, _dbnames(many))
    async with sampling(sampler), running(worker):
        (server,) = worker.servers.values()

        async def settled() -> bool:
            # Every tenant has had its first turn and nobody waits: the backlog works,
            # a few idle tenants keep their turn (nobody needs the room), the rest are parked.
            return (done.count(busy) >= 200 and not server.rotation
                    and all(s.turns >= 1 for s in worker.tenants.values()))
        await wait_until(settled, timeout=45, what="the first turns to end")
        busy_turns_before = worker.tenants[busy].turns
        sent = await asyncio.to_thread(_enqueue, others, 1)
        await wait_until(lambda: _ran(done, done.count(busy) + len(others)), timeout=45,
                         what="the 199 single events")
        busy_turns = worker.tenants[busy].turns - busy_turns_before
        found = {name: worker.tenants[name].found_due_at for name in others}
        began = {name: worker.tenants[name].started_at for name in others}
        stats, slots, backlog_ran = server.stats, server.plan.turn_slots, done.count(busy)
        wake = server.plan.wake
    waits = {name: done.at[name, ids[0]] - committed for name, (ids, committed) in sent.items()}
    worst, p99 = max(waits.values()), _percentile(list(waits.values()), 0.99)
    median = _percentile(list(waits.values()), 0.5)
    # Where the waits went: to being found due (the due checks' sweep), and in the rotation.
    # (A tenant still holding its idle turn when its event came was never parked.)
    parked = [name for name, (_, committed) in sent.items() if found[name] >= committed]
    detected = [found[name] - sent[name][1] for name in parked] or [0.0]
    queued = [began[name] - found[name] for name in parked] or [0.0]
    # The bound (docs/multitenant.md): found due within a poll interval plus a sweep of
    # due checks (every tenant's, plan.wake at a time); then behind at most N - 1
    # others in the rotation, `slots` turns at a time, each going on at most
    # `longest_held` while someone waits; then its own turn. The turns' and checks'
    # lengths are this machine's, measured; the rotation's discipline is what is tested.
    n = len(many)
    detect = POLL + math.ceil(n / wake) * stats.longest_check
    bound = detect + (math.ceil((n - 1) / slots) + 1) * stats.longest_held
    print(f"\nfairness: {n} tenants, {slots} turns at a time in {BUDGET} connections; a "
          f"20,000-event backlog in {busy} ({backlog_ran} ran, in {busy_turns} more turns of "
          f"{turn_length:g}s at most while others waited); the 199 single events waited "
          f"median {median:.2f}s, p99 {p99:.2f}s, max {worst:.2f}s; bound {bound:.1f}s (longest "
          f"turn while others waited {stats.longest_held:.2f}s; longest start "
          f"{stats.longest_start:.2f}s; longest due check {stats.longest_check:.3f}s); the "
          f"{len(parked)} parked ones found due after median {_percentile(detected, 0.5):.2f}s, "
          f"max {max(detected):.2f}s; then in the rotation median "
          f"{_percentile(queued, 0.5):.2f}s, max {max(queued):.2f}s; "
          f"at most {sampler.most} connections")
    assert backlog_ran < 20_000, "the backlog drained: the measurement measured nothing"
    assert worst <= bound, waits
    assert busy_turns >= 2, "the backlog's turn never ended while others waited"
    # A busy turn ends after turn_length once others wait, then stops gracefully.
    assert stats.longest_held < turn_length + 5.0
    assert sampler.most <= BUDGET


class PrivateServer:
    """This test's own embedded PostgreSQL, stopped and started with pg_ctl."""

    def __init__(self) -> None:
        self.base = tempfile.mkdtemp(prefix="conveyor-mtt-")
        os.chmod(self.base, 0o755)
        self.embedded = EmbeddedPostgres(Path(self.base) / "pg18")
        self.url = self.embedded.start()
        from acceptance.test_server_restart import PrivateServer as Control

        self.control = Control(self.url, self.embedded.data_dir)

    def close(self) -> None:
        try:
            self.embedded.stop()
        finally:
            self.control.kill()
            shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def private_server() -> Iterator[PrivateServer]:
    server = PrivateServer()
    try:
        yield server
    finally:
        server.close()


def _tenants_on(server_url: str, prefix: str, n: int) -> tuple[dict[str, str], list[str]]:
    template = f"{prefix}_tpl"
    _admin(server_url, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(template)))
    with psycopg.connect(make_conninfo(server_url, dbname=template), autocommit=True) as conn:
        Migrator().apply(conn)
    names = [f"{prefix}_{i:03d}" for i in range(n)]
    _create_many(server_url, template, names)
    return ({f"{prefix}{i:03d}": make_conninfo(server_url, dbname=name)
             for i, name in enumerate(names)}, [template, *names])


# light: stops and starts its private server, and bounds the other server's
# tenants' waits loosely meanwhile.
@pytest.mark.light
@pytest.mark.slow
async def test_two_servers_each_within_its_budget_and_one_stopping_stalls_only_its_own(
        server_url: str, private_server: PrivateServer) -> None:
    per_server, budget = 30, 12
    tag = os.urandom(3).hex()
    main, main_dbs = _tenants_on(server_url, f"mtta{tag}", per_server)
    try:
        private, _ = _tenants_on(private_server.url, f"mttb{tag}", per_server)
        done = Done()
        worker = MultiTenantWorker(_tenants({**main, **private}), done.router(),
                                   _config(connections_per_server=budget))
        samplers = [Sampler(server_url, main_dbs[1:]),
                    Sampler(private_server.url, _dbnames(private))]
        async with running(worker):
            assert len(worker.servers) == 2
            async with sampling(*samplers):
                first = await asyncio.to_thread(_enqueue, {**main, **private}, 1)
                await wait_until(lambda: _ran(done, 2 * per_server), timeout=40,
                                 what="both servers' first events")
            await asyncio.to_thread(private_server.control.stop_fast)
            rounds: list[float] = []
            async with sampling(samplers[0]):
                for round_ in range(1, 3):     # the main server's tenants, while the other is down
                    sent = await asyncio.to_thread(_enqueue, main, 1)
                    began = min(t for _, t in sent.values())
                    await wait_until(
                        lambda n=2 * per_server + round_ * per_server: _ran(done, n),
                        timeout=30, what="the main server's events while the other is down")
                    rounds.append(time.monotonic() - began)
                    assert rounds[-1] < 20.0, rounds
            await asyncio.to_thread(private_server.control.start)
            back = await asyncio.to_thread(_enqueue, private, 1)
            resumed = await wait_until(lambda: _ran(done, 5 * per_server), timeout=45,
                                       what="the private server's tenants once it is back")
    finally:
        _drop_many(server_url, main_dbs)
    print(f"\ntwo servers, {per_server} tenants and {budget} connections each: at most "
          f"{samplers[0].most} and {samplers[1].most} connections seen; with the private one "
          f"down, the main one's {per_server} events ran within "
          f"{', '.join(f'{r:.1f}s' for r in rounds)}; the private one's, "
          f"{resumed:.1f}s after it was back")
    assert samplers[0].most <= budget and samplers[1].most <= budget
    assert samplers[1].most > 0
    expected = {(n, i) for sent_ in (first, back) for n, (ids, _) in sent_.items() for i in ids}
    assert expected <= set(done.runs)
    assert len(done.runs) == len(set(done.runs))


async def test_parked_tenants_listening_are_woken_by_their_notify_not_by_polling(
        server_url: str, template_db: str, caplog: pytest.LogCaptureFixture) -> None:
    # 8 connections, 3 tenants: two wake connections, three LISTENs and one turn at a
    # time. The poll interval is a minute, so only a NOTIFY can wake a parked tenant.
    caplog.set_level(logging.INFO, logger="conveyor.worker.worker")
    names = [f"conveyor_mtl_{os.urandom(4).hex()}_{i}" for i in range(3)]
    try:
        _create_many(server_url, template_db, names)
        urls = {f"l{i}": make_conninfo(server_url, dbname=name) for i, name in enumerate(names)}
        done = Done()
        config = MultiTenantConfig(
            worker=WorkerConfig(concurrency=2, poll_interval=60.0, query_timeout=5.0, **RECONNECT),
            rescan_interval=60, connections_per_server=8)
        worker = MultiTenantWorker(_tenants(urls), done.router(), config)
        sampler = Sampler(server_url, names)
        async with sampling(sampler), running(worker):
            (server,) = worker.servers.values()
            assert (server.plan.listen, server.plan.turn_slots) == (True, 1)
            await wait_until(lambda: _first_turns_over(worker), timeout=30,
                             what="every tenant's first turn")
            for round_ in range(1, 3):
                sent = await asyncio.to_thread(_enqueue, urls, 1)
                began = min(t for _, t in sent.values())
                await wait_until(lambda n=3 * round_: _ran(done, n), timeout=30,
                                 what="the events of the parked tenants")
                assert time.monotonic() - began < 20.0      # far below the 60 s poll
            turns = sum(s.turns for s in worker.tenants.values())
            # Each tenant's counters run on across its turns, parked or not: 2 claimed each.
            claimed = {
                s.labels["tenant"]: s.value
                for family in TenantsCollector(worker, {}).collect()
                for s in family.samples if s.name == "conveyor_worker_claimed_events_total"}
            assert claimed == {name: 2 for name in urls}, claimed
        # A worker's start and stop lines come once per tenant, not once per turn.
        assert turns > len(urls), turns
        lines = Counter(getattr(r, "action", None) for r in caplog.records
                        if r.name == "conveyor.worker.worker" and r.levelno >= logging.INFO)
        assert all(lines[a] <= len(urls) for a in ("started", "stopping", "stopped")), lines
        assert sampler.most <= 8, sampler.most
        assert len(done.runs) == len(set(done.runs)) == 6
        assert {name for name, _ in done.runs} == set(urls)
    finally:
        _drop_many(server_url, names)


async def _first_turns_over(worker: MultiTenantWorker) -> bool:
    states = worker.tenants.values()
    return all(s.turns >= 1 for s in states) and sum(s.running for s in states) <= 1


async def test_switching_to_listen_when_tenants_go_shrinks_the_turns_first(
        server_url: str, template_db: str, tmp_path: Path) -> None:
    # 8 connections: 4 tenants are polled (2 turns of 3); once one goes, the other 3
    # fit a LISTEN each and 1 turn. The busy turns end before the LISTENs connect.
    names = [f"conveyor_mts_{os.urandom(4).hex()}_{i}" for i in range(4)]
    try:
        _create_many(server_url, template_db, names)
        urls = {f"s{i}": make_conninfo(server_url, dbname=name) for i, name in enumerate(names)}
        for name, url in urls.items():
            (tmp_path / f"{name}.dsn").write_text(url + "\n")
        await asyncio.to_thread(_enqueue, urls, 30)
        done = Done()
        router = Router()

        async def slow(event: Event) -> None:
            await asyncio.sleep(0.05)
            await done.router().routes[0].handler(event)
        router.add("job.*", slow)
        config = MultiTenantConfig(
            worker=WorkerConfig(concurrency=2, poll_interval=0.5, query_timeout=5.0, **RECONNECT),
            rescan_interval=0.2, connections_per_server=8, turn_length=0.5)
        worker = MultiTenantWorker(DirectoryTenants(tmp_path), router, config)
        sampler = Sampler(server_url, names)
        async with sampling(sampler), running(worker):
            (server,) = worker.servers.values()
            assert not server.plan.listen
            await wait_until(lambda: _ran(done, 20), timeout=30, what="the turns to be busy")
            (tmp_path / "s3.dsn").unlink()
            await wait_until(lambda: _listening(server, 3), timeout=30, what="three LISTENs")
            await wait_until(lambda: _ran_of(done, ("s0", "s1", "s2"), 90), timeout=60,
                             what="the other tenants' events")
        assert sampler.most <= 8, sampler.most
        assert {n for n, _ in done.runs} >= {"s0", "s1", "s2"}
        assert len(done.runs) == len(set(done.runs))
    finally:
        _drop_many(server_url, names)


async def _listening(server: Any, n: int) -> bool:
    return server.plan.listen and server.listening == n


async def _ran_of(done: Done, tenants: tuple[str, ...], n: int) -> bool:
    return sum(done.count(t) for t in tenants) >= n
