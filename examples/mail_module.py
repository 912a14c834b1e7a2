"""The mail module of the seed, declared with Conveyor's workflow registry.

Object types ``message`` and ``thread``; triggers ``mail.received``,
``mail.delivery_failed`` (on a message) and ``mail.deadline_reached`` (on a
thread). The mail code publishes in its own transaction and never waits on
the workflow engine::

    with psycopg.connect(tenant_dsn) as conn:
        conn.execute("INSERT INTO messages ...")
        publisher.publish_received(conn, tenant="acme", message_id="m-1",
                                   thread_id="t-1", mailbox="inbox")

Registration and the dispatcher worker::

    conveyor workflow register --app examples.mail_module:registry
    conveyor worker --app examples.mail_module:build_router

``build_router`` reads its settings from the environment, as an application
may (Conveyor itself never does): ``WORKFLOW_ENGINE_URL``,
``WORKFLOW_ENGINE_JWT_SECRET``, ``WORKFLOW_TENANT_DOMAIN``.
"""

from __future__ import annotations

import os

from conveyor import Router
from conveyor.consumers.engine_client import AsyncEngineClient, EngineConfig
from conveyor.workflow import (
    AsyncWorkflowPublisher,
    Field,
    HttpWorkflowAdapter,
    WorkflowDispatcher,
    WorkflowPublisher,
    WorkflowRegistry,
)

registry = WorkflowRegistry(source="mail")

registry.object_type("message", description="One e-mail message in a mailbox",
                     id_field="message_id")
registry.object_type("thread", description="A conversation of messages", id_field="thread_id")

registry.trigger(
    "mail.received", object_type="message",
    description="A message arrived in a mailbox",
    fields=["thread_id", Field(name="mailbox", description="e.g. inbox, support")])
registry.trigger(
    "mail.delivery_failed", object_type="message",
    description="An outgoing message could not be delivered",
    fields=["thread_id", Field(name="recipient", description="the address that bounced"),
            Field(name="reason", description="the remote server's answer", required=False)])
registry.trigger(
    "mail.deadline_reached", object_type="thread",
    description="A thread's answer deadline passed without a reply",
    fields=[Field(name="deadline", description="ISO 8601 timestamp of the deadline")])

publisher = WorkflowPublisher(registry)
async_publisher = AsyncWorkflowPublisher(registry)


def build_router() -> Router:
    """A router whose only route delivers this module's workflow events."""
    engine = AsyncEngineClient(EngineConfig(
        base_url=os.environ["WORKFLOW_ENGINE_URL"],
        tenant_domain=os.environ.get("WORKFLOW_TENANT_DOMAIN", "workflow.test"),
        jwt_secret=os.environ["WORKFLOW_ENGINE_JWT_SECRET"],
        role="conveyor-workflow", audience="workflow"))
    router = Router()
    WorkflowDispatcher(HttpWorkflowAdapter(engine), registry).attach(router)
    return router
