"""Publishing: an insert in the caller's transaction, checked against the registry, never a call."""

from __future__ import annotations

import inspect
import statistics
import time
from typing import Any

import psycopg
import pytest
from examples.mail_module import registry

from conveyor import EventState, Producer
from conveyor.errors import InvalidInputError
from conveyor.workflow import AsyncWorkflowPublisher, WorkflowPublisher

from .conftest import EngineHandle

FIELDS = {"message_id": "m-1", "thread_id": "t-1", "mailbox": "inbox"}


def test_publish_method_enqueues_in_the_callers_transaction(fresh_db: str) -> None:
    publisher = WorkflowPublisher(registry)
    with psycopg.connect(fresh_db) as conn:
        event_id = publisher.publish_received(conn, tenant="acme", **FIELDS)
        conn.rollback()
        kept = publisher.publish_received(conn, tenant="acme", **FIELDS)
        conn.commit()
        rows = conn.execute("SELECT id, topic, tenant, payload, max_attempts "
                            "FROM conveyor.events").fetchall()
    assert rows == [(kept, "workflow.mail.received", "acme",
                     {"source": "mail", "trigger": "mail.received", "object_type": "message",
                      "object_id": "m-1", "fields": FIELDS}, 20)]
    assert event_id != kept


def test_generic_publish_and_optional_fields(conn: psycopg.Connection[Any]) -> None:
    publisher = WorkflowPublisher(registry)
    event_id = publisher.publish(conn, "mail.delivery_failed", tenant="acme", message_id="m-2",
                                 thread_id="t-1", recipient="bob@example.com")
    status = publisher.status(conn, event_id)
    assert (status.trigger, status.state, status.attempts, status.last_error) == \
        ("mail.delivery_failed", EventState.PENDING, 0, None)


def test_unregistered_trigger_is_refused_by_name(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(InvalidInputError, match=r"trigger 'mail\.sent' is not registered in 'mail'"):
        WorkflowPublisher(registry).publish(conn, "mail.sent", tenant="acme", message_id="m")


def test_unknown_publish_method_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no trigger publishes as 'publish_sent'"):
        _ = WorkflowPublisher(registry).publish_sent


def test_missing_declared_fields_are_named(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(InvalidInputError,
                       match=r"'mail\.received' payload lacks declared field\(s\): thread_id, mailbox"):
        WorkflowPublisher(registry).publish_received(conn, tenant="acme", message_id="m-1")


def test_undeclared_fields_are_named(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(InvalidInputError, match="does not declare field\\(s\\): subject"):
        WorkflowPublisher(registry).publish_received(conn, tenant="acme", subject="hi", **FIELDS)


def test_a_tenant_is_required_and_checked(conn: psycopg.Connection[Any]) -> None:
    publisher = WorkflowPublisher(registry)
    with pytest.raises(TypeError):
        publisher.publish_received(conn, **FIELDS)
    with pytest.raises(InvalidInputError, match="invalid tenant 'Acme Corp'"):
        publisher.publish_received(conn, tenant="Acme Corp", **FIELDS)


def test_status_of_a_non_workflow_event_is_refused(conn: psycopg.Connection[Any]) -> None:
    event_id = Producer().enqueue(conn, "email.send", {})
    with pytest.raises(InvalidInputError, match=f"event {event_id} is not a workflow event"):
        WorkflowPublisher(registry).status(conn, event_id)


async def test_async_publisher_mirrors_the_sync_one(aconn: psycopg.AsyncConnection[Any]) -> None:
    sync_api = {n for n in dir(WorkflowPublisher(registry)) if not n.startswith("_")}
    async_api = {n for n in dir(AsyncWorkflowPublisher(registry)) if not n.startswith("_")}
    assert sync_api == async_api
    publisher = AsyncWorkflowPublisher(registry)
    assert inspect.iscoroutinefunction(publisher.publish_deadline_reached)
    event_id = await publisher.publish_deadline_reached(aconn, tenant="acme", thread_id="t-9",
                                                        deadline="2026-12-01T09:00:00Z")
    status = await publisher.status(aconn, event_id)
    assert (status.trigger, status.tenant, status.state) == \
        ("mail.deadline_reached", "acme", EventState.PENDING)


def test_publishing_with_the_engine_down_takes_an_inserts_time(
        fresh_db: str, workflow_engine: EngineHandle) -> None:
    """The engine's port refuses connections; publishing must not notice at all."""
    assert not workflow_engine.server.running
    publisher, producer = WorkflowPublisher(registry), Producer()
    raw, published = [], []
    with psycopg.connect(fresh_db) as conn:
        for i in range(60):
            start = time.perf_counter()
            with conn.transaction():
                producer.enqueue(conn, "plain.insert", {"i": i}, tenant="acme")
            raw.append(time.perf_counter() - start)
            start = time.perf_counter()
            with conn.transaction():
                publisher.publish_received(conn, tenant="acme", message_id=f"m-{i}",
                                           thread_id="t", mailbox="inbox")
            published.append(time.perf_counter() - start)
    raw_median, published_median = statistics.median(raw), statistics.median(published)
    # Same statement plus the payload checks: within a small factor of a bare insert,
    # and nowhere near the engine client's 2 s timeout.
    assert published_median < raw_median * 3 + 0.002, (raw_median, published_median)
    assert max(published) < 0.5
