"""The supervisor: every tenant database served from one process, within a connection budget.

:class:`MultiTenantWorker` scans its tenant source at start and every
``rescan_interval``, adds each new tenant (migrating its database first),
removes each removed or re-pointed one, and retries, at the next scan, one
that failed to start. Tenants are grouped by the server their database lives
on, and each server's are served by one
:class:`~conveyor.tenancy.turns.ServerTurns`: a worker runs for a tenant only
during its turn, and a server never holds more than
``connections_per_server`` of this process's connections (the reasons are in
:mod:`conveyor.tenancy.turns`). Each worker runs
:func:`~conveyor.tenancy.isolation.tenant_router` of the app. Kept apart from
what a tenant is and from the isolation guard: this is the only part that
holds the servers' tasks and signals.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field

from conveyor.config import WorkerConfig
from conveyor.db.connect import connect_async, describe
from conveyor.db.named_queries import queries_for
from conveyor.errors import ConfigError, ConveyorError
from conveyor.middleware import Middleware
from conveyor.router import Router
from conveyor.schema.migrator import AsyncMigrator
from conveyor.tenancy.budget import MIN_CONNECTIONS, server_of
from conveyor.tenancy.databases import TenantDatabase, TenantSource, as_source
from conveyor.tenancy.isolation import RouterFactory, tenant_router
from conveyor.tenancy.tenant import TenantState
from conveyor.tenancy.turns import ServerTurns
from conveyor.worker import Worker
from conveyor.worker.connection import ConnectionGate

log = logging.getLogger(__name__)

RESCAN_INTERVAL_DEFAULT = 5.0
TENANT_CONCURRENCY_DEFAULT = 10
# Half of PostgreSQL's default max_connections (100): the rest is the application's.
CONNECTIONS_PER_SERVER_DEFAULT = 50
TURN_LENGTH_DEFAULT = 5.0
# PostgreSQL's own ceiling of max_connections: a larger budget is a typo.
MAX_CONNECTIONS = 262_143
TURN_LENGTH_RANGE = (0.01, 86_400.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class MultiTenantConfig:
    """How a multi-tenant worker runs.

    Attributes:
        worker: the configuration every tenant's worker gets (its ``name`` gains
            ``"/<tenant>"``). Defaults to ``WorkerConfig(concurrency=10)``.
        rescan_interval: seconds between scans of the tenant source. Defaults to 5.0.
        ensure_schema: migrate each tenant database when it is added. Defaults to ``True``.
        connections_per_server: the most connections this process holds on one database
            server, all its tenant databases together: each running tenant's worker
            holds 3 (4 with cron schedules; one more while a flow limit exists or the
            event loop is blocked, if there is room), each LISTEN connection 1, and 2
            wake parked tenants. Tenants with nothing to do give their connections up when
            another tenant needs them (docs/multitenant.md). 8 to 262143. Defaults to 50.
        turn_length: seconds a tenant with work keeps its worker while other tenants of
            its server wait for room; then it queues again behind them. 0.01 to 86400.
            Defaults to 5.0.
    """

    worker: WorkerConfig = field(
        default_factory=lambda: WorkerConfig(concurrency=TENANT_CONCURRENCY_DEFAULT))
    rescan_interval: float = RESCAN_INTERVAL_DEFAULT
    ensure_schema: bool = True
    connections_per_server: int = CONNECTIONS_PER_SERVER_DEFAULT
    turn_length: float = TURN_LENGTH_DEFAULT

    def __post_init__(self) -> None:
        if not self.rescan_interval > 0:
            raise ConfigError(f"expected rescan_interval to be > 0, got {self.rescan_interval!r}")
        budget = self.connections_per_server
        if (isinstance(budget, bool) or not isinstance(budget, int)
                or not MIN_CONNECTIONS <= budget <= MAX_CONNECTIONS):
            raise ConfigError(f"expected connections_per_server to be an integer between "
                              f"{MIN_CONNECTIONS} and {MAX_CONNECTIONS}, got {budget!r}")
        turn = self.turn_length
        if (isinstance(turn, bool) or not isinstance(turn, int | float)
                or not TURN_LENGTH_RANGE[0] <= turn <= TURN_LENGTH_RANGE[1]):
            raise ConfigError(f"expected turn_length to be between 0.01s and 1d, got {turn!r}")


@dataclass(frozen=True, slots=True)
class TenantChanges:
    """What one :meth:`MultiTenantWorker.sync` did, by tenant name."""

    added: list[str]
    removed: list[str]
    failed: list[str]


class MultiTenantWorker:
    """Serves every tenant of ``tenants`` in this process, within ``connections_per_server``.

    Args:
        tenants: a :class:`TenantSource`, or an iterable of :class:`TenantDatabase`
            or ``"TENANT=URL"`` strings.
        app: one :class:`~conveyor.router.Router` for every tenant, or a function
            building a tenant's router from its :class:`TenantDatabase`.
        config: tuning. Defaults to ``MultiTenantConfig()``.
        middleware: hooks around every handler call of every tenant's worker
            (docs/middleware.md), in order. Defaults to none.
    """

    def __init__(self, tenants: TenantSource | Iterable[TenantDatabase | str],
                 app: Router | RouterFactory, config: MultiTenantConfig | None = None, *,
                 middleware: Sequence[Middleware] = ()) -> None:
        self.source = as_source(tenants)
        if not isinstance(app, Router) and not callable(app):
            raise ConfigError(f"app must be a Router or a function returning one, got {app!r:.60}")
        self.app = app
        self.config = config or MultiTenantConfig()
        self.middleware = tuple(middleware)
        self._base_name = self.config.worker.name or f"{socket.gethostname()}:{os.getpid()}"
        self._states: dict[str, TenantState] = {}
        self._servers: dict[str, ServerTurns] = {}
        self._server_tasks: dict[str, asyncio.Task[None]] = {}
        self._serving = False
        self._stopping = asyncio.Event()
        self._servers_stopping = asyncio.Event()
        self._sync_lock = asyncio.Lock()
        self._warned_empty = False
        self.started = asyncio.Event()

    @property
    def tenants(self) -> dict[str, TenantState]:
        return dict(self._states)

    @property
    def servers(self) -> dict[str, ServerTurns]:
        """The servers of the tenants, by ``host:port``, each with its budget and turns."""
        return dict(self._servers)

    def request_stop(self) -> None:
        """Stop every tenant's worker gracefully, then return from :meth:`run`."""
        self._stopping.set()

    def install_signal_handlers(self) -> None:
        """Stop gracefully on SIGTERM and SIGINT (call from inside the running loop)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def run(self) -> None:
        """Serve every tenant, follow the tenant source, stop all on :meth:`request_stop`."""
        await self._scan_or_raise()
        self._serving = True
        self._run_servers()
        try:
            await self.sync()
            self.started.set()
            while not self._stopping.is_set():
                try:
                    await asyncio.wait_for(self._stopping.wait(), self.config.rescan_interval)
                except TimeoutError:
                    await self.sync()
        finally:
            await self._stop_all()

    async def _scan_or_raise(self) -> dict[str, TenantDatabase]:
        return await asyncio.to_thread(self.source.scan)

    async def sync(self) -> TenantChanges:
        """Compare the source with the served tenants: add new ones, remove removed ones.

        A tenant that could not be added (database unreachable, migration failed)
        is retried at the next sync; one whose worker died gets a turn again once
        its database says it has work.
        """
        async with self._sync_lock:
            try:
                wanted = await self._scan_or_raise()
            except (ConveyorError, OSError) as exc:
                log.error("scanning tenants failed, keeping the current ones: %s", exc,
                          extra={"action": "tenant_scan_failed"})
                return TenantChanges([], [], [])
            self._note_emptiness(wanted)
            self._run_servers()
            removed = [name for name, state in self._states.items()
                       if wanted.get(name) != state.tenant]
            await asyncio.gather(*(self._stop(name) for name in removed))
            to_start = [t for name, t in wanted.items() if name not in self._states]
            results = await asyncio.gather(*(self._start(t) for t in to_start))
            added = [t.name for t, ok in zip(to_start, results, strict=True) if ok]
            failed = [t.name for t, ok in zip(to_start, results, strict=True) if not ok]
            gone = [n for n in removed if n not in wanted]
            if added or gone:
                log.info("tenants: %d serving (+%d, -%d)", len(self._states), len(added),
                         len(gone), extra={"action": "tenants_synced"})
            return TenantChanges(added, gone, failed)

    def _note_emptiness(self, wanted: dict[str, TenantDatabase]) -> None:
        """Warn once each time the source becomes empty: serving nothing must not look healthy."""
        if wanted:
            self._warned_empty = False
        elif not self._warned_empty:
            self._warned_empty = True
            log.warning("no tenant databases to serve; rescanning every %gs",
                        self.config.rescan_interval, extra={"action": "no_tenants"})

    async def ensure_schema(self, tenant: TenantDatabase) -> None:
        """Migrate one tenant database (a no-op when it is up to date)."""
        conn = await connect_async(tenant.conninfo, autocommit=True,
                                   application_name="conveyor-tenant-migrate")
        try:
            applied = await AsyncMigrator(self.config.worker.schema).apply(conn)
        finally:
            await conn.close()
        if applied:
            log.info("tenant %s: applied %d migrations", tenant.name, len(applied),
                     extra={"action": "tenant_migrated", "tenant": tenant.name})

    def _worker(self, tenant: TenantDatabase, router: Router | None = None, *,
                gate: ConnectionGate | None = None) -> Worker:
        # A turn's worker does not listen: its server's turns hold the LISTEN
        # connections and pass the NOTIFYs on.
        config = dataclasses.replace(self.config.worker, name=f"{self._base_name}/{tenant.name}",
                                     listen=gate is None and self.config.worker.listen)
        return Worker(tenant.conninfo, router or tenant_router(tenant, self.app), config,
                      middleware=self.middleware, connection_gate=gate)

    def _turn_worker(self, state: TenantState, gate: ConnectionGate) -> Worker:
        return self._worker(state.tenant, state.router, gate=gate)

    def _server(self, tenant: TenantDatabase) -> ServerTurns:
        key = server_of(tenant.conninfo)
        server = self._servers.get(key)
        if server is None:
            c = self.config
            server = self._servers[key] = ServerTurns(
                key, c.connections_per_server, queries_for(c.worker.schema),
                make_worker=self._turn_worker, turn_length=c.turn_length,
                poll_interval=c.worker.poll_interval, query_timeout=c.worker.query_timeout)
        self._run_servers()
        return server

    def _run_servers(self) -> None:
        """Start serving every server not served yet (those a sync before run() made, too)."""
        if not self._serving:
            return
        for key, server in self._servers.items():
            task = self._server_tasks.get(key)
            if task is not None and task.done() and not self._servers_stopping.is_set():
                # Not expected (a tick's errors are caught), but never silent nor final.
                log.error("serving the tenants of server %s stopped: %r; restarting", key,
                          None if task.cancelled() else task.exception(),
                          extra={"action": "tenant_server_died"})
                del self._server_tasks[key]
            if key not in self._server_tasks:
                self._server_tasks[key] = asyncio.create_task(
                    server.run(self._servers_stopping), name=f"conveyor-server-{key}")

    async def _prepare(self, tenant: TenantDatabase, server: ServerTurns | None) -> TenantState | None:
        try:
            if self.config.ensure_schema:
                if server is None:
                    await self.ensure_schema(tenant)
                else:
                    async with server.wakeups.slot():     # within the server's budget
                        await self.ensure_schema(tenant)
            return TenantState(tenant, router=tenant_router(tenant, self.app))
        except (ConveyorError, OSError) as exc:
            log.error("tenant %s (%s) not started: %s", tenant.name, describe(tenant.conninfo),
                      exc, extra={"action": "tenant_start_failed", "tenant": tenant.name})
            return None

    async def _start(self, tenant: TenantDatabase) -> bool:
        server = self._server(tenant)
        state = await self._prepare(tenant, server)
        if state is None:
            return False
        self._states[tenant.name] = state
        server.add(state)
        return True

    async def _stop(self, name: str) -> None:
        state = self._states.pop(name, None)
        if state is None:
            return
        server = self._servers.get(server_of(state.tenant.conninfo))
        if server is not None and name in server.states:
            await server.remove(name)
        elif state.worker is not None:        # run_once's worker
            await state.worker.close()

    async def _stop_all(self) -> None:
        self._servers_stopping.set()
        await asyncio.gather(*self._server_tasks.values(), return_exceptions=True)
        await asyncio.gather(*(server.close() for key, server in self._servers.items()
                               if key not in self._server_tasks))
        await asyncio.gather(*(s.worker.close() for s in self._states.values()
                               if s.worker is not None and s.task is None))
        self._states.clear()
        self._servers.clear()
        self._server_tasks.clear()

    async def run_once(self) -> dict[str, int]:
        """Ensure every tenant, claim and run one batch for each; events run per tenant.

        Deterministic single step for tests; it starts no background loops and
        keeps each tenant's worker (and its connections) until :meth:`close`.
        """
        wanted = await self._scan_or_raise()
        for name in [n for n in self._states if n not in wanted]:
            await self._stop(name)
        for name, tenant in wanted.items():
            if name not in self._states:
                state = await self._prepare(tenant, None)
                if state is not None:
                    state.worker = self._worker(tenant, state.router)
                    self._states[name] = state
        runs: list[Awaitable[int]] = [s.worker.run_once() for s in self._states.values()
                                      if s.worker is not None and s.task is None]
        counts = await asyncio.gather(*runs)
        names = [n for n, s in self._states.items() if s.worker is not None and s.task is None]
        return dict(zip(names, counts, strict=True))

    async def close(self) -> None:
        """Release what :meth:`run_once` or :meth:`sync` opened."""
        await self._stop_all()
