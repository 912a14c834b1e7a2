"""The write-back consumer: on ``{resource}.created`` set the new row's status via the engine.

Setting a fixed value is naturally idempotent, which at-least-once delivery
requires; every retry of one event also carries the same ``Idempotency-Key``
(derived from the event id). Any non-2xx answer or transport failure raises,
so the event is retried and never marked done on failure.
"""

from __future__ import annotations

from conveyor.consumers.engine_client import AsyncEngineClient
from conveyor.outcomes import PermanentFailure
from conveyor.types import Event

PATH_TEMPLATE_DEFAULT = "/api/{resource}/{id}"


def event_idempotency_key(event: Event) -> str:
    """The key every write of this event sends, identical on every redelivery."""
    return f"conveyor-event-{event.tenant or 'default'}-{event.id}"


def created_target(event: Event) -> tuple[str, str, int | str]:
    """(tenant, resource, row id) of a ``{resource}.created`` event; PermanentFailure if malformed."""
    resource, _, verb = event.topic.rpartition(".")
    if verb != "created" or not resource:
        raise PermanentFailure(f"expected a '<resource>.created' topic, got {event.topic!r}")
    if not event.tenant:
        raise PermanentFailure(f"event {event.id} has no tenant to write back to")
    payload = event.payload
    row_id = payload.get("id") if isinstance(payload, dict) else None
    if isinstance(row_id, bool) or not isinstance(row_id, int | str) or row_id == "":
        raise PermanentFailure(f"event {event.id} payload has no usable 'id'")
    if isinstance(row_id, str) and not row_id.replace("-", "").isalnum():
        raise PermanentFailure(f"event {event.id} payload 'id' is not a plain identifier")
    return event.tenant, resource.rsplit(".", 1)[-1], row_id


class WritebackConsumer:
    """Handler for ``{resource}.created``: PATCH ``{"status": status_value}`` to the row.

    Args:
        engine: the engine client (its scoped role must allow the update).
        status_value: the status to set. Defaults to ``"done"``.
        path_template: path of a row. Defaults to ``"/api/{resource}/{id}"``.
    """

    def __init__(self, engine: AsyncEngineClient, *, status_value: str = "done",
                 path_template: str = PATH_TEMPLATE_DEFAULT) -> None:
        self.engine = engine
        self.status_value = status_value
        self.path_template = path_template

    async def __call__(self, event: Event) -> None:
        tenant, resource, row_id = created_target(event)
        path = self.path_template.format(resource=resource, id=row_id)
        reply = await self.engine.request(tenant, "PATCH", path, json={"status": self.status_value},
                                          idempotency_key=event_idempotency_key(event))
        reply.raise_for_status()
