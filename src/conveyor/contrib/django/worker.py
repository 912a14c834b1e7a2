"""The router ``manage.py conveyor_worker`` runs: Django tasks, and ``CONVEYOR["ROUTER"]``.

Importing this module needs Django set up (``manage.py`` does it). Each
Django task runs in one of the worker's threads, between Django's own
connection clean-ups (as around a request), and its JSON return value is
stored with its event for ``get_result()``.
"""

from __future__ import annotations

import importlib
import logging
import sys
from contextvars import ContextVar
from typing import Any

from django.db import close_old_connections
from django.utils import timezone
from django.utils.module_loading import autodiscover_modules, import_string

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

# Set while run_task runs a task (in the worker's thread for it).
_RUNNING_TASK: ContextVar[bool] = ContextVar("conveyor_django_running_task", default=False)
# The Tasks framework's own loggers (Django 6, and the backport on 5.2).
TASK_FRAMEWORK_LOGGERS = ("django.tasks", "django_tasks")


class _TaskFrameworkLines(logging.Filter):
    """The Tasks framework's per-task lines, made debug lines under the worker.

    Its receivers log a line as each task starts and, when it fails, its whole
    traceback at ERROR (``logger.exception``): about ten lines per failed
    attempt beside the worker's own one-line warning (newcomer review M3). The
    worker already says what failed, once, and stores every traceback with the
    event; so under it these records pass only when the logger is enabled for
    debug, as debug records without the traceback. Records made outside a
    task run by the worker are left as they are.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not _RUNNING_TASK.get():
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info, record.exc_text = None, None
        return True


for _name in TASK_FRAMEWORK_LOGGERS:
    logging.getLogger(_name).addFilter(_TaskFrameworkLines())


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
    token = _RUNNING_TASK.set(True)
    try:
        return _run_task(event)
    finally:
        _RUNNING_TASK.reset(token)


def _run_task(event: Event) -> Any:
    payload = event.payload
    if not isinstance(payload, dict) or not isinstance(payload.get("task"), str):
        raise PermanentFailure(f"not a Django task's event: payload {payload!r:.80}")
    task = loaded_object(payload["task"])
    if task is None:
        raise PermanentFailure(
            f"{payload['task']!r:.200} is not a task this worker loaded (it loads each installed "
            f"app's tasks module and CONVEYOR['TASK_MODULES'])")
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


def loaded_object(path: str) -> Any:
    """What a dotted path names among the modules already imported, or None.

    Never imports: any role that can write an event on a ``django.*`` topic
    chooses the path, and importing a module runs its code (adversary N13).
    The worker imports the task modules itself at start (:func:`load_task_modules`).
    """
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        target = sys.modules.get(".".join(parts[:split]))
        if target is None:
            continue
        for name in parts[split:]:
            if name.startswith("_"):
                return None
            target = getattr(target, name, None)
        return target
    return None


def load_task_modules() -> None:
    """Import every installed app's ``tasks`` module and those ``CONVEYOR["TASK_MODULES"]`` names."""
    autodiscover_modules("tasks")
    modules = setting("TASK_MODULES")
    if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
        raise ConfigError(f"expected CONVEYOR['TASK_MODULES'] to be a list of module names, "
                          f"got {modules!r:.80}")
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"CONVEYOR['TASK_MODULES'] names {module!r}, which cannot be "
                              f"imported: {exc}") from None


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
    load_task_modules()
    combined = Router()
    combined.add(TOPIC_PREFIX + "*", run_task, store_result=True)
    own = setting("ROUTER")
    if own:
        combined.include(project_router(own))
    return combined


router = build_router()
