"""Redis Streams publisher (extra ``conveyor[redis]``, redis-py).

Redis has no publisher confirm beyond the reply to XADD, and before 8.6 no
idempotent XADD; so each message is added by a Lua script, atomically: if a
dedup key for its message id exists, the script answers with the entry id
stored there and adds nothing; otherwise it adds the entry and keeps its id
under the dedup key for ``dedup_ttl`` seconds. A retry after a lost reply or
a replay within that time adds nothing. The script names both keys, so on a
Redis Cluster the stream key and the dedup key must hash to the same slot:
put a hash tag (``{...}``) in both (``key_prefix``, the destination).

Entry fields: ``payload`` (the JSON text) and the message headers
(``conveyor-event-id``, ``conveyor-topic``, ``conveyor-tenant``,
``conveyor-attempt``, ``traceparent``, ``tracestate``).
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
    from redis.asyncio import Redis
    from redis.commands.core import AsyncScript

# KEYS[1] the stream, KEYS[2] the dedup key; ARGV[1] the dedup TTL in ms,
# ARGV[2] MAXLEN (0: none), then field, value pairs. Returns {entry id, 1 if
# it was there already}.
_XADD_ONCE = """
local seen = redis.call('GET', KEYS[2])
if seen then
    return {seen, 1}
end
local args = {'XADD', KEYS[1]}
local maxlen = tonumber(ARGV[2])
if maxlen > 0 then
    table.insert(args, 'MAXLEN')
    table.insert(args, '~')
    table.insert(args, maxlen)
end
table.insert(args, '*')
for i = 3, #ARGV do
    table.insert(args, ARGV[i])
