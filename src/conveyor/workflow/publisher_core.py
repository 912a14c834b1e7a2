"""The I/O-free half of the workflow publishers: checks, the event to enqueue, its status.

Shared by :class:`~conveyor.workflow.publisher_async.AsyncWorkflowPublisher`
and its generated sync twin :class:`~conveyor.workflow.publisher.WorkflowPublisher`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from conveyor.errors import ConfigError, InvalidInputError
from conveyor.types import AttemptError, EventRecord, EventState
from conveyor.validation import check_tenant, check_topic
from conveyor.workflow.registry import WorkflowRegistry
from conveyor.workflow.types import Trigger

TOPIC_PREFIX_DEFAULT = "workflow"
MAX_ATTEMPTS_DEFAULT = 20

# What ``publish_<trigger>`` is: returns the event id (awaitable, on the async twin).
_Publish = Callable[..., int]
_PublishAsync = Callable[..., Awaitable[int]]


@dataclass(frozen=True, slots=True)
class WorkflowEventStatus:
    """Where one published event stands.

    Attributes:
        event_id: the Conveyor event id.
        trigger: e.g. ``"mail.received"``.
        tenant: whose event it is.
        state: ``pending``, ``running``, ``succeeded``, ``failed`` or ``cancelled``.
        attempts: delivery attempts made so far.
        max_attempts: attempts before it is parked ``failed``.
        last_error: why the latest attempt failed, or ``None``.
        errors: every failed attempt, oldest first.
    """

    event_id: int
    trigger: str
    tenant: str | None
    state: EventState
    attempts: int
    max_attempts: int
    last_error: str | None
    errors: list[AttemptError]

    def to_json(self) -> dict[str, Any]:
        return {"event_id": self.event_id, "trigger": self.trigger, "tenant": self.tenant,
                "state": self.state.value, "attempts": self.attempts,
                "max_attempts": self.max_attempts, "last_error": self.last_error,
                "errors": [{"attempt": e.attempt, "at": e.at, "error": e.error}
                           for e in self.errors]}


class _Plan:
    """The I/O-free half shared by both publishers: checks and the row to enqueue."""

    def __init__(self, registry: WorkflowRegistry, topic_prefix: str, max_attempts: int) -> None:
        try:
            check_topic(topic_prefix)
        except InvalidInputError as exc:
            raise ConfigError(f"invalid topic_prefix: {exc}") from None
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) \
                or not 1 <= max_attempts <= 1000:
            raise ConfigError(f"expected max_attempts to be 1..1000, got {max_attempts!r}")
        self.registry = registry
        self.topic_prefix = topic_prefix
        self.max_attempts = max_attempts

    def topic(self, trigger: Trigger) -> str:
        return f"{self.topic_prefix}.{trigger.name}"

    def event(self, trigger_name: str, tenant: str, fields: dict[str, Any]) -> tuple[str, Any]:
        trigger = self.registry.get_trigger(trigger_name)
        if tenant is None:
            raise InvalidInputError(f"trigger {trigger.name!r} needs a tenant")
        check_tenant(tenant)
        trigger.check_payload(fields)
        object_type = self.registry.get_object_type(trigger.object_type)
        payload = {"source": self.registry.source, "trigger": trigger.name,
                   "object_type": object_type.name,
                   "object_id": fields[object_type.id_field], "fields": fields}
        return self.topic(trigger), payload

    def method(self, name: str) -> Trigger:
        trigger = self.registry.trigger_for_method(name)
        if trigger is None:
            raise AttributeError(
                f"no trigger publishes as {name!r}; known: {', '.join(self.registry.methods)}")
        return trigger

    def status(self, record: EventRecord) -> WorkflowEventStatus:
        return status_of(record, self.topic_prefix)


def status_of(record: EventRecord, topic_prefix: str = TOPIC_PREFIX_DEFAULT) -> WorkflowEventStatus:
    """The workflow view of an event row; InvalidInputError if it is not a workflow event."""
    prefix = topic_prefix + "."
    if not record.topic.startswith(prefix):
        raise InvalidInputError(
            f"event {record.id} is not a workflow event (topic {record.topic!r})")
    return WorkflowEventStatus(
        event_id=record.id, trigger=record.topic[len(prefix):], tenant=record.tenant,
        state=record.state, attempts=record.attempts, max_attempts=record.max_attempts,
        last_error=record.last_error, errors=list(record.errors))
