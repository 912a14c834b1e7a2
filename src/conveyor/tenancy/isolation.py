"""What one tenant's worker runs: the app's routes behind the tenant guard.

Every handler of a tenant's router refuses an event whose ``tenant`` column
names another tenant (it is parked ``failed``, never run) and, while it
runs, tells the handler its tenant through :func:`current_tenant`. Kept
apart from the supervisor because it is the isolation argument on its own:
whatever the supervisor does, nothing reaches a handler without passing here.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from typing import Any, cast

from conveyor.errors import ConfigError
from conveyor.outcomes import PermanentFailure
from conveyor.router import Route, Router
from conveyor.tenancy.databases import TenantDatabase
from conveyor.types import Event

RouterFactory = Callable[[TenantDatabase], Router]
_CURRENT: contextvars.ContextVar[TenantDatabase | None] = contextvars.ContextVar(
    "conveyor_current_tenant", default=None)


def current_tenant() -> TenantDatabase | None:
    """The tenant whose event the calling handler is running, or ``None`` outside one."""
    return _CURRENT.get()


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
