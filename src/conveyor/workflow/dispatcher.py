"""The dispatcher: a consumer that delivers published workflow events to the engine.

It runs on an ordinary :class:`~conveyor.worker.Worker` behind the route
``"workflow.*"``. Each delivery carries an ``Idempotency-Key`` built from the
declaring module, the tenant and the event id (``mail:acme:42``): identical on
every redelivery of one event, distinct across modules whose per-tenant
databases may reuse event ids. The engine drops a key it has seen.

Failures stay visible: a failed attempt leaves ``last_error`` and an entry in
the event's error history, and ``status`` shows them.

The default retry policy
------------------------
The seed waited linearly, 10 s more per attempt up to 100 s, for 5 attempts:
an engine down for about 100 s (one slow deploy) parked every event ``failed``.
Conveyor keeps the seed's curve, :data:`BACKOFF_DEFAULT` =
``LinearBackoff(step=10, max_delay=100)`` (10, 20, ... 100, 100 ... seconds),
but gives events :data:`~conveyor.workflow.publisher.MAX_ATTEMPTS_DEFAULT` = 20
attempts, so an outage of about 24 minutes (10+20+...+100 = 550 s, then ten
more waits of 100 s) is ridden out without an operator. Answers that retrying
cannot fix (4xx other than 401, 403, 408, 425, 429) park the event at once. For the
seed's exact behaviour pass ``max_attempts=5`` to the publisher.

Example::

    engine = AsyncEngineClient(EngineConfig(...))
    dispatcher = WorkflowDispatcher(HttpWorkflowAdapter(engine), registry)
    router = Router()
    dispatcher.attach(router)            # routes "workflow.*" with the backoff above
    await Worker(dsn, router).run()
"""

from __future__ import annotations

import logging
from typing import Any

from conveyor.errors import EngineHTTPError, InvalidInputError
from conveyor.outcomes import PermanentFailure
from conveyor.retry import LinearBackoff, RetryPolicy
from conveyor.router import Route, Router
from conveyor.types import Event
from conveyor.validation import check_tenant
from conveyor.workflow.publisher import TOPIC_PREFIX_DEFAULT
from conveyor.workflow.registry import WorkflowRegistry
from conveyor.workflow.types import WorkflowAdapter, WorkflowDelivery

log = logging.getLogger(__name__)

BACKOFF_DEFAULT = LinearBackoff(step=10.0, max_delay=100.0)
TIMEOUT_DEFAULT = 30.0
RETRIED_AUTH_STATUSES = frozenset({401, 403})


def workflow_idempotency_key(source: str, tenant: str, event_id: int) -> str:
    """The key every delivery of one event carries: ``"<source>:<tenant>:<event id>"``."""
    return f"{source}:{tenant}:{event_id}"


def _delivery(event: Event, registry: WorkflowRegistry | None) -> WorkflowDelivery:
    """Decode a published event; PermanentFailure when it cannot be delivered at all."""
    payload = event.payload
    if not isinstance(payload, dict) or not isinstance(payload.get("fields"), dict):
        raise PermanentFailure(f"event {event.id} is not a workflow event payload")
    try:
        tenant = check_tenant(event.tenant)
    except InvalidInputError as exc:
        raise PermanentFailure(str(exc)) from None
    if tenant is None:
        raise PermanentFailure(f"event {event.id} has no tenant to deliver for")
    source, trigger = payload.get("source"), payload.get("trigger")
    if not isinstance(source, str) or not isinstance(trigger, str):
        raise PermanentFailure(f"event {event.id} lacks source or trigger")
    if registry is not None:
        try:
            registry.get_trigger(trigger).check_payload(payload["fields"])
        except InvalidInputError as exc:
            raise PermanentFailure(str(exc)) from None
    return WorkflowDelivery(
        tenant=tenant, source=source, trigger=trigger,
        object_type=str(payload.get("object_type", "")), object_id=payload.get("object_id"),
        fields=payload["fields"], event_id=event.id,
        idempotency_key=workflow_idempotency_key(source, tenant, event.id),
        attempt=event.attempt,
        occurred_at=event.created_at.isoformat() if event.created_at else None)


class WorkflowDispatcher:
    """Handler delivering ``"<topic_prefix>.*"`` events through a :class:`WorkflowAdapter`.

    Args:
        adapter: the engine, e.g. :class:`~conveyor.workflow.adapters.HttpWorkflowAdapter`.
        registry: when given, events whose trigger or fields it does not declare are
            parked ``failed`` instead of sent. Defaults to ``None`` (send as published).
        topic_prefix: must match the publisher's. Defaults to ``"workflow"``.
        backoff: waits between failed attempts. Defaults to ``LinearBackoff(step=10,
            max_delay=100)``.
        timeout: seconds one delivery may take. Defaults to 30.
    """

    def __init__(self, adapter: WorkflowAdapter, registry: WorkflowRegistry | None = None, *,
                 topic_prefix: str = TOPIC_PREFIX_DEFAULT,
                 backoff: RetryPolicy = BACKOFF_DEFAULT, timeout: float = TIMEOUT_DEFAULT) -> None:
        self.adapter = adapter
        self.registry = registry
        self.topic_prefix = topic_prefix
        self.backoff = backoff
        self.timeout = timeout

    @property
    def pattern(self) -> str:
        return f"{self.topic_prefix}.*"

    def attach(self, router: Router) -> Route:
        """Route ``"<topic_prefix>.*"`` to this dispatcher with its backoff and timeout."""
        return router.add(self.pattern, self, timeout=self.timeout, backoff=self.backoff)

    async def __call__(self, event: Event) -> None:
        delivery = _delivery(event, self.registry)
        try:
            await self.adapter.deliver(delivery)
        except EngineHTTPError as exc:
            # 401/403 are retried too: a rotated secret or a fixed role makes them pass
            # without anyone touching the events.
            if not (exc.retryable or exc.status in RETRIED_AUTH_STATUSES):
                raise PermanentFailure(str(exc)) from exc
            raise
        except Exception as exc:
            if getattr(exc, "retryable", True) is False:
                raise PermanentFailure(f"{type(exc).__name__}: {exc}") from exc
            raise
        log.debug("delivered %s event %s", delivery.trigger, event.id,
                  extra=_log_ids(event, delivery))


def _log_ids(event: Event, delivery: WorkflowDelivery) -> dict[str, Any]:
    return {"action": "workflow_delivered", "event_id": event.id, "topic": event.topic,
            "tenant": delivery.tenant}
