"""Signed webhooks: deliver any topic to subscribed HTTP endpoints (Standard Webhooks).

Three parts:

* **Signing and verifying** per https://www.standardwebhooks.com: every request
  carries ``webhook-id`` (stable across retries), ``webhook-timestamp`` (integer
  Unix seconds) and ``webhook-signature`` = ``v1,<base64 HMAC-SHA256 of
  "<id>.<timestamp>.<body>">``, keyed by the secret ``whsec_<base64 key>``.
  :func:`verify` is the receiver's half. They live in
  :mod:`conveyor.consumers.webhook_signing` (the standard library only, for a
  receiver) and are re-exported here.
* **Fan-out**: :class:`WebhookFanout` turns one event into one ``webhook.deliver``
  event per subscribed endpoint, with idempotency key ``webhook:<event id>:<endpoint>``,
  so a redelivered source event fans out nothing new.
* **Delivery**: :class:`WebhookDeliverer` POSTs one signed request per
  ``webhook.deliver`` event. Endpoints retry independently (one event each) on
  their own backoff, redirects are never followed, and ``410 Gone`` stops at once.

Example::

    endpoints = WebhookSubscriptions([
        WebhookEndpoint(name="crm", url="https://crm.example/hooks", secret=CRM_SECRET,
                        topics=("order.*",)),
    ])
    router = Router()
    WebhookFanout(dsn, endpoints).attach(router)       # routes "order.*"
    WebhookDeliverer(endpoints).attach(router)         # routes "webhook.deliver"

    # the receiver
    verify(CRM_SECRET, request.headers, await request.body())   # raises if forged
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import json
import logging
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import psycopg

from conveyor.config import ProducerConfig
from conveyor.consumers.webhook_signing import (
    SECRET_PREFIX,
    TIMESTAMP_DIGITS_MAX,
    TOLERANCE_DEFAULT,
    WebhookVerificationError,
    generate_secret,
    secret_key,
    sign,
    signature_headers,
    verify,
)
from conveyor.db.connect import connect_async
from conveyor.errors import ConfigError, ConveyorError, MissingExtraError
from conveyor.outcomes import Cancel, PermanentFailure, RetryAfter
from conveyor.patterns import check_topic_pattern, matches_any
from conveyor.producer import AsyncProducer
from conveyor.retry import BackoffPolicy, RetryPolicy
from conveyor.router import Route, Router
from conveyor.types import Event

if TYPE_CHECKING:
    # Signing, verifying and the fan-out need no httpx: only the deliverer does.
    import httpx

log = logging.getLogger(__name__)

__all__ = ["BACKOFF_DEFAULT", "DELIVER_TOPIC", "MAX_ATTEMPTS_DEFAULT", "RETRY_AFTER_MAX",
           "SECRET_PREFIX", "TIMEOUT_DEFAULT", "TIMESTAMP_DIGITS_MAX", "TOLERANCE_DEFAULT",
           "WebhookDeliverer", "WebhookEndpoint", "WebhookFanout", "WebhookSubscriptions",
           "WebhookVerificationError", "fanout_key", "generate_secret", "message_id",
           "secret_key", "sign", "signature_headers", "verify", "webhook_body"]

DELIVER_TOPIC = "webhook.deliver"
TIMEOUT_DEFAULT = 15.0
MAX_ATTEMPTS_DEFAULT = 8
# 5 s, 30 s, 3 min, 18 min, 1.8 h, then 10 h: about a day in 8 attempts, close to
# the schedule Standard Webhooks' reference implementation (Svix) uses.
BACKOFF_DEFAULT = BackoffPolicy(base_delay=5.0, factor=6.0, max_delay=36000.0, jitter=0.1)
RETRY_AFTER_MAX = 3600.0
_ENDPOINT_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_ASCII_DIGITS_RE = re.compile(r"[0-9]+")


@dataclass(frozen=True, kw_only=True, slots=True)
class WebhookEndpoint:
    """One subscriber.

    Attributes:
        name: stable identifier, part of every idempotency key, e.g. ``"crm"``.
        url: where to POST; http(s), from configuration only, never from a payload.
        secret: ``whsec_<base64>`` shared with the receiver.
        topics: topic patterns delivered (``"order.created"``, ``"order.*"``, ``"*"``).
        max_attempts: attempts per delivery before it is parked ``failed``. Defaults to 8.
        backoff: waits between this endpoint's attempts. Defaults to 5 s growing x6 up
            to 10 h (about a day in 8 attempts).
        timeout: seconds one request may take. Defaults to 15.
    """

    name: str
    url: str
    secret: str = field(repr=False)
    topics: tuple[str, ...]
    max_attempts: int = MAX_ATTEMPTS_DEFAULT
    backoff: RetryPolicy = BACKOFF_DEFAULT
    timeout: float = TIMEOUT_DEFAULT

    def __post_init__(self) -> None:
        if not _ENDPOINT_RE.fullmatch(self.name):
            raise ConfigError(f"invalid webhook endpoint name {self.name!r}: expected lowercase "
                              "letters, digits, '-' or '_'")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"expected endpoint {self.name!r} url to be http(s), got {self.url!r}")
        secret_key(self.secret)
        topics = (self.topics,) if isinstance(self.topics, str) else tuple(self.topics)
        if not topics:
            raise ConfigError(f"endpoint {self.name!r} subscribes to no topics")
        try:
            object.__setattr__(self, "topics", tuple(check_topic_pattern(t) for t in topics))
        except ConveyorError as exc:
            raise ConfigError(f"endpoint {self.name!r}: {exc}") from None
        if not isinstance(self.max_attempts, int) or not 1 <= self.max_attempts <= 1000:
            raise ConfigError(f"expected max_attempts to be 1..1000, got {self.max_attempts!r}")
        if not self.timeout > 0:
            raise ConfigError(f"expected timeout to be > 0, got {self.timeout!r}")

    def wants(self, topic: str) -> bool:
        return topic != DELIVER_TOPIC and matches_any(self.topics, topic)


class WebhookSubscriptions:
    """The endpoints declared in code, by name.

    Example::

        subscriptions = WebhookSubscriptions([WebhookEndpoint(name="crm", ...)])
        subscriptions.matching("order.created")       # [WebhookEndpoint(name='crm', ...)]
    """

    def __init__(self, endpoints: Iterable[WebhookEndpoint]) -> None:
        self._endpoints: dict[str, WebhookEndpoint] = {}
        for endpoint in endpoints:
            if endpoint.name in self._endpoints:
                raise ConfigError(f"webhook endpoint {endpoint.name!r} is declared twice")
            self._endpoints[endpoint.name] = endpoint

    @property
    def endpoints(self) -> tuple[WebhookEndpoint, ...]:
        return tuple(self._endpoints.values())

    def get(self, name: str) -> WebhookEndpoint | None:
        return self._endpoints.get(name)

    def matching(self, topic: str) -> list[WebhookEndpoint]:
        return [e for e in self._endpoints.values() if e.wants(topic)]

    @property
    def patterns(self) -> list[str]:
        """Every distinct subscribed pattern, in declaration order."""
        out: list[str] = []
        for endpoint in self._endpoints.values():
            out.extend(p for p in endpoint.topics if p not in out)
        return out


def fanout_key(event_id: int, endpoint: str) -> str:
    """Idempotency key of one endpoint's delivery of one source event."""
    return f"webhook:{event_id}:{endpoint}"


