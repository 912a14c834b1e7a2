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

JetStream acknowledges before the data is synced to disk unless the server
runs with ``sync_interval: always``; a relayed row is therefore kept for the
worker's retention, and ``conveyor relay --replay`` can publish it again.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from conveyor.errors import (
    BrokerUnavailableError,
    ConfigError,
    MissingExtraError,
    PublishRejectedError,
)
from conveyor.relay.core import TIMEOUT_MAX, RelayMessage, seconds

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.client import JetStreamContext

log = logging.getLogger(__name__)

# A subject to publish to: tokens of anything but whitespace, '.', '*' and '>'.
_SUBJECT = re.compile(r"[^\s.*>]+(\.[^\s.*>]+)*")

DUPLICATE_WINDOW_DEFAULT = 120.0


def _text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


async def _log_error(exc: Exception) -> None:
    # nats-py logs every connection error with its traceback by default; the
    # relay reports the outcome (the event put back) in one line instead.
    log.debug("NATS client error: %s", exc)


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
            unavailable: the event is put back, no attempt spent). Defaults to 5.0.
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
            try:
                # No reconnecting inside the client: a lost connection fails the
                # publishes in flight at once (their events are put back) and the
                # next publish connects again, instead of waiting in a buffer.
                # nats.connect retries the first connection until it succeeds,
                # whatever allow_reconnect says: bounded here.
                nc = await asyncio.wait_for(
                    nats.connect(self.servers, connect_timeout=self.timeout,
                                 allow_reconnect=False, max_reconnect_attempts=0,
                                 error_cb=_log_error, **self.connect_options),
                    self.timeout)
            except (TimeoutError, OSError, nats.errors.Error) as exc:
                raise BrokerUnavailableError(f"cannot reach NATS at {', '.join(self.servers)}: "
                                             f"{_text(exc)}") from exc
            js: JetStreamContext = nc.jetstream(timeout=self.timeout)
            try:
                await self._check_stream(js)
            except BaseException:
                await nc.close()
                raise
            self._nc, self._js = nc, js
            return js

    async def _check_stream(self, js: JetStreamContext) -> None:
        import nats.js.errors
        from nats.js.api import StreamConfig

        try:
            info = await js.stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            if not self.create_stream:
                raise ConfigError(f"NATS has no stream {self.stream!r} and create_stream is "
                                  f"off") from None
            await js.add_stream(StreamConfig(name=self.stream, subjects=self.subjects,
                                             duplicate_window=self.duplicate_window))
            return
        except TimeoutError as exc:
            raise BrokerUnavailableError(f"NATS did not answer for stream {self.stream!r} "
                                         f"(is JetStream enabled?)") from exc
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
        results: list[Exception | None] = [None] * len(messages)
        futures: list[asyncio.Future[Any]] = []
        try:
            # publish_async pipelines: it sends and hands back the PubAck's future,
            # so a batch shares the connection without a round trip each (2.4x
            # js.publish's rate, measured in benchmarks/relay.py). No wait_stall
            # and no wait_for: each costs an asyncio.wait_for per message; one
            # timer for the batch cancels the PubAcks that do not come.
            for message in messages:
                futures.append(await js.publish_async(
                    message.destination, message.payload, stream=self.stream,
                    headers={**message.headers, "Nats-Msg-Id": message.msg_id}))
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            for i in range(len(futures), len(messages)):
                results[i] = self._refusal(exc, messages[i])
        expired = []

        def expire() -> None:
            expired.append(True)
            for future in futures:
                future.cancel()
        timer = asyncio.get_running_loop().call_later(self.timeout, expire)
        try:
            acks = await asyncio.gather(*futures, return_exceptions=True)
        finally:
            timer.cancel()
        for i, ack in enumerate(acks):
            if isinstance(ack, asyncio.CancelledError):
                if not expired:
                    raise ack                      # the handler itself is being cancelled
                results[i] = self._refusal(TimeoutError(f"no PubAck within {self.timeout:g}s"),
                                           messages[i])
            elif isinstance(ack, BaseException):
                results[i] = self._refusal(ack, messages[i])
            elif ack.duplicate:
                self.duplicates += 1
        return results

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
        if isinstance(exc, (TimeoutError, OSError, nats.errors.Error)):
            return BrokerUnavailableError(f"no PubAck from {self.name}: {_text(exc)}")
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
