"""How Conveyor talks to a workflow engine over HTTP.

:class:`~conveyor.workflow.types.WorkflowAdapter` is the seam for any engine:
three coroutines, one per thing Conveyor ever asks (register an object type,
register a trigger, deliver an event). :class:`HttpWorkflowAdapter`, its HTTP
implementation, speaks JSON through
:class:`~conveyor.consumers.engine_client.AsyncEngineClient`, so every call carries a
fresh, scoped service JWT, the tenant's ``Host`` header, and never follows a
redirect.

The HTTP contract (what ``examples/workflow_engine`` implements)::

    PUT  {base_path}/object-types/<name>   {"source", "description", "id_field"}
    PUT  {base_path}/triggers/<name>       {"source", "object_type", "description", "fields"}
         -> 201 {"result": "created"} | 200 {"result": "updated" | "unchanged"}
         -> 409 {"error": "<why>"}   a conflict
    POST {base_path}/events  with header Idempotency-Key
         -> 2xx accepted (a redelivered key is answered 2xx and not recorded twice)

Example::

    async with AsyncEngineClient(EngineConfig(base_url="http://127.0.0.1:8088",
            tenant_domain="workflow.test", jwt_secret=secret, role="conveyor-workflow",
            audience="workflow")) as engine:
        adapter = HttpWorkflowAdapter(engine)
        report = await registry.register_all(adapter)
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from conveyor.errors import EngineHTTPError
from conveyor.validation import check_tenant
from conveyor.workflow.errors import WorkflowConflictError, WorkflowError
from conveyor.workflow.types import ObjectType, RegistrationOutcome, Trigger, WorkflowDelivery

if TYPE_CHECKING:
    # Types only: the adapter is handed a client, so publishing and dispatching
    # through another adapter need no HTTP extra.
    from conveyor.consumers.engine_client import AsyncEngineClient, EngineReply

BASE_PATH_DEFAULT = "/api/workflow"
REGISTRATION_TENANT_DEFAULT = "system"


def _detail(reply: EngineReply) -> str:
    body = reply.body
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])[:300]
    return json.dumps(body)[:300] if body is not None else "(empty body)"


class HttpWorkflowAdapter:
    """JSON over HTTP to a workflow engine, authenticated by the engine client's service JWT.

    Args:
        engine: the client; its config names the engine URL, tenant domain, secret and
            scoped role.
        registration_tenant: the tenant whose ``Host`` and token carry registrations
            (engines keeping one global catalogue ignore it). Defaults to ``"system"``.
        base_path: where the engine serves the contract above. Defaults to ``"/api/workflow"``.
    """

    def __init__(self, engine: AsyncEngineClient, *,
                 registration_tenant: str = REGISTRATION_TENANT_DEFAULT,
                 base_path: str = BASE_PATH_DEFAULT) -> None:
        self.engine = engine
        self.registration_tenant = check_tenant(registration_tenant) or REGISTRATION_TENANT_DEFAULT
        self.base_path = base_path.rstrip("/")

    async def register_object_type(self, source: str, object_type: ObjectType) -> RegistrationOutcome:
        body = {"source": source, "description": object_type.description,
                "id_field": object_type.id_field}
        return await self._put(f"object type {object_type.name!r}",
                               f"{self.base_path}/object-types/{object_type.name}", body)

    async def register_trigger(self, source: str, trigger: Trigger) -> RegistrationOutcome:
        body = {"source": source, "object_type": trigger.object_type,
                "description": trigger.description,
                "fields": [f.to_json() for f in trigger.fields]}
        return await self._put(f"trigger {trigger.name!r}",
                               f"{self.base_path}/triggers/{trigger.name}", body)

    async def _put(self, what: str, path: str, body: dict[str, Any]) -> RegistrationOutcome:
        reply = await self.engine.request(self.registration_tenant, "PUT", path, json=body)
        if reply.status == 409:
            raise WorkflowConflictError(_detail(reply))
        if not reply.ok:
            raise WorkflowError(f"registering {what}: workflow engine answered {reply.status}: "
                                f"{_detail(reply)}")
        if reply.status == 201:
            return RegistrationOutcome.CREATED
        result = reply.body.get("result") if isinstance(reply.body, dict) else None
        try:
            return RegistrationOutcome(str(result))
        except ValueError:
            raise WorkflowError(f"registering {what}: workflow engine answered {reply.status} "
                                f"with unknown result {result!r}") from None

    async def deliver(self, delivery: WorkflowDelivery) -> None:
        reply = await self.engine.request(delivery.tenant, "POST", f"{self.base_path}/events",
                                          json=delivery.to_json(),
                                          idempotency_key=delivery.idempotency_key)
        if not reply.ok:
            raise EngineHTTPError(
                f"workflow engine answered {reply.status} to {delivery.trigger} event "
                f"{delivery.event_id}: {_detail(reply)}", status=reply.status, body=reply.body)
