"""Which event a log line was written for, so a handler's own lines carry it.

While a handler runs, :func:`current_event` returns its event: in async
handlers, in plain handlers run in the worker's threads and in inline ones.
:class:`EventContextFilter` copies ``event_id``, ``topic``, ``tenant`` and
``attempt`` onto every log record made meanwhile; the ``conveyor`` CLI installs
it, and an application that configures logging itself adds it to its handlers::

    handler = logging.StreamHandler()
    handler.addFilter(EventContextFilter())

How it is found: a plain handler's thread carries its event in a context
variable; a handler on the event loop is looked up from the running task by
the executor that started it. Setting a context variable in every handler
task would cost CPU on every event (asyncio copies a modified context at
every callback; docs/benchmarks.md, "Behind choices in the code"), so the
lookup is made only when a record is logged, and cached per task.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from contextvars import ContextVar

from conveyor.types import Event

# Set for the duration of one plain handler call in a pool thread.
CURRENT_EVENT: ContextVar[Event | None] = ContextVar("conveyor_current_event", default=None)

CONTEXT_FIELDS = ("event_id", "topic", "tenant", "attempt")

# Executors that can tell the event of the running task (weak: a stopped
# worker's executor goes away with it).
_SOURCES: list[weakref.WeakMethod[Callable[[], Event | None]]] = []


def add_source(find: Callable[[], Event | None]) -> None:
    """Register a bound method that returns the event of the running task, or None."""
    _SOURCES.append(weakref.WeakMethod(find))


def current_event() -> Event | None:
    """The event whose handler is running here, or None outside handlers."""
    event = CURRENT_EVENT.get()
    if event is not None:
        return event
    for ref in list(_SOURCES):
        find = ref()
        if find is None:
            try:
                _SOURCES.remove(ref)
            except ValueError:   # another thread removed it first
                pass
            continue
        event = find()
        if event is not None:
            return event
    return None


class EventContextFilter(logging.Filter):
    """Adds the running handler's event to log records (never drops a record).

    A field the record already has (passed in ``extra=``) is left as it is.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        event = current_event()
        if event is not None:
            fields = vars(record)
            fields.setdefault("event_id", event.id)
            fields.setdefault("topic", event.topic)
            fields.setdefault("tenant", event.tenant)
            fields.setdefault("attempt", event.attempt)
        return True
