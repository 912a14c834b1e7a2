"""The parts of :mod:`conveyor.multitenant`, one worker process for many tenant databases.

* :mod:`~conveyor.tenancy.databases`: what a tenant is (a name and its
  database) and where the list of them comes from;
* :mod:`~conveyor.tenancy.isolation`: the router each tenant's worker runs,
  which refuses other tenants' events and tells a handler its tenant;
* :mod:`~conveyor.tenancy.supervisor`: :class:`MultiTenantWorker`, which serves
  the tenants as the list changes, each server's in turns:
* :mod:`~conveyor.tenancy.turns` (a server's tenants in turns within its
  connection budget), :mod:`~conveyor.tenancy.budget` (the arithmetic of that
  budget, no I/O), :mod:`~conveyor.tenancy.tenant` (what a turn keeps of a
  tenant) and :mod:`~conveyor.tenancy.wakeups` (how a parked tenant is found
  to have work).

Import them from :mod:`conveyor.multitenant`, the public face, which
re-exports each; this package imports none of them, so loading one part
loads only what it needs.
"""
