"""The NOTIFY protocol: Conveyor's channels and what their payloads say.

Two channels per schema:

``<schema>.events`` (:func:`events_channel`): wake-ups for the workers and the
ordered relay. A payload is a hint, never a message: any role may NOTIFY the
channel, so nothing in a payload may do more than wake a reader early.

- ``<topic>``: an event of ``topic`` is due now (an insert, a retry, a cron slot);
- ``<topic>|<epoch>``: an event of ``topic`` falls due at ``epoch`` (seconds
  since 1970, in the database's clock);
- ``*`` (:data:`WAKE_ALL`): claim now, whatever the topic;
- ``!pause`` (:data:`PAUSE_NOTIFICATION`): the pauses table changed;
- ``!leases`` (:data:`LEASES_NOTIFICATION`): a running event was cancelled:
  its worker checks its leases now rather than at its next heartbeat, and
  stops the handlers of the events it no longer holds;
- ``!control`` (:data:`CONTROL_NOTIFICATION`): an operator changed a flow
  limit or a cron schedule: the workers read the flow limits at their next
  claim, and their schedulers look at their schedules again;
- ``!deps`` (:data:`DEPENDENCIES_NOTIFICATION`): events that wait for others
  were written: a dependency pass settles the edges whose events already
  finished (conveyor/worker/dependencies.py). Topics cannot
  contain ``!`` or ``*``, so none of these names a topic.

The insert statements (``events.sql``, ``tracing.sql``) build the first two
forms in SQL, as ``topic`` or ``topic || '|' || <epoch>``; tests/test_notify.py
holds them to :func:`parse_wake`. A transaction that sets ``conveyor.notify``
to ``'off'`` sends none of them (docs/producing.md).

``<schema>.results`` (:func:`results_channel`): ``<event id>`` once an event
of a ``store_result`` route (or a cancelled one) has reached its end, for
:meth:`conveyor.Admin.wait`.

Topics are at most 100 characters (``validation.TOPIC_MAX_LENGTH``), so a
payload stays far below PostgreSQL's 8000-byte limit.
"""

from __future__ import annotations

__all__ = ["CONTROL_NOTIFICATION", "DEPENDENCIES_NOTIFICATION", "DUE_SEPARATOR",
           "LEASES_NOTIFICATION", "PAUSE_NOTIFICATION", "SIGNAL_PREFIX", "WAKE_ALL",
           "events_channel", "parse_wake", "result_payload", "results_channel", "wake_payload"]

WAKE_ALL = "*"
# Every payload that starts with it is a signal to the workers, not a topic.
SIGNAL_PREFIX = "!"
PAUSE_NOTIFICATION = "!pause"
LEASES_NOTIFICATION = "!leases"
DEPENDENCIES_NOTIFICATION = "!deps"
CONTROL_NOTIFICATION = "!control"
DUE_SEPARATOR = "|"


def events_channel(schema: str) -> str:
    """The wake-up channel of ``schema`` (checked by the caller): ``<schema>.events``."""
    return f"{schema}.events"


def results_channel(schema: str) -> str:
    """The channel on which ``schema``'s finished events are announced: ``<schema>.results``."""
    return f"{schema}.results"


def wake_payload(topic: str, due_epoch: float | str | None = None) -> str:
    """The wake-up for an event of ``topic``: due now, or at ``due_epoch``."""
    return topic if due_epoch is None else f"{topic}{DUE_SEPARATOR}{due_epoch}"


def parse_wake(payload: str) -> tuple[str, str]:
    """``(topic, due)`` of a wake-up payload; ``due`` is ``""`` for one due now.

    The topic is :data:`WAKE_ALL` for a wake-up meant for every worker; the due
    time is unchecked text (a reader parses it and ignores a bad one).
    """
    topic, _, due = payload.partition(DUE_SEPARATOR)
    return topic, due


def result_payload(event_id: int) -> str:
    """The announcement that event ``event_id`` finished."""
    return str(event_id)
