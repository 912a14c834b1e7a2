"""One worker process serving many tenant databases, fairly.

Some applications keep one database per tenant, each with its own Conveyor
schema. :class:`MultiTenantWorker` serves all of them from one process:

* the tenants come from a list of DSNs (:class:`StaticTenants`) or a directory
  of ``<tenant>.dsn`` files (:class:`DirectoryTenants`) re-scanned every
  ``rescan_interval`` seconds, so tenants are added, removed or re-pointed
  while it runs;
* each tenant database gets its schema ensured (migrated) when it is added;
* each tenant gets its own :class:`~conveyor.worker.Worker`: its own LISTEN
  connection, claim loop and ``concurrency`` slots. That is the fairness
  argument: a tenant with a million pending events can fill only its own
  slots, and every other tenant's NOTIFY wakes that tenant's own claim loop,
  so one event elsewhere starts within milliseconds while the backlog drains
  (``tests/workflow/test_multitenant.py`` measures it);
* nothing crosses tenants: a handler runs only for events of its tenant's
  database, sees that tenant through :func:`current_tenant`, and an event whose
  ``tenant`` column names another tenant is parked ``failed``, never run.

Each tenant costs four database connections (listen, claim, acknowledge,
maintenance), so mind ``max_connections`` past a few dozen tenants.

Example::

    worker = MultiTenantWorker(DirectoryTenants("/etc/conveyor/tenants"), build_router,
                               MultiTenantConfig(worker=WorkerConfig(concurrency=10)))
    asyncio.run(worker.run())          # until worker.request_stop()

``build_router`` is a :class:`~conveyor.router.Router` shared by every tenant, or a
function ``(TenantDatabase) -> Router`` for handlers that need the tenant's DSN.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import inspect
import logging
import os
import re
import signal
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from psycopg.conninfo import conninfo_to_dict

from conveyor.config import WorkerConfig
from conveyor.db.connect import UNPARSEABLE, connect_async, describe
from conveyor.errors import ConfigError, ConveyorError
from conveyor.middleware import Middleware
from conveyor.outcomes import PermanentFailure
from conveyor.router import Route, Router
from conveyor.schema.migrator import AsyncMigrator
from conveyor.types import Event
from conveyor.worker import Worker

log = logging.getLogger(__name__)

RESCAN_INTERVAL_DEFAULT = 5.0
TENANT_CONCURRENCY_DEFAULT = 10
DSN_SUFFIX = ".dsn"
_TENANT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
_CURRENT: contextvars.ContextVar[TenantDatabase | None] = contextvars.ContextVar(
    "conveyor_current_tenant", default=None)


def _check_tenant_name(name: str) -> str:
    if not _TENANT_NAME_RE.fullmatch(name):
        raise ConfigError(f"invalid tenant name {name!r}: expected 1-63 letters, digits, "
                          "'-' or '_'")
    return name


@dataclass(frozen=True, slots=True)
class TenantDatabase:
    """One tenant and its database.

    Attributes:
        name: the tenant, e.g. ``"acme"``.
        conninfo: libpq URL or conninfo of its database (never logged).
    """

    name: str
    conninfo: str = field(repr=False)

    def __post_init__(self) -> None:
        _check_tenant_name(self.name)
        if not self.conninfo.strip():
            raise ConfigError(f"tenant {self.name!r} has an empty database url")

    @classmethod
    def parse(cls, spec: str) -> TenantDatabase:
        """``"acme=postgresql://..."``, or a bare URL whose database name is the tenant.

        Example::

            TenantDatabase.parse("acme=postgresql://app@db/acme").name      # "acme"
            TenantDatabase.parse("postgresql://app@db/globex").name         # "globex"
        """
        name, sep, url = spec.partition("=")
        if sep and _TENANT_NAME_RE.fullmatch(name) and _parses(url):
            return cls(name, url)
        # The spec is never quoted: what fails to parse is often the password. An
        # ambiguous URL "parses", but its database name may be a piece of it too.
        if describe(spec) == UNPARSEABLE:
            raise ConfigError("cannot parse a tenant database (could not parse it; check quoting "
                              "and percent-encoding): expected 'TENANT=URL' or a URL naming "
                              "its database")
        dbname = conninfo_to_dict(spec).get("dbname")
        if not dbname:
            raise ConfigError(f"tenant database {describe(spec)!r} names no database; "
                              "write it as 'TENANT=URL'")
        return cls(str(dbname), spec)


def _parses(conninfo: str) -> bool:
    if "://" in conninfo:
        return True
    try:
        return bool(conninfo.strip()) and bool(conninfo_to_dict(conninfo))
    except Exception:  # noqa: BLE001 - psycopg raises several kinds for bad conninfo
        return False


def current_tenant() -> TenantDatabase | None:
    """The tenant whose event the calling handler is running, or ``None`` outside one."""
    return _CURRENT.get()


class TenantSource(Protocol):
    """Where the tenants come from; ``scan`` is called at start-up and every rescan."""

    def scan(self) -> dict[str, TenantDatabase]: ...


class StaticTenants:
    """A fixed list of tenant databases (``TenantDatabase`` or ``"TENANT=URL"`` strings)."""

    def __init__(self, tenants: Iterable[TenantDatabase | str]) -> None:
        self._tenants: dict[str, TenantDatabase] = {}
        for item in tenants:
            tenant = item if isinstance(item, TenantDatabase) else TenantDatabase.parse(item)
            if tenant.name in self._tenants:
                raise ConfigError(f"tenant {tenant.name!r} is listed twice")
            self._tenants[tenant.name] = tenant

    def scan(self) -> dict[str, TenantDatabase]:
        return dict(self._tenants)


class DirectoryTenants:
    """Every ``<tenant>.dsn`` file in ``path``: the file's first non-comment line is the URL.

    Files are read at every scan, so adding, deleting or editing one adds, removes
    or re-points that tenant. Unreadable or malformed files are skipped with a
    warning; they never stop the other tenants.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def scan(self) -> dict[str, TenantDatabase]:
        if not self.path.is_dir():
            raise ConfigError(f"tenants directory {str(self.path)!r} does not exist")
        found: dict[str, TenantDatabase] = {}
        for entry in sorted(self.path.glob(f"*{DSN_SUFFIX}")):
            try:
                lines = entry.read_text("utf-8").splitlines()
                url = next((s.strip() for s in lines if s.strip() and not s.startswith("#")), "")
                found[entry.stem] = TenantDatabase(entry.stem, url)
            except (OSError, UnicodeDecodeError, ConfigError) as exc:
                log.warning("skipping tenant file %s: %s", entry.name, exc,
                            extra={"action": "tenant_file_skipped"})
        return found


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


