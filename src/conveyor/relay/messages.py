"""What a relay route is and what a publisher is handed: the relay's vocabulary.

:mod:`conveyor.relay.core` (the relay) and :mod:`conveyor.relay.ordered` (its
ordered streams) both speak it; neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from conveyor.types import Event

# What {tenant} becomes for an event without a tenant.
NO_TENANT = "-"


@dataclass(frozen=True, slots=True)
class RelayMessage:
    """One event as a publisher sends it.

    ``msg_id`` is the broker's deduplication id (the relay's ``msg_id_prefix``
    and the event id): the same for every attempt and every replay of the
    event. ``headers`` carry ``conveyor-event-id``, ``conveyor-topic``,
    ``conveyor-tenant`` (when set), ``conveyor-attempt`` and the W3C
    ``traceparent`` / ``tracestate`` of the enqueuing span (when stored).
    """

    event_id: int
    msg_id: str
    topic: str
    tenant: str | None
    attempt: int
    destination: str
    payload: bytes
    headers: dict[str, str]


@runtime_checkable
class Publisher(Protocol):
    """What the relay needs of a broker client (a Kafka publisher would be one more).

    ``publish`` returns once the broker has confirmed the message and raises
    :class:`~conveyor.BrokerUnavailableError` when it cannot tell (no
    connection, no confirmation in time) or
    :class:`~conveyor.PublishRejectedError` when the broker refused it. It
    is called concurrently (one call per running handler): a publisher
    pipelines them on its connection. ``check_destination`` returns why a
    rendered destination is unusable on this broker, or None.

    A publisher may also offer ``async publish_many(messages) -> list[Exception
    | None]``: the relay then hands it a route's events of one claim at once
    (a batch route, docs/batches.md) and takes, per message, None once
    confirmed or the error ``publish`` would have raised. The three built-in
    publishers do.
    """

    name: str

    async def start(self) -> None: ...

    async def publish(self, message: RelayMessage) -> None: ...

    def check_destination(self, destination: str) -> str | None: ...

    async def aclose(self) -> None: ...


# The ordering modes of a relay route.
MODES = ("unordered", "per_key", "ordered")


@dataclass(frozen=True, slots=True)
class RelayRoute:
    pattern: str
    publisher: Publisher
    destination: str
    # per_key: the route's fifo_by (conveyor.flow.FlowLimit), None when unordered.
    fifo_by: str | None = None
    # ordered: read by an OrderedStream (conveyor.relay.ordered), not claimed by the worker.
    ordered: bool = False


class MessageBuilder(Protocol):
    """Builds the message of an event on a route (:meth:`conveyor.relay.Relay.message`)."""

    def message(self, route: RelayRoute, event: Event) -> RelayMessage: ...
