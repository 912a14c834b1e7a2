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

The parts live in :mod:`conveyor.tenancy` (what a tenant is and where the list
comes from; the isolation guard; the supervisor); this module is where they
are imported from.
"""

from conveyor.tenancy.databases import (
    DSN_SUFFIX,
    DirectoryTenants,
    StaticTenants,
    TenantDatabase,
    TenantSource,
)
from conveyor.tenancy.isolation import RouterFactory, current_tenant, load_app, tenant_router
from conveyor.tenancy.supervisor import (
    RESCAN_INTERVAL_DEFAULT,
    TENANT_CONCURRENCY_DEFAULT,
    MultiTenantConfig,
    MultiTenantWorker,
    TenantChanges,
    TenantState,
)

__all__ = ["DSN_SUFFIX", "RESCAN_INTERVAL_DEFAULT", "TENANT_CONCURRENCY_DEFAULT",
           "DirectoryTenants", "MultiTenantConfig", "MultiTenantWorker", "RouterFactory",
           "StaticTenants", "TenantChanges", "TenantDatabase", "TenantSource", "TenantState",
           "current_tenant", "load_app", "tenant_router"]