RouterFactory = Callable[[TenantDatabase], Router]


def _guard(tenant: TenantDatabase, event: Event) -> None:
    if event.tenant is not None and event.tenant != tenant.name:
        raise PermanentFailure(f"event {event.id} belongs to tenant {event.tenant!r} but is in "
                               f"the database of tenant {tenant.name!r}; not run")


def _guarded(tenant: TenantDatabase, route: Route) -> Callable[[Event], Any]:
    """The route's handler, refusing other tenants' events and exposing current_tenant()."""
    inner: Callable[[Event], Any] = route.handler
    if route.is_async:
        async def run_async(event: Event) -> Any:
            _guard(tenant, event)
            token = _CURRENT.set(tenant)
            try:
                return await inner(event)
            finally:
                _CURRENT.reset(token)
        return run_async

    def run_sync(event: Event) -> Any:
        _guard(tenant, event)
        token = _CURRENT.set(tenant)
        try:
            return inner(event)
        finally:
            _CURRENT.reset(token)
    return run_sync


def tenant_router(tenant: TenantDatabase, app: Router | RouterFactory) -> Router:
    """The router one tenant's worker runs: ``app``'s routes behind the tenant guard."""
    source = app if isinstance(app, Router) else app(tenant)
    if not isinstance(source, Router):
        raise ConfigError(f"router factory returned {type(source).__name__} for tenant "
                          f"{tenant.name!r}, not a Router")
    router = Router()
    for route in source.routes:
        router.add(route.pattern, _guarded(tenant, route), timeout=route.timeout,
                   blocking=route.blocking, backoff=route.backoff)
    return router


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
        self.source = _as_source(tenants)
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

    # ----------------------------------------------------------------- control

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

    # ---------------------------------------------------------------- tenants

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

    # ----------------------------------------------------------- for tests/ops

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


def _as_source(tenants: TenantSource | Iterable[TenantDatabase | str]) -> TenantSource:
    if callable(getattr(tenants, "scan", None)):
        return cast(TenantSource, tenants)
    return StaticTenants(cast(Iterable[TenantDatabase | str], tenants))


def load_app(target: object) -> Router | RouterFactory:
    """Accept a Router, a zero-argument function returning one, or a tenant router factory."""
    if isinstance(target, Router):
        return target
    if callable(target):
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):
            params = None
        if not params:
            made = target()
            if isinstance(made, Router):
                return made
            raise ConfigError(f"{target!r:.60} returned {type(made).__name__}, not a Router")
        factory = cast(RouterFactory, target)
        return factory
    raise ConfigError(f"expected a Router or a function returning one, got {type(target).__name__}")
