"""The supervisor: one :class:`~conveyor.worker.Worker` per tenant database, in one process.

:class:`MultiTenantWorker` scans its tenant source at start and every
``rescan_interval``, starts a worker for each new tenant (migrating its
database first), stops the worker of each removed or re-pointed one, and
restarts, at the next scan, one that failed to start or died. Each worker
runs :func:`~conveyor.tenancy.isolation.tenant_router` of the app. Kept apart
from what a tenant is and from the isolation guard: this is the only part
that holds tasks, connections and signals.
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
from conveyor.errors import ConfigError, ConveyorError
from conveyor.middleware import Middleware
from conveyor.router import Router
from conveyor.schema.migrator import AsyncMigrator
from conveyor.tenancy.databases import TenantDatabase, TenantSource, as_source
from conveyor.tenancy.isolation import RouterFactory, tenant_router
from conveyor.worker import Worker

log = logging.getLogger(__name__)

RESCAN_INTERVAL_DEFAULT = 5.0
TENANT_CONCURRENCY_DEFAULT = 10


@dataclass(frozen=True, kw_only=True, slots=True)
class MultiTenantConfig:
    """How a multi-tenant worker runs.

    Attributes:
        worker: the configuration every tenant's worker gets (its ``name`` gains
            ``"/<tenant>"``). Defaults to ``WorkerConfig(concurrency=10)``.
        rescan_interval: seconds between scans of the tenant source. Defaults to 5.0.
        ensure_schema: migrate each tenant database when it is added. Defaults to ``True``.
    """

    worker: WorkerConfig = field(
        default_factory=lambda: WorkerConfig(concurrency=TENANT_CONCURRENCY_DEFAULT))
    rescan_interval: float = RESCAN_INTERVAL_DEFAULT
    ensure_schema: bool = True

    def __post_init__(self) -> None:
        if not self.rescan_interval > 0:
            raise ConfigError(f"expected rescan_interval to be > 0, got {self.rescan_interval!r}")


@dataclass(slots=True)
class TenantState:
    """One tenant as the multi-tenant worker sees it.

    Attributes:
        tenant: the tenant and its database.
        worker: its worker, once started.
        error: why it is not running, or ``None``.
    """

    tenant: TenantDatabase
    worker: Worker | None = None
    task: asyncio.Task[None] | None = None
    error: str | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()


@dataclass(frozen=True, slots=True)
class TenantChanges:
    """What one :meth:`MultiTenantWorker.sync` did, by tenant name."""

    added: list[str]
    removed: list[str]
    failed: list[str]


class MultiTenantWorker:
    """Serves every tenant of ``tenants`` with its own worker, in this process.

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
        self._stopping = asyncio.Event()
        self._sync_lock = asyncio.Lock()
        self._warned_empty = False
        self.started = asyncio.Event()

    @property
    def tenants(self) -> dict[str, TenantState]:
        return dict(self._states)

    def request_stop(self) -> None:
        """Stop every tenant's worker gracefully, then return from :meth:`run`."""
        self._stopping.set()

    def install_signal_handlers(self) -> None:
        """Stop gracefully on SIGTERM and SIGINT (call from inside the running loop)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def run(self) -> None:
        """Start every tenant, follow the tenant source, stop all on :meth:`request_stop`."""
        await self._scan_or_raise()
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
        """Compare the source with the running tenants: start new ones, stop removed ones.

        A tenant that could not start (database unreachable, migration failed) or
        whose worker died is retried at the next sync.
        """
        async with self._sync_lock:
            try:
                wanted = await self._scan_or_raise()
            except (ConveyorError, OSError) as exc:
                log.error("scanning tenants failed, keeping the current ones: %s", exc,
                          extra={"action": "tenant_scan_failed"})
                return TenantChanges([], [], [])
            self._note_emptiness(wanted)
            removed = [name for name, state in self._states.items()
                       if wanted.get(name) != state.tenant or not state.running]
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

    def _worker(self, tenant: TenantDatabase) -> Worker:
        config = dataclasses.replace(self.config.worker, name=f"{self._base_name}/{tenant.name}")
        return Worker(tenant.conninfo, tenant_router(tenant, self.app), config,
                      middleware=self.middleware)

    async def _prepare(self, tenant: TenantDatabase) -> TenantState | None:
        try:
            if self.config.ensure_schema:
                await self.ensure_schema(tenant)
            return TenantState(tenant, self._worker(tenant))
        except (ConveyorError, OSError) as exc:
            log.error("tenant %s (%s) not started: %s", tenant.name, describe(tenant.conninfo),
                      exc, extra={"action": "tenant_start_failed", "tenant": tenant.name})
            return None

    async def _start(self, tenant: TenantDatabase) -> bool:
        state = await self._prepare(tenant)
        if state is None or state.worker is None:
            return False
        state.task = asyncio.create_task(self._serve(state), name=f"conveyor-tenant-{tenant.name}")
        self._states[tenant.name] = state
        return True

    async def _serve(self, state: TenantState) -> None:
        assert state.worker is not None
        try:
            await state.worker.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one tenant's crash must not stop the others
            state.error = f"{type(exc).__name__}: {exc}"
            log.error("worker of tenant %s stopped: %s; restarting at the next scan",
                      state.tenant.name, state.error,
                      extra={"action": "tenant_worker_died", "tenant": state.tenant.name})

    async def _stop(self, name: str) -> None:
        state = self._states.pop(name, None)
        if state is None:
            return
        if state.worker is not None:
            state.worker.request_stop()
        if state.task is not None:
            await asyncio.gather(state.task, return_exceptions=True)
        elif state.worker is not None:
            await state.worker.close()

    async def _stop_all(self) -> None:
        await asyncio.gather(*(self._stop(name) for name in list(self._states)))

    async def run_once(self) -> dict[str, int]:
        """Ensure every tenant, claim and run one batch for each; events run per tenant.

        Deterministic single step for tests; it starts no background loops.
        """
        wanted = await self._scan_or_raise()
        for name in [n for n in self._states if n not in wanted]:
            await self._stop(name)
        for name, tenant in wanted.items():
            if name not in self._states:
                state = await self._prepare(tenant)
                if state is not None:
                    self._states[name] = state
        runs: list[Awaitable[int]] = [s.worker.run_once() for s in self._states.values()
                                      if s.worker is not None and s.task is None]
        counts = await asyncio.gather(*runs)
        names = [n for n, s in self._states.items() if s.worker is not None and s.task is None]
        return dict(zip(names, counts, strict=True))

    async def close(self) -> None:
        """Release what :meth:`run_once` opened."""
        await self._stop_all()

