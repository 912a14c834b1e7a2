"""RabbitMQ publisher (extra ``conveyor[rabbitmq]``, aio-pika).

Messages go out on a channel in publisher-confirm mode, persistent (aio-pika's
default is not), ``mandatory`` with returns raised: a message counts as relayed
only once the broker confirmed it, and a message no queue would receive is a
refusal, not a silent drop. ``message_id`` is the relay's deduplication id:
classic and quorum queues do not deduplicate, so consumers use it to drop
the duplicates that a retry after a lost confirmation or a replay can make.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any

from conveyor.errors import (
    BrokerUnavailableError,
    ConfigError,
    MissingExtraError,
    PublishRejectedError,
)
from conveyor.relay.core import TIMEOUT_MAX, RelayMessage, error_text, seconds

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

EXCHANGE_TYPES = ("direct", "topic", "fanout", "headers")

# How RabbitMQ (3.8 to 4.x) words the channel error for a body over its
# max_message_size (16 MiB by default since 4.0, 128 MiB before).
_TOO_BIG = re.compile(r"message size (\d+) is larger than configured max size (\d+)")


class _ClosedByAnother(BrokerUnavailableError):
    """The channel closed under this message because of another one, over the size limit."""


def _aio_pika() -> Any:
    try:
        import aio_pika
        import aio_pika.exceptions
    except ImportError as exc:
        raise MissingExtraError("conveyor.relay.RabbitMQPublisher", "rabbitmq",
                                module=exc.name) from exc
    return aio_pika


class RabbitMQPublisher:
    """Publish to a RabbitMQ exchange with publisher confirms.

    Args:
        url: the AMQP URL.
        exchange: the exchange; ``""`` is the default exchange, where the
            destination is a queue's name.
        exchange_type: the type to declare the exchange with. Defaults to "topic".
        declare_exchange: declare the exchange (durable) at start. Defaults to True.
        timeout: seconds to wait for a confirm (then the broker counts as
            unavailable: the event is put back, no attempt spent). Defaults to 5.0.
    """

    def __init__(self, url: str = "amqp://guest:guest@127.0.0.1:5672/", *, exchange: str = "",
                 exchange_type: str = "topic", declare_exchange: bool = True,
                 timeout: float = 5.0) -> None:
        if not isinstance(exchange, str) or len(exchange) > 255:
            raise ConfigError(f"expected exchange to be a name of at most 255 characters, "
                              f"got {exchange!r}")
        if exchange_type not in EXCHANGE_TYPES:
            raise ConfigError(f"expected exchange_type to be one of {', '.join(EXCHANGE_TYPES)}, "
                              f"got {exchange_type!r}")
        wait = seconds("timeout", timeout, least=0, most=TIMEOUT_MAX)
        self.url = url
        self.exchange = exchange
        self.exchange_type = exchange_type
        self.declare_exchange = declare_exchange and exchange != ""
        self.timeout = wait
        self.name = f"RabbitMQ exchange {exchange!r}" if exchange else "RabbitMQ default exchange"
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._lock = asyncio.Lock()
        # The broker's max_message_size once a refusal has told it: bodies over it
        # are refused here, before they close the channel under their neighbours.
        self.max_message_size: int | None = None

    def __repr__(self) -> str:
        return f"RabbitMQPublisher(exchange={self.exchange!r})"

    def check_destination(self, destination: str) -> str | None:
        if len(destination.encode()) > 255:
            return f"routing key {destination[:40]!r}... is longer than 255 bytes"
        return None

    async def start(self) -> None:
        await self._connected()

    def _usable(self) -> bool:
        return (self._exchange is not None and self._channel is not None
                and not self._channel.is_closed and self._connection is not None
                and not self._connection.is_closed)

    async def _connected(self) -> AbstractExchange:
        if self._usable():
            assert self._exchange is not None
            return self._exchange
        async with self._lock:
            if self._usable():
                assert self._exchange is not None
                return self._exchange
            aio_pika = _aio_pika()
            await self._drop()
            try:
                connection = await aio_pika.connect(self.url, timeout=self.timeout)
            except (TimeoutError, OSError, aio_pika.exceptions.AMQPError) as exc:
                raise BrokerUnavailableError(f"cannot reach RabbitMQ: "
                                             f"{error_text(exc)}") from exc
            exceptions = aio_pika.exceptions
            try:
                channel: AbstractChannel = await connection.channel(
                    publisher_confirms=True, on_return_raises=True)
                exchange: AbstractExchange
                if self.declare_exchange:
                    exchange = await channel.declare_exchange(
                        self.exchange, self.exchange_type, durable=True, timeout=self.timeout)
                elif self.exchange:
                    exchange = await channel.get_exchange(self.exchange, ensure=True)
                else:
                    exchange = channel.default_exchange
            except BaseException as exc:
                await self._close(connection)
                # The broker answered no: a misconfiguration. Not at all, or the
                # connection went: a broker away, whose events wait (connected,
                # it may stall before the channel or the exchange is there).
                if isinstance(exc, (exceptions.ChannelNotFoundEntity,
                                    exceptions.ChannelPreconditionFailed,
                                    _aiormq_exceptions().ChannelAccessRefused)):
                    raise ConfigError(f"RabbitMQ refused exchange {self.exchange!r}: "
                                      f"{error_text(exc)}") from None
                if isinstance(exc, (TimeoutError, OSError, exceptions.AMQPError, RuntimeError)):
                    raise BrokerUnavailableError(f"RabbitMQ did not set up exchange "
                                                 f"{self.exchange!r}: "
                                                 f"{error_text(exc)}") from exc
                raise
            self._connection, self._channel, self._exchange = connection, channel, exchange
            return exchange

    async def publish(self, message: RelayMessage) -> None:
        try:
            await self._publish(await self._connected(), message)
        except _ClosedByAnother:
            # Once more on a new channel (publish_many says why).
            await self._publish(await self._connected(), message)

    async def publish_many(self, messages: list[RelayMessage]) -> list[Exception | None]:
        """Publish a batch, every confirm awaited together; what went wrong for each, or None.

        A body over the broker's max_message_size closes the channel, failing
        every publish in flight on it: the others of the batch are published
        once more on a new channel (the limit now known, that one is refused
        before it is sent), instead of being put back with it.
        """
        results: list[Exception | None] = [None] * len(messages)
        pending = list(range(len(messages)))
        for _ in range(2):
            try:
                exchange = await self._connected()
            except BrokerUnavailableError as exc:
                for i in pending:
                    results[i] = exc
                break
            done = await asyncio.gather(*(self._publish(exchange, messages[i]) for i in pending),
                                        return_exceptions=True)
            again = []
            for i, outcome in zip(pending, done, strict=True):
                if isinstance(outcome, _ClosedByAnother):
                    again.append(i)
                if isinstance(outcome, (BrokerUnavailableError, PublishRejectedError)):
                    results[i] = outcome
                elif isinstance(outcome, BaseException):
                    raise outcome
                else:
                    results[i] = None
            if not again:
                break
            pending = again
        return results

    async def _publish(self, exchange: Any, message: RelayMessage) -> None:
        aio_pika = _aio_pika()
        exceptions = aio_pika.exceptions
        limit = self.max_message_size
        if limit is not None and len(message.payload) > limit:
            raise PublishRejectedError(
                f"{self.name} refused {message.destination!r}: the message is "
                f"{len(message.payload)} bytes, over the broker's max_message_size of "
                f"{limit} bytes")
        body = aio_pika.Message(
            message.payload, message_id=message.msg_id, headers=dict(message.headers),
            content_type="application/json", delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        try:
            await exchange.publish(body, message.destination, mandatory=True, timeout=self.timeout)
        except exceptions.DeliveryError as exc:
            if _returned(exc):
                # Returned: no queue is bound for the routing key.
                raise PublishRejectedError(f"{self.name} refused {message.destination!r}: "
                                           f"{_reason(exc)}") from exc
            # Nacked: a queue at its x-max-length with overflow reject-publish, or
            # the broker's own trouble; it passes when consumers catch up.
            raise BrokerUnavailableError(f"{self.name} cannot take {message.destination!r} "
                                         f"now (nack): {_reason(exc)}") from exc
        except exceptions.ChannelPreconditionFailed as exc:
            self._exchange = None     # the channel is closed: a new one on the next publish
            too_big = _TOO_BIG.search(str(exc))
            if too_big is None:
                raise BrokerUnavailableError(f"no confirm from {self.name}: {exc}") from exc
            self.max_message_size = int(too_big[2])
            if len(message.payload) > self.max_message_size:
                raise PublishRejectedError(
                    f"{self.name} refused {message.destination!r}: the message is "
                    f"{len(message.payload)} bytes, over the broker's max_message_size of "
                    f"{too_big[2]} bytes") from exc
            raise _ClosedByAnother(f"{self.name} closed the channel for another message "
                                   f"over its max_message_size") from exc
        except (exceptions.ChannelInvalidStateError, _aiormq_exceptions().ConnectionChannelError
                ) as exc:
            # The channel went under this message, or the connection did for a
            # frame sent on a channel the broker had just closed (504 "expected
            # 'channel.open'"): another message's refusal closes the channel, and
            # which of the publishes in flight hears of it first is chance. Once
            # more on a new channel; a broker really gone fails that again.
            self._exchange = None
            raise _ClosedByAnother(f"{self.name} closed the channel under this message: "
                                   f"{error_text(exc)}") from exc
        except (TimeoutError, OSError, exceptions.AMQPError, RuntimeError) as exc:
            self._exchange = None     # reconnect on the next publish
            raise BrokerUnavailableError(f"no confirm from {self.name}: "
                                         f"{error_text(exc)}") from exc

    async def _drop(self) -> None:
        connection, self._connection, self._channel, self._exchange = \
            self._connection, None, None, None
        if connection is not None:
            await self._close(connection)

    async def _close(self, connection: AbstractConnection) -> None:
        if connection.is_closed:
            return
        try:
            # Bounded: a broker that stalls would never answer the close.
            await asyncio.wait_for(connection.close(), self.timeout)
        except Exception:  # noqa: BLE001 - a broken connection is dropped either way
            pass

    async def aclose(self) -> None:
        await self._drop()


def _aiormq_exceptions() -> Any:
    """aiormq's exceptions (aio_pika's transport; aio_pika does not re-export them all)."""
    import aiormq.exceptions

    return aiormq.exceptions


def _returned(exc: BaseException) -> bool:
    """Whether a DeliveryError is a basic.return (unroutable), not a basic.nack."""
    frame = getattr(exc, "frame", None)
    return type(frame).__name__ == "Return"


def _reason(exc: BaseException) -> str:
    message = getattr(exc, "message", None)
    reply = getattr(message, "reply_text", None) if message is not None else None
    return str(reply or exc or type(exc).__name__)
