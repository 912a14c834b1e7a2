"""Standard Webhooks signing and verifying: both halves of a webhook's signature.

Per https://www.standardwebhooks.com, every request carries ``webhook-id``
(stable across retries), ``webhook-timestamp`` (integer Unix seconds) and
``webhook-signature`` = ``v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">``,
keyed by the secret ``whsec_<base64 key>``. :func:`signature_headers` is the
sender's half, :func:`verify` the receiver's.

Kept apart from the fan-out and the delivery (:mod:`conveyor.consumers.webhooks`,
which re-exports all of it) because a receiver needs only this: the standard
library, no database, no producer and no HTTP client.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping

from conveyor.errors import ConfigError, ConveyorError

SECRET_PREFIX = "whsec_"
TOLERANCE_DEFAULT = 300.0
TIMESTAMP_DIGITS_MAX = 12


class WebhookVerificationError(ConveyorError):
    """A webhook request failed verification: bad or missing headers, signature or timestamp."""


def generate_secret(size: int = 32) -> str:
    """A new random secret, ``whsec_<base64 of size bytes>``. Defaults to 32 bytes."""
    if not 24 <= size <= 64:
        raise ConfigError(f"expected size to be 24..64 bytes, got {size!r}")
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(size)).decode()


def secret_key(secret: str | bytes) -> bytes:
    """The HMAC key of a secret: ``whsec_<base64>`` decoded, or raw bytes as given."""
    if isinstance(secret, bytes):
        key = secret
    else:
        text = secret.removeprefix(SECRET_PREFIX)
        try:
            key = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError("expected a webhook secret 'whsec_<base64>', got a value that "
                              "is not base64") from None
    if len(key) < 16:
        raise ConfigError(f"expected a webhook secret of at least 16 bytes, got {len(key)}")
    return key


def sign(secret: str | bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: ``"v1,<base64 HMAC-SHA256>"``.

    Example::

        sign("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_1", 1614265330, b'{"a":1}')
    """
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signature_headers(secret: str | bytes, msg_id: str, body: bytes, *,
                      timestamp: int | None = None) -> dict[str, str]:
    """The three headers for one request; ``timestamp`` defaults to now."""
    ts = int(time.time()) if timestamp is None else int(timestamp)
    return {"webhook-id": msg_id, "webhook-timestamp": str(ts),
            "webhook-signature": sign(secret, msg_id, ts, body)}


def _header(headers: Mapping[str, str], name: str) -> str:
    """The one value of header ``name`` (any case); refused when missing, repeated or not text.

    Two values for one name (two spellings in a dict, or a framework whose
    ``items()`` yields every raw header line) make "the" header ambiguous, so
    neither is trusted.
    """
    found: list[object] = []
    try:
        for key, value in headers.items():
            if isinstance(key, str | bytes) and _lower_name(key) == name:
                found.append(value)
    except (AttributeError, TypeError, ValueError):
        raise WebhookVerificationError(
            f"expected the request headers as a mapping, got {type(headers).__name__}") from None
    if not found:
        raise WebhookVerificationError(f"missing header {name!r}")
    if len(found) > 1:
        raise WebhookVerificationError(f"duplicate header {name!r}: {len(found)} values")
    only = found[0]
    if not isinstance(only, str):
        raise WebhookVerificationError(f"header {name!r} is a {type(only).__name__}, not text")
    return only


def _lower_name(key: str | bytes) -> str:
    text = key.decode("latin-1") if isinstance(key, bytes) else key
    return text.lower()


def _encoded(name: str, value: str) -> bytes:
    try:
        return value.encode()
    except UnicodeEncodeError:
        raise WebhookVerificationError(f"header {name!r} is not valid text") from None


def _timestamp(stamp: str) -> int:
    # Unix seconds have 10 digits until the year 2286; anything much longer is
    # hostile, and would overflow a float or hit int()'s digit limit.
    if not stamp.isascii() or not stamp.isdigit() or len(stamp) > TIMESTAMP_DIGITS_MAX:
        raise WebhookVerificationError(f"invalid webhook-timestamp {stamp[:20]!r}: expected "
                                       f"1-{TIMESTAMP_DIGITS_MAX} ASCII digits")
    return int(stamp)


def verify(secret: str | bytes, headers: Mapping[str, str], body: bytes, *,
           tolerance: float = TOLERANCE_DEFAULT, now: float | None = None) -> None:
    """Check a received webhook; raise :class:`WebhookVerificationError` if it is not genuine.

    Refuses a timestamp more than ``tolerance`` seconds in the past or future
    (replays), and any body, id or timestamp that does not match one of the
    space-separated ``v1`` signatures (so secrets can be rotated). Compares in
    constant time. ``tolerance`` defaults to 300 s; ``now`` to the clock.

    Whatever the headers and body hold (missing, repeated or non-text headers,
    huge or non-ASCII values, a body that is not bytes), the only exception is
    :class:`WebhookVerificationError`, so a receiver can answer 400 to all of it.

    Example::

        verify(secret, request.headers, await request.body())
    """
    if not isinstance(body, bytes | bytearray | memoryview):
        raise WebhookVerificationError(
            f"expected the raw request body as bytes, got {type(body).__name__}; the "
            "signature covers the bytes as received, so pass them undecoded")
    msg_id = _header(headers, "webhook-id")
    id_bytes = _encoded("webhook-id", msg_id)
    if not msg_id:
        raise WebhookVerificationError("empty header 'webhook-id'")
    timestamp = _timestamp(_header(headers, "webhook-timestamp"))
    signatures = _header(headers, "webhook-signature")
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        raise WebhookVerificationError(
            f"webhook-timestamp {timestamp} is {current - timestamp:+.0f}s from now, "
            f"outside the {tolerance:g}s tolerance")
    signed = id_bytes + f".{timestamp}.".encode() + bytes(body)
    expected = base64.b64encode(hmac.new(secret_key(secret), signed, hashlib.sha256).digest())
    for candidate in signatures.split():
        version, _, value = candidate.partition(",")
        if version == "v1" and value.isascii() and hmac.compare_digest(value.encode(), expected):
            return
    raise WebhookVerificationError(f"no valid signature for webhook {msg_id[:80]!r}")
