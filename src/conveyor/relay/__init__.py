"""Relay committed events into a broker: NATS JetStream, RabbitMQ, Redis Streams.

A :class:`Relay` maps topic patterns to publishers; attached to a router, a
worker serves it like any other (``conveyor relay --app module:relay``). An
event counts as relayed only after the broker confirmed it; failures retry
with the worker's backoff, attempts and parking; an unreachable broker puts
events back without spending attempts; relayed rows stay for the worker's
retention, the window ``conveyor relay --replay --since`` can publish again.
See docs/relay.md.

The publishers import their client library when they start: each needs its
extra (``conveyor[nats]``, ``conveyor[rabbitmq]``, ``conveyor[redis]``).
"""

from conveyor.relay.core import Publisher, Relay, RelayMessage, RelayRoute
from conveyor.relay.nats import NatsPublisher
from conveyor.relay.rabbitmq import RabbitMQPublisher
from conveyor.relay.redis import RedisStreamPublisher

__all__ = [
    "NatsPublisher",
    "Publisher",
    "RabbitMQPublisher",
    "RedisStreamPublisher",
    "Relay",
    "RelayMessage",
    "RelayRoute",
]
