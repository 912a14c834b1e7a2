"""The parts of :mod:`conveyor.multitenant`, one worker process for many tenant databases.

* :mod:`~conveyor.tenancy.databases`: what a tenant is (a name and its
  database) and where the list of them comes from;
* :mod:`~conveyor.tenancy.isolation`: the router each tenant's worker runs,
  which refuses other tenants' events and tells a handler its tenant;
* :mod:`~conveyor.tenancy.supervisor`: :class:`MultiTenantWorker`, which keeps
  one worker per tenant running as the list changes.

Import them from :mod:`conveyor.multitenant`, the public face, which
re-exports each; this package imports none of them, so loading one part
loads only what it needs.
"""
