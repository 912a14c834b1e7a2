"""NATS JetStream publisher (extra ``conveyor[nats]``, nats-py).

Each message is published through the JetStream context, which waits for the
stream's PubAck: a message counts as relayed only once the stream has stored
it. ``Nats-Msg-Id`` is the relay's deduplication id, so a retried or replayed
event within the stream's ``duplicate_window`` is stored once (the PubAck
says ``duplicate``). The expected-stream header makes a subject that this
stream does not capture a refusal instead of a store elsewhere.

At start the publisher looks the stream up: it creates it (``subjects``,
``duplicate_window``) when it is missing and ``create_stream`` allows, and
refuses one whose duplicate window is shorter than ``duplicate_window``.

A message over the server's ``max_payload`` (payload and headers) is refused
before it is sent: sent, it would make the server close the connection under
every publish in flight. A connection that closes fails the PubAcks still
awaited on it at once; only one that stays open without answering waits out
``timeout``.

JetStream acknowledges before the data is synced to disk unless the server
runs with ``sync_interval: always``; a relayed row is therefore kept for the
worker's retention, and ``conveyor relay --replay`` can publish it again.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from conveyor.errors import (
    BrokerUnavailableError,
    ConfigError,
    MissingExtraError,
    PublishRejectedError,
)
from conveyor.relay.core import TIMEOUT_MAX, RelayMessage, error_text, seconds

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.client import JetStreamContext

log = logging.getLogger(__name__)

# A subject to publish to: tokens of anything but whitespace, '.', '*' and '>'.
_SUBJECT = re.compile(r"[^\s.*>]+(\.[^\s.*>]+)*")

DUPLICATE_WINDOW_DEFAULT = 120.0

# The header naming the stream that must store the message (nats.js.api.Header),
# so a subject that this stream does not capture is refused, not stored elsewhere.
EXPECTED_STREAM = "Nats-Expected-Stream"


def _lost() -> Exception:
    """What a PubAck awaited on a connection that closed fails with."""
    return ConnectionResetError("the connection to NATS closed before the PubAck")


async def _log_error(exc: Exception) -> None:
    # nats-py logs every connection error with its traceback by default; the
    # relay reports the outcome (the event put back) in one line instead.
    log.debug("NATS client error: %s", exc)


def _header_size(headers: dict[str, str]) -> int:
    """The bytes of ``headers`` as nats-py sends them: ``NATS/1.0``, a line each, a blank line."""
    size = 12
    for key, value in headers.items():
        size += len(key.strip().encode()) + len(value.strip().encode()) + 4
    return size


def _failing(in_flight: set[asyncio.Future[Any]],
             chained: Callable[[], Awaitable[None]] | None) -> Callable[[], Awaitable[None]]:
    """A disconnected or closed callback that fails the PubAcks still awaited at once."""
    async def lost() -> None:
        for future in list(in_flight):
            if not future.done():
                future.set_exception(_lost())
        if chained is not None:
            await chained()
    return lost


def _nats() -> Any:
    try:
        import nats
        import nats.errors
        import nats.js.errors
    except ImportError as exc:
        raise MissingExtraError("conveyor.relay.NatsPublisher", "nats", module=exc.name) from exc
    return nats


class NatsPublisher:
    """Publish to a NATS JetStream stream, one PubAck per message.

    Args:
        servers: the NATS URL(s).
        stream: the stream that must store the messages.
        subjects: the stream's subjects, for creating it when it is missing
            (required with ``create_stream``); the routes' destinations must
            fall within the stream's subjects.
        duplicate_window: seconds the stream remembers message ids; at least
            this is required of an existing stream. Defaults to 120.0.
        create_stream: create the stream when it is missing. Defaults to True.
        timeout: seconds to wait for a PubAck (then the broker counts as
            unavailable: the event is put back, no attempt spent). A lost
            connection fails the publishes in flight at once, without this
            wait. Defaults to 5.0.
        connect_options: more keyword arguments for ``nats.connect``.
    """

    def __init__(self, servers: str | Sequence[str] = "nats://127.0.0.1:4222", *, stream: str,
                 subjects: Sequence[str] | None = None,
                 duplicate_window: float = DUPLICATE_WINDOW_DEFAULT,
                 create_stream: bool = True, timeout: float = 5.0,
                 connect_options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(stream, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,255}", stream):
            raise ConfigError(f"expected stream to be a JetStream stream name (letters, digits, "
                              f"'-' and '_'), got {stream!r}")
        if create_stream and not subjects:
            raise ConfigError(f"expected the subjects of stream {stream!r} (it is created when "
                              f"missing), got {subjects!r}")
        window = seconds("duplicate_window", duplicate_window, least=0, most=7 * 86400)
        wait = seconds("timeout", timeout, least=0, most=TIMEOUT_MAX)
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        self.stream = stream
        self.subjects = list(subjects or [])
        self.duplicate_window = window
        self.create_stream = create_stream
        self.timeout = wait
        self.connect_options = dict(connect_options or {})
        self.name = f"NATS stream {stream}"
        self.duplicates = 0          # PubAcks that said the stream had the message already
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        # The PubAck futures awaited on the current connection: failed at once when
        # it closes, since nats-py leaves them pending until their timer.
        self._in_flight: set[asyncio.Future[Any]] = set()
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"NatsPublisher(stream={self.stream!r})"

    def check_destination(self, destination: str) -> str | None:
        if _SUBJECT.fullmatch(destination) is None:
            return f"{destination!r} is not a NATS subject to publish to"
        return None

    async def start(self) -> None:
        await self._connected()

    async def _connected(self) -> JetStreamContext:
        if self._js is not None and self._nc is not None and self._nc.is_connected:
            return self._js
        async with self._lock:
            if self._js is not None and self._nc is not None and self._nc.is_connected:
                return self._js
            nats = _nats()
            await self._drop()
            in_flight: set[asyncio.Future[Any]] = set()
            try:
                # No reconnecting inside the client: a lost connection fails the
                # publishes in flight at once (their events are put back) and the
                # next publish connects again, instead of waiting in a buffer.
                # nats.connect retries the first connection until it succeeds,
                # whatever allow_reconnect says: bounded here.
                options = {"error_cb": _log_error, **self.connect_options}
                options["disconnected_cb"] = _failing(in_flight, options.get("disconnected_cb"))
                options["closed_cb"] = _failing(in_flight, options.get("closed_cb"))
                nc = await asyncio.wait_for(
                    nats.connect(self.servers, connect_timeout=self.timeout,
                                 allow_reconnect=False, max_reconnect_attempts=0, **options),
                    self.timeout)
            except (TimeoutError, OSError, nats.errors.Error) as exc:
                raise BrokerUnavailableError(f"cannot reach NATS at {', '.join(self.servers)}: "
                                             f"{error_text(exc)}") from exc
            js: JetStreamContext = nc.jetstream(timeout=self.timeout)
            try:
                await self._check_stream(js)
            except BaseException:
                await nc.close()
                raise
            self._nc, self._js, self._in_flight = nc, js, in_flight
            return js

    async def _check_stream(self, js: JetStreamContext) -> None:
        import nats.errors
        import nats.js.errors
        from nats.js.api import StreamConfig

        try:
            try:
                info = await js.stream_info(self.stream)
            except nats.js.errors.NotFoundError:
                if not self.create_stream:
                    raise ConfigError(f"NATS has no stream {self.stream!r} and create_stream "
                                      f"is off") from None
                # Unanswered, as the lookup may be: a relay starting while the
                # broker stalls waits for it like one that cannot connect.
                await js.add_stream(StreamConfig(name=self.stream, subjects=self.subjects,
                                                 duplicate_window=self.duplicate_window))
                return
        except (nats.js.errors.ServiceUnavailableError, nats.js.errors.ServerError) as exc:
            raise BrokerUnavailableError(f"NATS cannot serve stream {self.stream!r} now: "
                                         f"{error_text(exc)}") from exc
        except nats.js.errors.APIError as exc:
            raise ConfigError(f"NATS refused stream {self.stream!r}: {error_text(exc)}") from None
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise BrokerUnavailableError(f"NATS did not answer for stream {self.stream!r} "
                                         f"(is JetStream enabled?): {error_text(exc)}") from exc
        window = info.config.duplicate_window or 0
        if window + 1e-6 < self.duplicate_window:
            raise ConfigError(f"NATS stream {self.stream!r} remembers message ids for "
                              f"{window:g}s, the relay needs at least {self.duplicate_window:g}s "
                              f"(its duplicate_window)")

    async def publish(self, message: RelayMessage) -> None:
        [failed] = await self.publish_many([message])
        if failed is not None:
            raise failed

    async def publish_many(self, messages: list[RelayMessage]) -> list[Exception | None]:
        """Publish a batch pipelined, then await every PubAck under one timer; what went
        wrong for each message, or None."""
        import nats.errors

        js = await self._connected()
        nc, in_flight = self._nc, self._in_flight
        assert nc is not None
        results: list[Exception | None] = [None] * len(messages)
        sent: list[tuple[int, asyncio.Future[Any]]] = []
        away: Exception | None = None
        # publish_async pipelines: it sends and hands back the PubAck's future,
        # so a batch shares the connection without a round trip each (2.4x
        # js.publish's rate, measured in benchmarks/relay.py). No wait_stall
        # and no wait_for: each costs an asyncio.wait_for per message; one
        # timer for the batch cancels the PubAcks that do not come.
        for i, message in enumerate(messages):
            headers = {**message.headers, "Nats-Msg-Id": message.msg_id,
                       EXPECTED_STREAM: self.stream}
            too_big = self._too_big(message, headers, nc.max_payload)
            if too_big is not None:
                results[i] = too_big
                continue
            if away is not None:
                results[i] = away
                continue
            try:
                future = await js.publish_async(message.destination, message.payload,
                                                headers=headers)
            except (TimeoutError, OSError, nats.errors.Error) as exc:
                # One message's own error (a refusal) leaves the rest of the batch
                # to go on; a connection gone fails the rest as it would them.
                results[i] = self._refusal(exc, message)
                if isinstance(results[i], BrokerUnavailableError):
                    away = results[i]
                continue
            in_flight.add(future)
            if nc.is_closed and not future.done():
                future.set_exception(_lost())    # closed while it was being sent
            sent.append((i, future))
        try:
            await self._acks(sent, messages, results)
        finally:
            for _, future in sent:
                in_flight.discard(future)
        return results

    async def _acks(self, sent: list[tuple[int, asyncio.Future[Any]]],
                    messages: list[RelayMessage], results: list[Exception | None]) -> None:
        """Await the PubAcks of ``sent`` under one timer, into ``results``."""
        expired = []

        def expire() -> None:
            expired.append(True)
            for _, future in sent:
                future.cancel()
        timer = asyncio.get_running_loop().call_later(self.timeout, expire)
        try:
            acks = await asyncio.gather(*(f for _, f in sent), return_exceptions=True)
        finally:
            timer.cancel()
        for (i, _), ack in zip(sent, acks, strict=True):
            if isinstance(ack, asyncio.CancelledError):
                if not expired:
                    raise ack                      # the handler itself is being cancelled
                results[i] = self._refusal(TimeoutError(f"no PubAck within {self.timeout:g}s"),
                                           messages[i])
            elif isinstance(ack, BaseException):
                results[i] = self._refusal(ack, messages[i])
            elif ack.duplicate:
                self.duplicates += 1

    def _too_big(self, message: RelayMessage, headers: dict[str, str],
                 max_payload: int) -> Exception | None:
        """The refusal of a message the server would not take for its size, or None.

        nats-py checks the payload alone against ``max_payload``; the server
        counts the headers too and closes the connection over a message past
        it, failing every publish in flight. Checked here, the message alone
        is refused, with its size in the error.
        """
        size = len(message.payload) + _header_size(headers)
        if size <= max_payload:
            return None
        return PublishRejectedError(
            f"{self.name} refused {message.destination!r}: the message is {size} bytes with "
            f"its headers, over the server's max_payload of {max_payload} bytes")

    def _refusal(self, exc: BaseException, message: RelayMessage) -> Exception:
        """What a publish that raised ``exc`` means: the broker away or full, or a refusal."""
        import nats.errors
        import nats.js.errors

        if isinstance(exc, nats.js.errors.ServiceUnavailableError):
            # 503: the stream is full (its max_bytes or max_msgs with discard=new)
            # or JetStream is short of resources. Not the event's fault, and it
            # passes when consumers catch up or limits are raised: wait, spend nothing.
            return BrokerUnavailableError(f"{self.name} cannot take {message.destination!r} "
                                          f"now: {exc.description or exc}")
        if isinstance(exc, nats.js.errors.APIError):
            return PublishRejectedError(f"{self.name} refused {message.destination!r}: "
                                        f"{exc.description or exc}")
        if isinstance(exc, (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError)):
            # JetStream answers nothing for a subject no stream captures.
            return PublishRejectedError(f"{self.name} refused {message.destination!r}: no "
                                        f"stream captures the subject")
        if isinstance(exc, nats.errors.MaxPayloadError):
            return PublishRejectedError(f"{self.name} refused {message.destination!r}: the "
                                        f"payload is over the server's max_payload")
        if isinstance(exc, (TimeoutError, OSError, nats.errors.Error)):
            return BrokerUnavailableError(f"no PubAck from {self.name}: {error_text(exc)}")
        raise exc

    async def _drop(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            try:
                await nc.close()
            except Exception:  # noqa: BLE001 - a broken connection is dropped either way
                pass

    async def aclose(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            await nc.drain()
