"""The XLSX consumer: aggregate an uploaded workbook and write the result back via the engine.

On ``{resource}.created`` (resource ``filejobs`` by default) it fetches the job
through the engine, opens the referenced file from **the event's tenant's own**
file store, streams its first sheet (see :mod:`conveyor.consumers.workbook`) and PATCHes
``{status, result}``:

* the job's ``file`` is a name chosen by a user of that tenant, so it is only
  ever looked up in that tenant's store (``stores(event.tenant)``, e.g.
  :class:`~conveyor.consumers.filestore.TenantDirectories`): a name pointing at another
  tenant's file is not found there, and the job fails with that reason;

* a job already ``done`` or ``failed`` is skipped, so a redelivery never
  processes a file twice;
* a corrupt, empty, truncated, hostile or non-XLSX file, a missing column or
  a non-numeric ``monto`` is the job's permanent failure: the job is set
  ``failed`` with the reason and the event is done;
* an engine error (transport or non-2xx) raises, so the event is retried.
"""

from __future__ import annotations

import asyncio

from conveyor.errors import ConfigError, MissingExtraError, WorkbookError

try:
    from conveyor.consumers.engine_client import AsyncEngineClient
    from conveyor.consumers.writeback import (
        PATH_TEMPLATE_DEFAULT,
        created_target,
        event_idempotency_key,
    )
except MissingExtraError as exc:
    # The workbook reader is stdlib; the write-back through the engine is what needs the extra.
    raise MissingExtraError("the XLSX consumer", "xlsx", module=exc.name) from exc
from conveyor.consumers.filestore import FileStoreError, TenantStores
from conveyor.consumers.workbook import WorkbookLimits, aggregate_workbook
from conveyor.outcomes import PermanentFailure
from conveyor.types import Event

TERMINAL_STATUSES = frozenset({"done", "failed"})


class XlsxConsumer:
    """Handler for ``filejobs.created`` (or another resource's ``.created``).

    Args:
        engine: the engine client; its role needs read and update on the resource.
        stores: a tenant's own file store by tenant name, where its jobs' ``file``
            fields point; e.g. ``TenantDirectories("/srv/uploads")``. A single store
            shared by every tenant is refused: any tenant could name another's files.
        resource: the resource whose jobs this consumer handles. Defaults to ``"filejobs"``.
        limits: hostile-file ceilings. Defaults to ``WorkbookLimits()``.
        path_template: path of a job. Defaults to ``"/api/{resource}/{id}"``.

    Example::

        XlsxConsumer(engine, TenantDirectories("/srv/uploads"))
    """

    def __init__(self, engine: AsyncEngineClient, stores: TenantStores, *,
                 resource: str = "filejobs", limits: WorkbookLimits | None = None,
                 path_template: str = PATH_TEMPLATE_DEFAULT) -> None:
        if not callable(stores):
            raise ConfigError(
                f"expected stores to be a function from tenant to file store, such as "
                f"TenantDirectories(root), got {type(stores).__name__}: one store shared by "
                "every tenant would let any tenant read another's files")
        self.engine = engine
        self.stores = stores
        self.resource = resource
        self.limits = limits or WorkbookLimits()
        self.path_template = path_template

    async def __call__(self, event: Event) -> None:
        tenant, resource, job_id = created_target(event)
        if resource != self.resource:
            raise PermanentFailure(f"xlsx consumer handles {self.resource!r}, not {resource!r}")
        path = self.path_template.format(resource=resource, id=job_id)
        job = (await self.engine.request(tenant, "GET", path)).raise_for_status().body
        if not isinstance(job, dict):
            raise PermanentFailure(f"engine returned no job object for {path}")
        if job.get("status") in TERMINAL_STATUSES:
            return
        update = await asyncio.to_thread(self._aggregate, tenant, job.get("file"))
        reply = await self.engine.request(tenant, "PATCH", path, json=update,
                                          idempotency_key=event_idempotency_key(event))
        reply.raise_for_status()

    def _aggregate(self, tenant: str, name: object) -> dict[str, object]:
        if not isinstance(name, str) or not name:
            return {"status": "failed", "error": "job has no file"}
        try:
            with self.stores(tenant).open(name) as stream:
                result = aggregate_workbook(stream, self.limits)
        except (WorkbookError, FileStoreError) as exc:
            return {"status": "failed", "error": str(exc)}
        return {"status": "done", "result": result.to_json()}
