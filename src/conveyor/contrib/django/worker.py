"""The router ``manage.py conveyor_worker`` runs: Django tasks, and ``CONVEYOR["ROUTER"]``.

Importing this module needs Django set up (``manage.py`` does it). Each
Django task runs in one of the worker's threads, between Django's own
connection clean-ups (as around a request), and its JSON return value is
stored with its event for ``get_result()``.
"""

from __future__ import annotations

from typing import Any

from django.db import close_old_connections
from django.utils import timezone
from django.utils.module_loading import import_string

from conveyor.contrib.django import setting
from conveyor.contrib.django.backend import (
    TOPIC_PREFIX,
    Task,
    TaskContext,
    TaskResultStatus,
    task_finished,
    task_result,
    task_started,
)
from conveyor.errors import ConfigError
from conveyor.outcomes import PermanentFailure
from conveyor.router import Router
from conveyor.types import Event, EventRecord, EventState

__all__ = ["build_router", "router", "run_task"]


def _record(event: Event) -> EventRecord:
    """The event as the row a running task's context describes."""
    now = timezone.now()
    created = event.created_at or now
    return EventRecord(
        id=event.id, tenant=event.tenant, topic=event.topic, payload=event.payload,
        state=EventState.RUNNING, attempts=event.attempt, max_attempts=event.max_attempts,
        priority=event.priority, run_at=created, lease_owner=None, lease_expires_at=None,
        last_error=None, errors=[], idempotency_key=event.idempotency_key, created_at=created,
        updated_at=now, attempted_at=now, finished_at=None)


def run_task(event: Event) -> Any:
    """Run the Django task an event names; return its JSON-ready value."""
    payload = event.payload
    if not isinstance(payload, dict) or not isinstance(payload.get("task"), str):
        raise PermanentFailure(f"not a Django task's event: payload {payload!r:.80}")
    try:
        task = import_string(payload["task"])
    except ImportError as exc:
        raise PermanentFailure(f"task {payload['task']!r} cannot be imported: {exc}") from None
    if not isinstance(task, Task):
        raise PermanentFailure(f"{payload['task']!r} is not a Django task (decorate it with @task)")
    args, kwargs = payload.get("args", []), payload.get("kwargs", {})
    result = task_result(task, _record(event), payload.get("backend", "default"))
    backend = type(task.get_backend())
    close_old_connections()
    task_started.send(sender=backend, task_result=result)
    try:
        if task.takes_context:
            value = task.call(TaskContext(task_result=result), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
    except BaseException:
        object.__setattr__(result, "status", TaskResultStatus.FAILED)
        task_finished.send(sender=backend, task_result=result)
        raise
    finally:
        close_old_connections()
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    task_finished.send(sender=backend, task_result=result)
    return value


def project_router(path: str) -> Router:
    """The Router ``CONVEYOR["ROUTER"]`` names: ``"shop.jobs.router"`` (or ``"shop.jobs:router"``),
    a Router or a function of no arguments returning one."""
    try:
        target = import_string(path.replace(":", "."))
    except ImportError as exc:
        raise ConfigError(f"CONVEYOR['ROUTER'] {path!r} cannot be imported: {exc}") from None
    if callable(target) and not isinstance(target, Router):
        target = target()
    if not isinstance(target, Router):
        raise ConfigError(f"CONVEYOR['ROUTER'] {path!r} is a {type(target).__name__}, "
                          f"not a conveyor.Router")
    return target


def build_router() -> Router:
    """Every Django task queue's topic (``django.*``), then ``CONVEYOR["ROUTER"]``'s routes."""
    combined = Router()
    combined.add(TOPIC_PREFIX + "*", run_task, store_result=True)
    own = setting("ROUTER")
    if own:
        combined.include(project_router(own))
    return combined


router = build_router()
