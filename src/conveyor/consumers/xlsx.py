"""The XLSX consumer: aggregate an uploaded workbook and write the result back via the engine.

On ``{resource}.created`` (resource ``filejobs`` by default) it fetches the job
through the engine, opens the referenced file from a file store, streams its
first sheet (see :mod:`conveyor.workbook`) and PATCHes ``{status, result}``:

* a job already ``done`` or ``failed`` is skipped, so a redelivery never
  processes a file twice;
* a corrupt, empty, truncated, hostile or non-XLSX file, a missing column or
  a non-numeric ``monto`` is the job's permanent failure: the job is set
  ``failed`` with the reason and the event is done;
* an engine error (transport or non-2xx) raises, so the event is retried.
"""

from __future__ import annotations

import asyncio

from conveyor.consumers.writeback import PATH_TEMPLATE_DEFAULT, created_target, event_idempotency_key
from conveyor.engine_client import AsyncEngineClient
from conveyor.errors import WorkbookError
from conveyor.filestore import FileStore, FileStoreError
from conveyor.outcomes import PermanentFailure
from conveyor.types import Event
from conveyor.workbook import WorkbookLimits, aggregate_workbook

TERMINAL_STATUSES = frozenset({"done", "failed"})


class XlsxConsumer:
    """Handler for ``filejobs.created`` (or another resource's ``.created``).

    Args:
        engine: the engine client; its role needs read and update on the resource.
        store: where the job's ``file`` field points.
        resource: the resource whose jobs this consumer handles. Defaults to ``"filejobs"``.
        limits: hostile-file ceilings. Defaults to ``WorkbookLimits()``.
        path_template: path of a job. Defaults to ``"/api/{resource}/{id}"``.
    """

    def __init__(self, engine: AsyncEngineClient, store: FileStore, *, resource: str = "filejobs",
                 limits: WorkbookLimits | None = None,
                 path_template: str = PATH_TEMPLATE_DEFAULT) -> None:
        self.engine = engine
        self.store = store
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
        update = await asyncio.to_thread(self._aggregate, job.get("file"))
        reply = await self.engine.request(tenant, "PATCH", path, json=update,
                                          idempotency_key=event_idempotency_key(event))
        reply.raise_for_status()

    def _aggregate(self, name: object) -> dict[str, object]:
        if not isinstance(name, str) or not name:
            return {"status": "failed", "error": "job has no file"}
        try:
            with self.store.open(name) as stream:
                result = aggregate_workbook(stream, self.limits)
        except (WorkbookError, FileStoreError) as exc:
            return {"status": "failed", "error": str(exc)}
        return {"status": "done", "result": result.to_json()}
