"""Which event a log line was written for, so a handler's own lines carry it.

While a handler runs, :func:`current_event` returns its event: in async
handlers, in plain handlers run in the worker's threads and in inline ones.
:class:`EventContextFilter` copies ``event_id``, ``topic``, ``tenant`` and
``attempt`` onto every log record made meanwhile; the ``conveyor`` CLI installs
it, and an application that configures logging itself adds it to its handlers::

    handler = logging.StreamHandler()
    handler.addFilter(EventContextFilter())
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

from conveyor.types import Event

# Set by the worker's executor for the duration of one handler call.
CURRENT_EVENT: ContextVar[Event | None] = ContextVar("conveyor_current_event", default=None)

CONTEXT_FIELDS = ("event_id", "topic", "tenant", "attempt")


def current_event() -> Event | None:
    """The event whose handler is running in this context, or None outside handlers."""
    return CURRENT_EVENT.get()


class EventContextFilter(logging.Filter):
    """Adds the running handler's event to log records (never drops a record).

    A field the record already has (passed in ``extra=``) is left as it is.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        event = CURRENT_EVENT.get()
        if event is not None:
            fields = vars(record)
            fields.setdefault("event_id", event.id)
            fields.setdefault("topic", event.topic)
            fields.setdefault("tenant", event.tenant)
            fields.setdefault("attempt", event.attempt)
        return True
