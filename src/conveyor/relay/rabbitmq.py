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
from typing import TYPE_CHECKING, Any

from conveyor.errors import (
    BrokerUnavailableError,
    ConfigError,
    MissingExtraError,
    PublishRejectedError,
)
from conveyor.relay.core import TIMEOUT_MAX, RelayMessage, seconds

if TYPE_CHECKING:
    from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

EXCHANGE_TYPES = ("direct", "topic", "fanout", "headers")


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
                                             f"{str(exc) or type(exc).__name__}") from exc
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
            except BaseException:
                await connection.close()
                raise
            self._connection, self._channel, self._exchange = connection, channel, exchange
            return exchange

    async def publish(self, message: RelayMessage) -> None:
        await self._publish(await self._connected(), message)

    async def publish_many(self, messages: list[RelayMessage]) -> list[Exception | None]:
        """Publish a batch, every confirm awaited together; what went wrong for each, or None."""
        try:
            exchange = await self._connected()
        except BrokerUnavailableError as exc:
            return [exc] * len(messages)
        done = await asyncio.gather(*(self._publish(exchange, m) for m in messages),
                                    return_exceptions=True)
        results: list[Exception | None] = []
        for outcome in done:
            if isinstance(outcome, (BrokerUnavailableError, PublishRejectedError)):
                results.append(outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                results.append(None)
        return results

    async def _publish(self, exchange: Any, message: RelayMessage) -> None:
        aio_pika = _aio_pika()
        exceptions = aio_pika.exceptions
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
        except (TimeoutError, OSError, exceptions.AMQPError, RuntimeError) as exc:
            self._exchange = None     # reconnect on the next publish
            raise BrokerUnavailableError(f"no confirm from {self.name}: "
                                         f"{str(exc) or type(exc).__name__}") from exc

    async def _drop(self) -> None:
        connection, self._connection, self._channel, self._exchange = \
            self._connection, None, None, None
        if connection is not None and not connection.is_closed:
            try:
                await connection.close()
            except Exception:  # noqa: BLE001 - a broken connection is dropped either way
                pass

    async def aclose(self) -> None:
        await self._drop()


def _returned(exc: BaseException) -> bool:
    """Whether a DeliveryError is a basic.return (unroutable), not a basic.nack."""
    frame = getattr(exc, "frame", None)
    return type(frame).__name__ == "Return"


def _reason(exc: BaseException) -> str:
    message = getattr(exc, "message", None)
    reply = getattr(message, "reply_text", None) if message is not None else None
    return str(reply or exc or type(exc).__name__)