end
local id = redis.call(unpack(args))
redis.call('SET', KEYS[2], id, 'PX', ARGV[1])
return {id, 0}
"""

DEDUP_TTL_DEFAULT = 86400.0

# The most scripts one pipeline sends.
PIPELINE_MAX = 500

# Redis's own default proto-max-bulk-len, used where CONFIG GET is not allowed.
BULK_MAX_DEFAULT = 512 * 1024 * 1024


def _redis() -> Any:
    try:
        import redis.asyncio
        import redis.exceptions
    except ImportError as exc:
        raise MissingExtraError("conveyor.relay.RedisStreamPublisher", "redis",
                                module=exc.name) from exc
    return redis


class RedisStreamPublisher:
    """Add each message to a Redis stream once (XADD through a Lua script with a dedup key).

    Args:
        url: the Redis URL.
        maxlen: trim each stream to about this many entries (``MAXLEN ~``);
            None keeps every entry. Defaults to None.
        dedup_ttl: seconds a message id is remembered. Defaults to 86400.0.
        key_prefix: the dedup keys' prefix. Defaults to "conveyor:relayed:".
        timeout: seconds to wait for Redis (then it counts as unavailable:
            the event is put back, no attempt spent). Defaults to 5.0.
    """

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, maxlen: int | None = None,
                 dedup_ttl: float = DEDUP_TTL_DEFAULT, key_prefix: str = "conveyor:relayed:",
                 timeout: float = 5.0) -> None:
        if maxlen is not None and not (isinstance(maxlen, int) and not isinstance(maxlen, bool)
                                       and maxlen > 0):
            raise ConfigError(f"expected maxlen to be a positive int or None, got {maxlen!r}")
        ttl = seconds("dedup_ttl", dedup_ttl, least=1, most=365 * 86400)
        wait = seconds("timeout", timeout, least=0, most=TIMEOUT_MAX)
        self.url = url
        self.maxlen = maxlen
        self.dedup_ttl = ttl
        self.key_prefix = key_prefix
        self.timeout = wait
        self.name = "Redis streams"
        self.duplicates = 0          # messages whose id was known: nothing added
        self._client: Redis | None = None
        self._script: AsyncScript | None = None
        # The publishes of the running handlers wait here for the one task that
        # sends them, a pipeline at a time on one connection: a round trip per
        # batch instead of one (and a pooled connection) per message.
        self._waiting: list[tuple[RelayMessage, asyncio.Future[Any]]] = []
        self._sender: asyncio.Task[None] | None = None
        # The server's proto-max-bulk-len, read once per connection: a longer
        # argument makes Redis drop the connection, failing the whole pipeline.
        self._bulk_max: int | None = None

    def __repr__(self) -> str:
        return f"RedisStreamPublisher(key_prefix={self.key_prefix!r})"

    def check_destination(self, destination: str) -> str | None:
        if len(destination.encode()) > 512 * 1024 * 1024:
            return "the stream key is too long"
        return None

    async def start(self) -> None:
        redis = _redis()
        client = self._connected()
        try:
            await client.ping()
        except (TimeoutError, OSError, redis.exceptions.ConnectionError,
                redis.exceptions.TimeoutError) as exc:
            raise BrokerUnavailableError(f"cannot reach Redis: {exc}") from exc

    def _connected(self) -> Redis:
        if self._client is None:
            redis = _redis()
            self._client = redis.asyncio.Redis.from_url(
                self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout)
            self._script = self._client.register_script(_XADD_ONCE)
        return self._client

    async def publish(self, message: RelayMessage) -> None:
        self._connected()
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((message, done))
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_all())
        _, seen = await done
        if seen:
            self.duplicates += 1

    async def publish_many(self, messages: list[RelayMessage]) -> list[Exception | None]:
        """Publish a batch in pipelines; what went wrong for each message, or None."""
        self._connected()
        loop = asyncio.get_running_loop()
        waits = [(m, loop.create_future()) for m in messages]
        self._waiting.extend(waits)
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_all())
        results: list[Exception | None] = []
        for _, done in waits:
            try:
                _, seen = await done
            except (BrokerUnavailableError, PublishRejectedError) as exc:
                results.append(exc)
                continue
            if seen:
                self.duplicates += 1
            results.append(None)
        return results

    async def _send_all(self) -> None:
        try:
            while self._waiting:
                # One loop round: the handlers started with this one add theirs.
                await asyncio.sleep(0)
                batch, self._waiting = self._waiting[:PIPELINE_MAX], self._waiting[PIPELINE_MAX:]
                await self._send(batch)
        finally:
            self._sender = None

    async def _send(self, batch: list[tuple[RelayMessage, asyncio.Future[Any]]]) -> None:
        redis = _redis()
        client, script = self._client, self._script
        assert client is not None and script is not None
        try:
            bulk_max = self._bulk_max or await self._read_bulk_max(client)
            pipe = client.pipeline(transaction=False)
            sent = []
            for message, done in batch:
                too_big = _too_big(message, bulk_max)
                if too_big is not None:
                    if not done.done():
                        done.set_exception(too_big)
                    continue
                await script(keys=[message.destination, self._dedup_key(message)],
                             args=self._args(message), client=pipe)
                sent.append((message, done))
            replies = await pipe.execute(raise_on_error=False) if sent else []
        except (TimeoutError, OSError, redis.exceptions.ConnectionError,
                redis.exceptions.TimeoutError) as exc:
            self._bulk_max = None          # read again: the server may have changed
            error = BrokerUnavailableError(f"no reply from Redis: {exc}")
            for _, done in batch:
                if not done.done():
                    done.set_exception(error)
            return
        for (message, done), reply in zip(sent, replies, strict=True):
            if done.done():
                continue                       # its handler was cancelled meanwhile
            if isinstance(reply, Exception):
                done.set_exception(_refusal(reply, message))
            else:
                done.set_result(reply)

    def _dedup_key(self, message: RelayMessage) -> str:
        return f"{self.key_prefix}{message.msg_id}"

    def _args(self, message: RelayMessage) -> list[Any]:
        fields: list[str | bytes] = [b"payload", message.payload]
        for key, value in message.headers.items():
            fields += [key, value]
        return [int(self.dedup_ttl * 1000), self.maxlen or 0, *fields]

    async def _read_bulk_max(self, client: Redis) -> int:
        """The server's proto-max-bulk-len, or Redis's default where CONFIG is not allowed."""
        redis = _redis()
        try:
            value = (await client.config_get("proto-max-bulk-len")).get("proto-max-bulk-len")
            self._bulk_max = int(value) if value else BULK_MAX_DEFAULT
        except (redis.exceptions.ResponseError, ValueError):
            # A managed Redis may rename or forbid CONFIG (NOPERM is a ResponseError).
            self._bulk_max = BULK_MAX_DEFAULT
        return self._bulk_max

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


# Replies that say Redis cannot take a write now, not that this one is wrong:
# out of memory under noeviction, a script or a replica busy, a dataset
# loading after a restart (redis-py turns that one into BusyLoadingError).
_TRANSIENT = ("OOM", "BUSY", "LOADING", "MASTERDOWN", "READONLY", "TRYAGAIN", "NOREPLICAS")


def _too_big(message: RelayMessage, bulk_max: int) -> Exception | None:
    """The refusal of a message with an argument over proto-max-bulk-len, or None."""
    size = max(len(message.payload), len(message.destination.encode()),
               *(len(value.encode()) for value in message.headers.values()))
    if size <= bulk_max:
        return None
    return PublishRejectedError(
        f"Redis refused the entry for {message.destination!r}: it has {size} bytes in one "
        f"argument, over the server's proto-max-bulk-len of {bulk_max} bytes")


def _refusal(reply: Exception, message: RelayMessage) -> Exception:
    redis = _redis()
    if isinstance(reply, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)) \
            or str(reply).startswith(_TRANSIENT):
        return BrokerUnavailableError(f"Redis cannot take the entry for "
                                      f"{message.destination!r} now: {reply}")
    return PublishRejectedError(f"Redis refused the entry for {message.destination!r}: {reply}")
