"""A backend for Django's Tasks framework that enqueues in the caller's transaction.

Settings (Django 6's ``django.tasks``, or the ``django-tasks`` backport on 5.2)::

    TASKS = {
        "default": {
            "BACKEND": "conveyor.contrib.django.backend.ConveyorBackend",
            "QUEUES": ["default", "emails"],      # each becomes the topic "django.<queue>"
            "OPTIONS": {"MAX_ATTEMPTS": 3},       # attempts before a task is FAILED (default 1)
        }
    }

``my_task.enqueue(...)`` writes one event on Django's connection (the
``DATABASE`` option, default ``CONVEYOR["DATABASE"]``), so inside
``transaction.atomic()`` the task exists only if the block commits. ``manage.py
conveyor_worker`` runs it; its return value is stored with the event, and
``get_result(id)`` / ``result.refresh()`` read status, return value and errors.
See docs/django.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.core import checks
from django.utils import timezone
from django.utils.module_loading import import_string

from conveyor.admin import Admin
from conveyor.contrib.django import enqueue, psycopg_connection, setting
from conveyor.errors import ConveyorError, EventNotFoundError, InvalidInputError
from conveyor.types import EventRecord, EventState
from conveyor.validation import check_topic

# Django 6.0 has the Tasks framework built in; on 5.2 it is the django-tasks
# backport, the same API under another package.
try:
    from django.tasks import base as _base
    from django.tasks import exceptions as _exceptions
    from django.tasks import signals as _signals
    from django.tasks.backends.base import BaseTaskBackend
except ImportError:
    from django_tasks import base as _base
    from django_tasks import exceptions as _exceptions
    from django_tasks import signals as _signals
    from django_tasks.backends.base import BaseTaskBackend

Task: Any = _base.Task
TaskContext: Any = _base.TaskContext
TaskError: Any = _base.TaskError
TaskResult: Any = _base.TaskResult
TaskResultStatus: Any = _base.TaskResultStatus
InvalidTaskError: Any = getattr(_exceptions, "InvalidTaskError", None) \
    or _exceptions.InvalidTask
TaskResultDoesNotExist: Any = _exceptions.TaskResultDoesNotExist
task_enqueued, task_started, task_finished = (_signals.task_enqueued, _signals.task_started,
                                              _signals.task_finished)

__all__ = ["TOPIC_PREFIX", "ConveyorBackend", "Task", "TaskContext", "TaskResult",
           "TaskResultStatus", "task_finished", "task_result", "task_started", "topic_of"]

# A Django task's queue "emails" is Conveyor's topic "django.emails".
TOPIC_PREFIX = "django."

_STATUS = {
    EventState.WAITING: TaskResultStatus.READY,
    EventState.PENDING: TaskResultStatus.READY,
    EventState.RUNNING: TaskResultStatus.RUNNING,
    EventState.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    EventState.FAILED: TaskResultStatus.FAILED,
    # Django's tasks have no "cancelled": a cancelled task did not succeed.
    EventState.CANCELLED: TaskResultStatus.FAILED,
}


def topic_of(queue_name: str) -> str:
    """The Conveyor topic of a Django task queue."""
    return TOPIC_PREFIX + queue_name


def _exception_path(error: str, tb: str | None) -> str:
    """The dotted path of the exception class an attempt raised, from its traceback's last line.

    Python prints a class outside builtins with its module (``myapp.errors.Declined:
    ...``) and a builtin one bare (``ValueError: ...``).
    """
    last = (tb or "").rstrip().splitlines()[-1:] or [error]
    name = last[0].split(":", 1)[0].strip()
    if not name or " " in name:
        return "builtins.Exception"
    return name if "." in name else f"builtins.{name}"


def _json(value: Any) -> Any:
    # Django's PostgreSQL backend loads jsonb as text (its JSONField decodes it):
    # on Django's connection, Conveyor's jsonb columns arrive as strings.
    return json.loads(value) if isinstance(value, str) else value


def task_result(task: Any, record: EventRecord, backend: str) -> Any:
    """The TaskResult of a task's event, as the event's row tells it."""
    payload = _json(record.payload)
    payload = payload if isinstance(payload, dict) else {}
    errors = [TaskError(exception_class_path=_exception_path(e.error, e.traceback),
                        traceback=e.traceback or e.error) for e in record.errors]
    # One id per attempt: each failed attempt names its worker; the last one
    # (running or successful) is the lease owner's, or unknown once it is gone.
    workers = [e.worker or "conveyor" for e in record.errors][: record.attempts]
    workers += [record.lease_owner or "conveyor"] * (record.attempts - len(workers))
    result = TaskResult(
        task=task, id=str(record.id), status=_STATUS[record.state],
        enqueued_at=record.created_at,
        started_at=record.attempted_at if record.attempts else None,
        last_attempted_at=record.attempted_at, finished_at=record.finished_at,
        args=list(payload.get("args", [])), kwargs=dict(payload.get("kwargs", {})),
        backend=backend, errors=errors, worker_ids=workers)
    if record.state is EventState.SUCCEEDED:
        object.__setattr__(result, "_return_value", _json(record.result))
    return result


class ConveyorBackend(BaseTaskBackend):
    """Django tasks as Conveyor events, written in the caller's transaction."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.database: str | None = self.options.get("DATABASE")
        self.max_attempts = self.options.get("MAX_ATTEMPTS", 1)

    def validate_task(self, task: Any) -> None:
        super().validate_task(task)
        try:
            check_topic(topic_of(task.queue_name))
        except InvalidInputError as exc:
            raise InvalidTaskError(f"queue {task.queue_name!r} is not usable as a Conveyor "
                                   f"topic: {exc}") from None

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        self.validate_task(task)
        payload = {"task": task.module_path, "args": list(args), "kwargs": dict(kwargs),
                   "backend": self.alias}
        run_at: datetime | None = task.run_after
        try:
            event_id = enqueue(topic_of(task.queue_name), payload, using=self.database,
                               priority=task.priority, run_at=run_at,
                               max_attempts=self.max_attempts)
        except InvalidInputError as exc:
            raise InvalidTaskError(str(exc)) from None
        now = timezone.now()
        result = TaskResult(
            task=task, id=str(event_id), status=TaskResultStatus.READY, enqueued_at=now,
            started_at=None, last_attempted_at=None, finished_at=None, args=list(args),
            kwargs=dict(kwargs), backend=self.alias, errors=[], worker_ids=[])
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> Any:
        try:
            event_id = int(result_id)
            record = Admin(setting("SCHEMA")).show(psycopg_connection(self.database), event_id)
        except (ValueError, TypeError, EventNotFoundError, InvalidInputError):
            raise TaskResultDoesNotExist(result_id) from None
        payload = _json(record.payload)
        payload = payload if isinstance(payload, dict) else {}
        if not record.topic.startswith(TOPIC_PREFIX) or "task" not in payload:
            raise TaskResultDoesNotExist(result_id)
        try:
            task = import_string(payload["task"])
        except ImportError:
            raise TaskResultDoesNotExist(f"{result_id}: task {payload['task']!r} no longer "
                                     f"exists") from None
        return task_result(task, record, self.alias)

    def check(self, **kwargs: Any) -> Iterable[checks.CheckMessage]:
        try:
            setting("SCHEMA")
            if not isinstance(self.max_attempts, int) or not 1 <= self.max_attempts <= 1000:
                raise ConveyorError(f"expected OPTIONS MAX_ATTEMPTS to be 1 to 1000, got "
                                    f"{self.max_attempts!r}")
        except ConveyorError as exc:
            yield checks.Error(str(exc), obj=self.alias, id="conveyor.E001")

