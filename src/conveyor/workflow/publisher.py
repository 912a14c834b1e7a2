"""Publishing workflow events: only an insert, in the caller's transaction.

The publisher never calls the workflow engine. It checks the trigger and its
payload against the registry and enqueues one Conveyor event on the caller's
connection, so the event exists exactly when the business change commits and
an unreachable engine cannot slow the request path down. The
:mod:`~conveyor.workflow.dispatcher` delivers it later.

There is a method per declared trigger, named by the trigger (``mail.received``
gives ``publish_received``), plus the generic :meth:`WorkflowPublisher.publish`.

Example::

    publisher = WorkflowPublisher(registry)
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO messages ...")
        event_id = publisher.publish_received(conn, tenant="acme", message_id="m-1",
                                              thread_id="t-1", mailbox="inbox")
    # later
    with psycopg.connect(dsn, autocommit=True) as conn:
        print(publisher.status(conn, event_id))   # state, attempts, last_error

Events go to topic ``"<topic_prefix>.<trigger>"`` (``workflow.mail.received``)
with ``max_attempts`` 20 unless configured otherwise; see
:mod:`conveyor.workflow.dispatcher` for why.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from conveyor.admin import Admin, AsyncAdmin
from conveyor.config import ProducerConfig
from conveyor.errors import ConfigError, InvalidInputError
from conveyor.producer import AsyncProducer, Producer
from conveyor.types import AttemptError, EventRecord, EventState
from conveyor.validation import check_tenant, check_topic
from conveyor.workflow.registry import Trigger, WorkflowRegistry

TOPIC_PREFIX_DEFAULT = "workflow"
MAX_ATTEMPTS_DEFAULT = 20


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


class WorkflowPublisher:
    """Publishes workflow events on a sync connection the caller holds.

    Args:
        registry: the declared object types and triggers.
        topic_prefix: first topic segment of every event. Defaults to ``"workflow"``.
        max_attempts: delivery attempts before an event is parked ``failed``. Defaults to 20.
        producer_config: schema and payload limits. Defaults to ``ProducerConfig()``.
    """

    def __init__(self, registry: WorkflowRegistry, *, topic_prefix: str = TOPIC_PREFIX_DEFAULT,
                 max_attempts: int = MAX_ATTEMPTS_DEFAULT,
                 producer_config: ProducerConfig | None = None) -> None:
        self._plan = _Plan(registry, topic_prefix, max_attempts)
        self._producer = Producer(producer_config)
        self._admin = Admin(self._producer.config.schema)

    @property
    def registry(self) -> WorkflowRegistry:
        return self._plan.registry

    def publish(self, conn: psycopg.Connection[Any], trigger: str, *, tenant: str,
                idempotency_key: str | None = None, delay: float = 0.0,
                **fields: Any) -> int:
        """Enqueue one ``trigger`` event in ``conn``'s transaction; returns the event id.

        Raises InvalidInputError naming an unregistered trigger, a missing declared
        field or an undeclared one, before any SQL runs.
        """
        topic, payload = self._plan.event(trigger, tenant, fields)
        return self._producer.enqueue(conn, topic, payload, tenant=tenant,
                                      idempotency_key=idempotency_key, delay=delay,
                                      max_attempts=self._plan.max_attempts)

    def status(self, conn: psycopg.Connection[Any], event_id: int) -> WorkflowEventStatus:
        """State, attempts and errors of one published event."""
        return self._plan.status(self._admin.show(conn, event_id))

    def __getattr__(self, name: str) -> Callable[..., int]:
        if not name.startswith("publish_"):
            raise AttributeError(name)
        trigger = self._plan.method(name)

        def publish(conn: psycopg.Connection[Any], *, tenant: str, **options: Any) -> int:
            return self.publish(conn, trigger.name, tenant=tenant, **options)

        publish.__name__ = name
        publish.__doc__ = f"Publish {trigger.name!r}: {trigger.description}"
        return publish

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._plan.registry.methods})


class AsyncWorkflowPublisher:
    """The async mirror of :class:`WorkflowPublisher`; same arguments and methods."""

    def __init__(self, registry: WorkflowRegistry, *, topic_prefix: str = TOPIC_PREFIX_DEFAULT,
                 max_attempts: int = MAX_ATTEMPTS_DEFAULT,
                 producer_config: ProducerConfig | None = None) -> None:
        self._plan = _Plan(registry, topic_prefix, max_attempts)
        self._producer = AsyncProducer(producer_config)
        self._admin = AsyncAdmin(self._producer.config.schema)

    @property
    def registry(self) -> WorkflowRegistry:
        return self._plan.registry

    async def publish(self, conn: psycopg.AsyncConnection[Any], trigger: str, *, tenant: str,
                      idempotency_key: str | None = None, delay: float = 0.0,
                      **fields: Any) -> int:
        """Enqueue one ``trigger`` event in ``conn``'s transaction; returns the event id."""
        topic, payload = self._plan.event(trigger, tenant, fields)
        return await self._producer.enqueue(conn, topic, payload, tenant=tenant,
                                            idempotency_key=idempotency_key, delay=delay,
                                            max_attempts=self._plan.max_attempts)

    async def status(self, conn: psycopg.AsyncConnection[Any], event_id: int) -> WorkflowEventStatus:
        """State, attempts and errors of one published event."""
        return self._plan.status(await self._admin.show(conn, event_id))

    def __getattr__(self, name: str) -> Callable[..., Awaitable[int]]:
        if not name.startswith("publish_"):
            raise AttributeError(name)
        trigger = self._plan.method(name)

        async def publish(conn: psycopg.AsyncConnection[Any], *, tenant: str,
                          **options: Any) -> int:
            return await self.publish(conn, trigger.name, tenant=tenant, **options)

        publish.__name__ = name
        publish.__doc__ = f"Publish {trigger.name!r}: {trigger.description}"
        return publish

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._plan.registry.methods})