def message_id(tenant: str | None, source_event_id: int) -> str:
    """The ``webhook-id``: one per source event, the same for every endpoint and retry."""
    return f"msg_{tenant or 'default'}_{source_event_id}"


class WebhookFanout:
    """Handler turning each event into one ``webhook.deliver`` event per matching endpoint.

    Opens its own connections to ``conninfo`` (the database the events are in).

    Args:
        conninfo: the database to enqueue deliveries into.
        subscriptions: who wants what.
        producer_config: schema and limits. Defaults to ``ProducerConfig()``.
    """

    def __init__(self, conninfo: str, subscriptions: WebhookSubscriptions, *,
                 producer_config: ProducerConfig | None = None) -> None:
        self.conninfo = conninfo
        self.subscriptions = subscriptions
        self._producer = AsyncProducer(producer_config)
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._idle_max = 4
        self._closing: set[asyncio.Task[None]] = set()

    def attach(self, router: Router) -> list[Route]:
        """Route every subscribed pattern to this fan-out."""
        return [router.add(pattern, self) for pattern in self.subscriptions.patterns]

    async def __call__(self, event: Event) -> None:
        await self.fan_out(event)

    async def fan_out(self, event: Event) -> list[int]:
        """Enqueue the deliveries of ``event`` in one transaction; ids of the delivery events.

        A handler that does its own work on a topic can call this too.
        """
        endpoints = self.subscriptions.matching(event.topic)
        if not endpoints:
            return []
        conn = await self._acquire()
        try:
            async with conn.transaction():
                ids = [await self._producer.enqueue(
                    conn, DELIVER_TOPIC, _delivery_payload(event, e.name), tenant=event.tenant,
                    idempotency_key=fanout_key(event.id, e.name), max_attempts=e.max_attempts)
                    for e in endpoints]
        except BaseException:
            await conn.close()
            raise
        self._release(conn)
        return ids

    async def _acquire(self) -> psycopg.AsyncConnection[Any]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return await connect_async(self.conninfo, autocommit=True,
                                   application_name="conveyor-webhook-fanout")

    def _release(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if len(self._idle) < self._idle_max and not conn.closed:
            self._idle.append(conn)
            return
        # Keep a reference until the close finishes, or the task may be collected.
        task = asyncio.get_running_loop().create_task(conn.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        """Close the idle connections."""
        while self._idle:
            await self._idle.pop().close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _delivery_payload(event: Event, endpoint: str) -> dict[str, Any]:
    return {"endpoint": endpoint, "message_id": message_id(event.tenant, event.id),
            "type": event.topic, "source_event_id": event.id,
            "timestamp": event.created_at.isoformat() if event.created_at else None,
            "data": event.payload}


def webhook_body(payload: Mapping[str, Any]) -> bytes:
    """The request body: ``{"type", "timestamp", "data"}`` as compact JSON, stable across retries."""
    return json.dumps({"type": payload["type"], "timestamp": payload.get("timestamp"),
                       "data": payload.get("data")}, separators=(",", ":"),
                      ensure_ascii=False).encode()


def _retry_after(response: httpx.Response, now: float | None = None) -> float | None:
    """Seconds to wait from ``Retry-After`` (ASCII digits or an HTTP date); ``None`` otherwise.

    ``str.isdigit`` is not enough: ``"²"`` and ``"١٢"`` pass it and then fail
    ``float()``. Anything odd means "no hint": the endpoint's backoff applies.
    """
    value = response.headers.get("retry-after", "").strip()
    if _ASCII_DIGITS_RE.fullmatch(value):
        return min(float(value), RETRY_AFTER_MAX)
    try:
        when = email.utils.parsedate_to_datetime(value)
        if when.tzinfo is None:    # "-0000": the date is in UTC (RFC 5322)
            when = when.replace(tzinfo=datetime.UTC)
        at = when.timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    current = time.time() if now is None else now
    return min(max(at - current, 0.0), RETRY_AFTER_MAX)


class WebhookDeliverer:
    """Handler for ``webhook.deliver``: one signed POST per event, per-endpoint retries.

    A 2xx answer is success. ``410 Gone`` parks the delivery ``failed`` at once. Any
    other answer (redirects included: they are never followed) or a transport
    failure spends the attempt and waits the endpoint's backoff, or ``Retry-After``
    (capped at an hour) when the endpoint sends one. A delivery for an endpoint no
    longer declared is cancelled.

    Args:
        subscriptions: the endpoints, looked up by name at delivery time.
        transport: an httpx transport, for tests. Defaults to a real network transport.
    """

    def __init__(self, subscriptions: WebhookSubscriptions, *,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        try:
            import httpx
        except ImportError as exc:
            raise MissingExtraError("the webhook deliverer", "http", module=exc.name) from exc
        self.subscriptions = subscriptions
        self._transport_error = httpx.HTTPError
        self._http = httpx.AsyncClient(transport=transport, follow_redirects=False,
                                       trust_env=False, timeout=TIMEOUT_DEFAULT)

    def attach(self, router: Router) -> Route:
        """Route ``webhook.deliver`` to this deliverer."""
        longest = max((e.timeout for e in self.subscriptions.endpoints), default=TIMEOUT_DEFAULT)
        return router.add(DELIVER_TOPIC, self, timeout=longest + 5.0)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __call__(self, event: Event) -> None:
        payload = event.payload
        if not isinstance(payload, dict) or not isinstance(payload.get("endpoint"), str) \
                or not isinstance(payload.get("type"), str):
            raise PermanentFailure(f"event {event.id} is not a webhook delivery")
        endpoint = self.subscriptions.get(payload["endpoint"])
        if endpoint is None:
            raise Cancel(f"webhook endpoint {payload['endpoint']!r} is no longer declared")
        body = webhook_body(payload)
        msg_id = str(payload.get("message_id") or message_id(event.tenant, event.id))
        headers = {"content-type": "application/json", "user-agent": "conveyor-webhooks",
                   **signature_headers(endpoint.secret, msg_id, body)}
        try:
            response = await self._http.post(endpoint.url, content=body, headers=headers,
                                             timeout=endpoint.timeout)
        except self._transport_error as exc:
            raise RetryAfter(endpoint.backoff.delay(event.attempt),
                             f"endpoint {endpoint.name!r} unreachable: "
                             f"{type(exc).__name__}: {exc}") from exc
        self._judge(endpoint, event, response)

    def _judge(self, endpoint: WebhookEndpoint, event: Event, response: httpx.Response) -> None:
        status = response.status_code
        if 200 <= status < 300:
            return
        what = f"endpoint {endpoint.name!r} answered {status}"
        if status == 410:
            raise PermanentFailure(what + " (gone)")
        if 300 <= status < 400:
            what += f" redirecting to {response.headers.get('location', '?')[:200]!r}; " \
                    "redirects are not followed"
        wait = _retry_after(response)
        raise RetryAfter(endpoint.backoff.delay(event.attempt) if wait is None else wait, what)
