"""Publishing workflow events: only an insert, in the caller's transaction.

The publisher never calls the workflow engine. It checks the trigger and its
payload against the registry and enqueues one Conveyor event on the caller's
connection, so the event exists exactly when the business change commits and
an unreachable engine cannot slow the request path down. The
:mod:`~conveyor.workflow.dispatcher` delivers it later.

There is a method per declared trigger, named by the trigger (``mail.received``
gives ``publish_received``), plus the generic :meth:`AsyncWorkflowPublisher.publish`.

Example::

    publisher = AsyncWorkflowPublisher(registry)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute("INSERT INTO messages ...")
        event_id = await publisher.publish_received(conn, tenant="acme", message_id="m-1",
                                                    thread_id="t-1", mailbox="inbox")
    # later
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        print(await publisher.status(conn, event_id))   # state, attempts, last_error

Events go to topic ``"<topic_prefix>.<trigger>"`` (``workflow.mail.received``)
with ``max_attempts`` 20 unless configured otherwise; see
:mod:`conveyor.workflow.dispatcher` for why.

``conveyor/workflow/publisher_async.py`` is the source people edit;
``conveyor/workflow/publisher.py`` is its sync twin, generated from it by
``scripts/unasync.py``; checks and the event's shape are the I/O-free
:mod:`conveyor.workflow.publisher_core`.
"""

from __future__ import annotations

from typing import Any

import psycopg

from conveyor.admin import AsyncAdmin
from conveyor.config import ProducerConfig
from conveyor.producer import AsyncProducer

# unasync: from conveyor.workflow.publisher_async import AsyncWorkflowPublisher as AsyncWorkflowPublisher
from conveyor.workflow.publisher_core import MAX_ATTEMPTS_DEFAULT as MAX_ATTEMPTS_DEFAULT
from conveyor.workflow.publisher_core import TOPIC_PREFIX_DEFAULT as TOPIC_PREFIX_DEFAULT
from conveyor.workflow.publisher_core import WorkflowEventStatus as WorkflowEventStatus
from conveyor.workflow.publisher_core import _Plan, _PublishAsync
from conveyor.workflow.publisher_core import status_of as status_of
from conveyor.workflow.registry import WorkflowRegistry


class AsyncWorkflowPublisher:
    """Publishes workflow events on a connection the caller holds.

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
        self._producer = AsyncProducer(producer_config)
        self._admin = AsyncAdmin(self._producer.config.schema)

    @property
    def registry(self) -> WorkflowRegistry:
        return self._plan.registry

    async def publish(
        self, conn: psycopg.AsyncConnection[Any], trigger: str, *, tenant: str,
        idempotency_key: str | None = None, delay: float = 0.0, **fields: Any,
    ) -> int:
        """Enqueue one ``trigger`` event in ``conn``'s transaction; returns the event id.

        Raises InvalidInputError naming an unregistered trigger, a missing declared
        field or an undeclared one, before any SQL runs.
        """
        topic, payload = self._plan.event(trigger, tenant, fields)
        return await self._producer.enqueue(
            conn, topic, payload, tenant=tenant, idempotency_key=idempotency_key, delay=delay,
            max_attempts=self._plan.max_attempts)

    async def status(self, conn: psycopg.AsyncConnection[Any], event_id: int) -> WorkflowEventStatus:
        """State, attempts and errors of one published event."""
        return self._plan.status(await self._admin.show(conn, event_id))

    def __getattr__(self, name: str) -> _PublishAsync:
        if not name.startswith("publish_"):
            raise AttributeError(name)
        trigger = self._plan.method(name)

        async def publish(conn: psycopg.AsyncConnection[Any], *, tenant: str, **options: Any) -> int:
            return await self.publish(conn, trigger.name, tenant=tenant, **options)

        publish.__name__ = name
        publish.__doc__ = f"Publish {trigger.name!r}: {trigger.description}"
        return publish

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._plan.registry.methods})
