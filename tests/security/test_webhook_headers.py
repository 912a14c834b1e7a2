"""Hostile webhook input: ``verify`` raises only WebhookVerificationError, and the
deliverer's ``Retry-After`` parsing never raises (finding F9).

A receiver written as documented (``except WebhookVerificationError: return 400``)
must never answer 500 to unauthenticated input; an endpoint's odd ``Retry-After``
must end in a clean failed attempt with the default backoff.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.consumers.webhooks import (
    RETRY_AFTER_MAX,
    WebhookDeliverer,
    WebhookEndpoint,
    WebhookSubscriptions,
    WebhookVerificationError,
    signature_headers,
    verify,
)
from conveyor.outcomes import RetryAfter
from conveyor.types import Event

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
NOW = 1_700_000_000.0
BODY = b'{"type":"order.paid","data":{}}'


def genuine(body: bytes = BODY) -> dict[str, str]:
    return signature_headers(SECRET, "msg_1", body, timestamp=int(NOW))


def test_a_genuine_request_still_verifies() -> None:
    verify(SECRET, genuine(), BODY, now=NOW)


HOSTILE_TIMESTAMPS = [
    "1" + "0" * 400,              # OverflowError converting to float
    "9" * 5000,                   # ValueError: beyond the int string conversion limit
    "\u0661\u0667\u0660\u0660",   # Arabic-Indic digits
    "\uff11\uff17",               # fullwidth digits
    "\u00b2",                     # superscript two: isdigit() but not a decimal
    "", " 1700000000", "1700000000 ", "+1700000000", "-1", "1e9", "1_700_000_000",
    "1700000000.5", "0x65", "\x00", "1700000000\n",
]


@pytest.mark.parametrize("stamp", HOSTILE_TIMESTAMPS, ids=lambda s: repr(s)[:30])
def test_hostile_timestamps_raise_only_the_verification_error(stamp: str) -> None:
    headers = {**genuine(), "webhook-timestamp": stamp}
    with pytest.raises(WebhookVerificationError):
        verify(SECRET, headers, BODY, now=NOW)


@pytest.mark.parametrize("body", ["{}", BODY.decode(), None, 42, ["x"], {"a": 1}],
                         ids=lambda b: type(b).__name__)
def test_a_body_that_is_not_bytes_is_refused_cleanly(body: Any) -> None:
    with pytest.raises(WebhookVerificationError, match="bytes"):
        verify(SECRET, genuine(), body, now=NOW)


def test_bytearray_and_memoryview_bodies_verify() -> None:
    verify(SECRET, genuine(), bytearray(BODY), now=NOW)
    verify(SECRET, genuine(), memoryview(BODY), now=NOW)


@pytest.mark.parametrize("signature", [
    "v1," + "A" * 1_000_000, " ".join(["v1,AAAA"] * 20_000), "v1,\ud800", "\ud800",
    "v1,\u00e9\u00e9", "v1", ",", "", "v2," + genuine()["webhook-signature"][3:],
])
def test_huge_odd_or_unencodable_signatures_are_refused(signature: str) -> None:
    headers = {**genuine(), "webhook-signature": signature}
    with pytest.raises(WebhookVerificationError):
        verify(SECRET, headers, BODY, now=NOW)


@pytest.mark.parametrize("msg_id", ["\ud800", "m" * 1_000_000, "", "\x00"])
def test_odd_or_unencodable_ids_are_refused(msg_id: str) -> None:
    headers = {**genuine(), "webhook-id": msg_id}
    with pytest.raises(WebhookVerificationError):
        verify(SECRET, headers, BODY, now=NOW)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_missing_headers_are_refused(missing: str) -> None:
    headers = {k: v for k, v in genuine().items() if k != missing}
    with pytest.raises(WebhookVerificationError, match=missing):
        verify(SECRET, headers, BODY, now=NOW)


@pytest.mark.parametrize("name", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_duplicate_headers_are_refused_not_picked_from(name: str) -> None:
    # A Mapping holds each key once, but two spellings of one header name (or a
    # framework whose items() yields every raw header line) give two values:
    # which one is "the" header is ambiguous, so neither is trusted.
    headers = genuine()
    doubled = {**headers, name.title(): headers[name]}
    with pytest.raises(WebhookVerificationError, match="duplicate"):
        verify(SECRET, doubled, BODY, now=NOW)


def test_starlette_style_repeated_header_lines_are_refused() -> None:
    starlette = pytest.importorskip("starlette.datastructures")
    raw = [(k.encode(), v.encode()) for k, v in genuine().items()]
    raw.append((b"webhook-timestamp", str(int(NOW) + 1).encode()))
    with pytest.raises(WebhookVerificationError, match="duplicate"):
        verify(SECRET, starlette.Headers(raw=raw), BODY, now=NOW)


@pytest.mark.parametrize("value", [b"msg_1", 1, None, ["msg_1"]], ids=repr)
def test_header_values_that_are_not_text_are_refused(value: Any) -> None:
    headers: dict[str, Any] = {**genuine(), "webhook-id": value}
    with pytest.raises(WebhookVerificationError):
        verify(SECRET, headers, BODY, now=NOW)


def test_headers_that_are_not_a_mapping_are_refused() -> None:
    with pytest.raises(WebhookVerificationError):
        verify(SECRET, None, BODY, now=NOW)  # type: ignore[arg-type]
    with pytest.raises(WebhookVerificationError):
        verify(SECRET, "webhook-id: x", BODY, now=NOW)  # type: ignore[arg-type]


HEADER_NAMES = st.sampled_from(["webhook-id", "webhook-timestamp", "webhook-signature",
                                "Webhook-Id", "WEBHOOK-TIMESTAMP", "content-type"])
ANY_TEXT = st.text(max_size=60) | st.from_regex(r"[0-9]{1,6000}", fullmatch=True) | \
    st.sampled_from(["1" + "0" * 400, "\u00b2", "v1,\ud800"])
ANY_VALUE = ANY_TEXT | st.binary(max_size=20) | st.integers() | st.none()
ANY_BODY = st.binary(max_size=200) | st.text(max_size=50) | st.none() | st.integers()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers=st.dictionaries(HEADER_NAMES | st.text(max_size=10), ANY_VALUE, max_size=6),
       body=ANY_BODY)
def test_arbitrary_headers_and_bodies_raise_only_the_verification_error(
        headers: dict[str, Any], body: Any) -> None:
    with pytest.raises(WebhookVerificationError):
        verify(SECRET, headers, body, now=NOW)


@settings(max_examples=200, deadline=None)
@given(stamp=ANY_TEXT, signature=ANY_TEXT, msg_id=ANY_TEXT)
def test_arbitrary_values_in_the_three_headers_raise_only_the_verification_error(
        stamp: str, signature: str, msg_id: str) -> None:
    headers = {"webhook-id": msg_id, "webhook-timestamp": stamp, "webhook-signature": signature}
    with pytest.raises(WebhookVerificationError):
        verify(SECRET, headers, BODY, now=NOW)


# ------------------------------------------------------------- Retry-After

ENDPOINT = WebhookEndpoint(name="crm", url="https://crm.example/hooks", secret=SECRET,
                           topics=("order.*",))


def deliver(retry_after: str) -> RetryAfter:
    """One delivery to an endpoint answering 503 with ``Retry-After: <retry_after>``."""
    def answer(request: httpx.Request) -> httpx.Response:
        # As sent on the wire: UTF-8 bytes, which httpx decodes back to the text.
        return httpx.Response(503, headers=[(b"retry-after", retry_after.encode())])

    deliverer = WebhookDeliverer(WebhookSubscriptions([ENDPOINT]),
                                 transport=httpx.MockTransport(answer))
    event = Event(id=7, topic="webhook.deliver", tenant="acme", attempt=2, max_attempts=8,
                  payload_text='{"endpoint": "crm", "type": "order.paid", "data": {}}')

    async def run() -> RetryAfter:
        try:
            with pytest.raises(RetryAfter) as caught:
                await deliverer(event)
        finally:
            await deliverer.aclose()
        return caught.value

    return asyncio.run(run())


@pytest.mark.parametrize("value", ["\u00b2", "\u0661\u0662", "\uff11\uff12", "1e3", "-5", "+5",
                                   "5.5", "nan", "inf", "0x10", "soon", " ", "5, 6",
                                   "Wed, 99 Foo 2026 99:99:99 GMT", "\u0663\u0660\u0660"],
                         ids=lambda v: repr(v)[:30])
def test_odd_retry_after_values_fall_back_to_the_endpoint_backoff(value: str) -> None:
    signal = deliver(value)
    assert signal.seconds == pytest.approx(ENDPOINT.backoff.delay(2), rel=0.25)
    assert "503" in str(signal)


def test_ascii_digit_retry_after_is_honoured_and_capped() -> None:
    assert deliver("120").seconds == 120
    assert deliver("0").seconds == 0
    assert deliver("99999999999").seconds == RETRY_AFTER_MAX
    assert deliver("9" * 5000).seconds == RETRY_AFTER_MAX


def test_http_date_retry_after_is_honoured() -> None:
    when = datetime.now(UTC) + timedelta(seconds=90)
    delay = deliver(format_datetime(when, usegmt=True)).seconds
    assert 85 <= delay <= 91
    past = datetime.now(UTC) - timedelta(days=1)
    assert deliver(format_datetime(past, usegmt=True)).seconds == 0
