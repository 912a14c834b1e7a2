"""The dispatcher against the example engine on loopback: retries, visibility, exactly once per key."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import psycopg
from examples.mail_module import registry

from conveyor import EventState, Router
from conveyor.consumers.engine_client import AsyncEngineClient
from conveyor.types import Event
from conveyor.workflow import (
    BACKOFF_DEFAULT,
    MAX_ATTEMPTS_DEFAULT,
    HttpWorkflowAdapter,
    WorkflowDispatcher,
    WorkflowPublisher,
    workflow_idempotency_key,
)
from waiting import wait_until

from .conftest import ROOT, SMALL_BACKOFF, EngineHandle, new_worker, running, show, state_of


def _publish(url: str, count: int, *, tenant: str = "acme", max_attempts: int = 20) -> list[int]:
    publisher = WorkflowPublisher(registry, max_attempts=max_attempts)
    with psycopg.connect(url) as conn:
        return [publisher.publish_received(conn, tenant=tenant, message_id=f"m-{i}",
                                           thread_id="t-1", mailbox="inbox")
                for i in range(count)]


def _router(client: AsyncEngineClient) -> Router:
    router = Router()
    WorkflowDispatcher(HttpWorkflowAdapter(client), registry, backoff=SMALL_BACKOFF).attach(router)
    return router


async def _register(client: AsyncEngineClient) -> None:
    await registry.register_all(HttpWorkflowAdapter(client))


async def _all_in(url: str, ids: list[int], state: str) -> bool:
    states = await asyncio.gather(*(state_of(url, i) for i in ids))
    return all(s == state for s in states)


def test_default_policy_is_the_seeds_linear_curve_with_twenty_attempts() -> None:
    assert [BACKOFF_DEFAULT.delay(n) for n in range(1, 13)] == \
        [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0, 100.0, 100.0]
    assert MAX_ATTEMPTS_DEFAULT == 20
    waits = sum(BACKOFF_DEFAULT.delay(n) for n in range(1, MAX_ATTEMPTS_DEFAULT))
    assert 1400 <= waits <= 1500  # about 24 minutes of engine outage ridden out


async def test_events_published_while_the_engine_is_down_arrive_exactly_once_after_it_starts(
        fresh_db: str, workflow_engine: EngineHandle, engine_client: AsyncEngineClient) -> None:
    workflow_engine.server.start()        # registered at deploy time, then the engine goes down
    await _register(engine_client)
    workflow_engine.server.stop()
    ids = _publish(fresh_db, 20)
    worker = new_worker(fresh_db, _router(engine_client))
    async with running(worker):
        async def some_failed() -> bool:
            records = await asyncio.gather(*(asyncio.to_thread(show, fresh_db, i) for i in ids))
            return all(r.attempts >= 2 for r in records)
        await wait_until(some_failed, timeout=20, what="two refused attempts per event")
        record = await asyncio.to_thread(show, fresh_db, ids[0])
        assert record.state is not EventState.SUCCEEDED
        assert "unreachable" in (record.last_error or "")
        workflow_engine.server.start()
        await wait_until(lambda: _all_in(fresh_db, ids, "succeeded"), timeout=20, what="all delivered")
    events = workflow_engine.engine.store.events("acme")
    keys = [e["idempotency_key"] for e in events]
    assert sorted(keys) == sorted(workflow_idempotency_key("mail", "acme", i) for i in ids)
    assert len(set(keys)) == len(keys) == 20
    assert sorted(e["event_id"] for e in events) == sorted(ids)
    assert {e["fields"]["mailbox"] for e in events} == {"inbox"}


async def test_a_redelivered_event_is_dropped_by_its_idempotency_key(
        running_engine: EngineHandle, engine_client: AsyncEngineClient, fresh_db: str) -> None:
    await _register(engine_client)
    [event_id] = _publish(fresh_db, 1)
    record = show(fresh_db, event_id)
    dispatcher = WorkflowDispatcher(HttpWorkflowAdapter(engine_client), registry)
    for attempt in (1, 2):  # the same event twice, as after a lost acknowledgement
        await dispatcher(Event(id=event_id, topic=record.topic, tenant="acme", attempt=attempt,
                               max_attempts=20, payload_text=json.dumps(record.payload),
                               created_at=record.created_at))
    assert len(running_engine.engine.store.events("acme")) == 1
    assert running_engine.engine.store.duplicates("acme") == 1


async def test_three_500s_then_success_on_the_fourth_attempt_with_errors_recorded(
        running_engine: EngineHandle, engine_client: AsyncEngineClient, fresh_db: str) -> None:
    await _register(engine_client)
    async with AsyncEngineClient(running_engine.config()) as control:
        reply = await control._http.post("/_control/fail-next", json={"count": 3, "status": 500})
        assert reply.status_code == 200
    [event_id] = _publish(fresh_db, 1)
    async with running(new_worker(fresh_db, _router(engine_client))):
        await wait_until(lambda: _all_in(fresh_db, [event_id], "succeeded"), timeout=20, what="delivery")
    status = WorkflowPublisher(registry).status(psycopg.connect(fresh_db, autocommit=True), event_id)
    assert (status.state, status.attempts) == (EventState.SUCCEEDED, 4)
    assert [e.attempt for e in status.errors] == [1, 2, 3]
    assert all("workflow engine answered 500 to mail.received event" in e.error
               for e in status.errors)
    assert len(running_engine.engine.store.events("acme")) == 1


async def test_an_engine_down_past_the_last_attempt_parks_the_event_failed_with_the_reason(
        fresh_db: str, workflow_engine: EngineHandle, engine_client: AsyncEngineClient) -> None:
    [event_id] = _publish(fresh_db, 1, max_attempts=3)
    async with running(new_worker(fresh_db, _router(engine_client))):
        await wait_until(lambda: _all_in(fresh_db, [event_id], "failed"), timeout=20, what="parking")
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        status = WorkflowPublisher(registry).status(conn, event_id)
    assert (status.state, status.attempts, len(status.errors)) == (EventState.FAILED, 3, 3)
    assert status.last_error is not None
    assert status.last_error.startswith("EngineTransportError: engine unreachable for POST "
                                        "/api/workflow/events: ConnectError")
    shown = subprocess.run(
        [sys.executable, "-m", "conveyor.cli.main", "workflow", "status", str(event_id), "--json"],
        cwd=ROOT, env=dict(os.environ, CONVEYOR_DATABASE_URL=fresh_db),
        capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    data: dict[str, Any] = json.loads(shown.stdout)
    assert (data["state"], data["attempts"], data["trigger"]) == ("failed", 3, "mail.received")
    assert data["last_error"] == status.last_error


async def test_an_answer_retrying_cannot_fix_parks_the_event_at_once(
        running_engine: EngineHandle, engine_client: AsyncEngineClient, fresh_db: str) -> None:
    # Nothing registered: the engine answers 422 "trigger 'mail.received' is not registered".
    [event_id] = _publish(fresh_db, 1)
    async with running(new_worker(fresh_db, _router(engine_client))):
        await wait_until(lambda: _all_in(fresh_db, [event_id], "failed"), timeout=20, what="parking")
    record = show(fresh_db, event_id)
    assert record.attempts == 1
    assert "answered 422" in (record.last_error or "")
    assert "not registered" in (record.last_error or "")


async def test_an_authentication_failure_is_retried_not_parked(
        running_engine: EngineHandle, engine_client: AsyncEngineClient, fresh_db: str) -> None:
    await _register(engine_client)
    running_engine.engine.fail_next(1, status=401)   # as while a rotated secret rolls out
    [event_id] = _publish(fresh_db, 1)
    async with running(new_worker(fresh_db, _router(engine_client))):
        await wait_until(lambda: _all_in(fresh_db, [event_id], "succeeded"), timeout=20, what="delivery")
    record = show(fresh_db, event_id)
    assert record.attempts == 2
    assert "answered 401" in record.errors[0].error
