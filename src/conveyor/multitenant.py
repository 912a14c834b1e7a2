"""One worker process serving many tenant databases, fairly.

Some applications keep one database per tenant, each with its own Conveyor
schema. :class:`MultiTenantWorker` serves all of them from one process:

* the tenants come from a list of DSNs (:class:`StaticTenants`) or a directory
  of ``<tenant>.dsn`` files (:class:`DirectoryTenants`) re-scanned every
  ``rescan_interval`` seconds, so tenants are added, removed or re-pointed
  while it runs;
* each tenant database gets its schema ensured (migrated) when it is added;
* each tenant with work gets its own :class:`~conveyor.worker.Worker`: its
  own claim loop and ``concurrency`` slots. A tenant with a million pending
  events can fill only its own slots, and another tenant's NOTIFY wakes that
  tenant's own claim loop, so one event elsewhere starts within milliseconds
  while the backlog drains (``tests/workflow/test_multitenant.py`` measures it);
* the connections are **bounded per database server**
  (``connections_per_server``, default 50), not per tenant: a tenant's worker
  runs only for a turn, while it has work or the room is not needed; an idle
  tenant is parked (no connection but, while they fit, a LISTEN one) and
  woken by a NOTIFY or a cheap due check; tenants waiting for room take
  turns first come first served, a backlog's turn ending after
  ``turn_length`` when others wait (:mod:`conveyor.tenancy.turns`; the bound
  is in :mod:`conveyor.tenancy.budget`). 200 tenant databases fit 40
  connections (``tests/workflow/test_multitenant_turns.py``);
* nothing crosses tenants: a handler runs only for events of its tenant's
  database, sees that tenant through :func:`current_tenant`, and an event whose
  ``tenant`` column names another tenant is parked ``failed``, never run.

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
    CONNECTIONS_PER_SERVER_DEFAULT,
    RESCAN_INTERVAL_DEFAULT,
    TENANT_CONCURRENCY_DEFAULT,
    TURN_LENGTH_DEFAULT,
    MultiTenantConfig,
    MultiTenantWorker,
    TenantChanges,
)
from conveyor.tenancy.tenant import TenantState

__all__ = ["CONNECTIONS_PER_SERVER_DEFAULT", "DSN_SUFFIX", "RESCAN_INTERVAL_DEFAULT",
           "TENANT_CONCURRENCY_DEFAULT", "TURN_LENGTH_DEFAULT", "DirectoryTenants",
           "MultiTenantConfig", "MultiTenantWorker", "RouterFactory", "StaticTenants",
           "TenantChanges", "TenantDatabase", "TenantSource", "TenantState", "current_tenant",
           "load_app", "tenant_router"]
