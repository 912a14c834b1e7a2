"""Signed webhooks: the signature checked by an independent implementation, fan-out and delivery
to a real receiver on loopback."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from examples.workflow_engine.server import ThreadedServer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from conveyor import CommittingProducer, LinearBackoff, Router
from conveyor.consumers.webhooks import (
    DELIVER_TOPIC,
    WebhookDeliverer,
    WebhookEndpoint,
    WebhookFanout,
    WebhookSubscriptions,
    WebhookVerificationError,
    fanout_key,
    generate_secret,
    sign,
    signature_headers,
    verify,
)
from conveyor.errors import ConfigError
from conveyor.types import Event
from waiting import wait_until

from .conftest import new_worker, running, show, state_of

# The test vector published with the Standard Webhooks specification.
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def independent_signature(secret: str, msg_id: str, timestamp: str, body: bytes) -> str:
    """Written from the specification, sharing no code with conveyor.consumers.webhooks:
    the key is the base64 after 'whsec_'; the signed content is id.timestamp.body;
    the signature is 'v1,' + base64(HMAC-SHA256(key, content))."""
    key = base64.b64decode(secret.split("_", 1)[1])
    content = msg_id.encode() + b"." + timestamp.encode() + b"." + body
    return "v1," + base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode()


def independent_verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    expected = independent_signature(secret, headers["webhook-id"], headers["webhook-timestamp"],
                                      body)
    fresh = abs(time.time() - int(headers["webhook-timestamp"])) <= 300
    return fresh and any(hmac.compare_digest(s, expected)
                         for s in headers["webhook-signature"].split(" "))


# -------------------------------------------------------------- signatures


def test_the_independent_implementation_reproduces_the_spec_vector() -> None:
    assert independent_signature(SPEC_SECRET, SPEC_ID, str(SPEC_TIMESTAMP), SPEC_BODY) == \
        SPEC_SIGNATURE


def test_sign_matches_the_spec_vector() -> None:
    assert sign(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE


def test_signatures_agree_with_the_independent_implementation_for_fresh_secrets() -> None:
    for size in (24, 32, 64):
        secret = generate_secret(size)
        body = json.dumps({"size": size, "text": "grüße"}).encode()
        headers = signature_headers(secret, f"msg_{size}", body)
        assert independent_verify(secret, headers, body)
        assert headers["webhook-signature"] == independent_signature(
            secret, f"msg_{size}", headers["webhook-timestamp"], body)


def test_verify_accepts_the_spec_vector_at_its_time() -> None:
    headers = {"webhook-id": SPEC_ID, "webhook-timestamp": str(SPEC_TIMESTAMP),
               "webhook-signature": SPEC_SIGNATURE}
    verify(SPEC_SECRET, headers, SPEC_BODY, now=SPEC_TIMESTAMP + 10)


def test_verify_accepts_what_the_independent_implementation_signed() -> None:
    secret, body, stamp = generate_secret(), b'{"order": 7}', str(int(time.time()))
    headers = {"Webhook-Id": "msg_7", "Webhook-Timestamp": stamp,
               "Webhook-Signature": independent_signature(secret, "msg_7", stamp, body)}
    verify(secret, headers, body)


def _signed(secret: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    return signature_headers(secret, "msg_1", body, timestamp=timestamp)


def test_a_tampered_body_is_refused() -> None:
    secret = generate_secret()
    headers = _signed(secret, b'{"amount": 10}')
    with pytest.raises(WebhookVerificationError, match="no valid signature for webhook 'msg_1'"):
        verify(secret, headers, b'{"amount": 1000}')


def test_a_tampered_id_is_refused() -> None:
    secret = generate_secret()
    headers = {**_signed(secret, b"{}"), "webhook-id": "msg_2"}
    with pytest.raises(WebhookVerificationError, match="no valid signature"):
        verify(secret, headers, b"{}")


def test_a_wrong_secret_is_refused() -> None:
    headers = _signed(generate_secret(), b"{}")
    with pytest.raises(WebhookVerificationError, match="no valid signature"):
        verify(generate_secret(), headers, b"{}")


@pytest.mark.parametrize("offset", [-301, 301, -86400])
def test_timestamps_outside_the_tolerance_are_refused(offset: int) -> None:
    secret, now = generate_secret(), time.time()
    headers = _signed(secret, b"{}", timestamp=int(now) + offset)
    with pytest.raises(WebhookVerificationError, match="outside the 300s tolerance"):
        verify(secret, headers, b"{}", now=now)


def test_a_timestamp_within_the_tolerance_is_accepted() -> None:
    secret, now = generate_secret(), time.time()
    verify(secret, _signed(secret, b"{}", timestamp=int(now) - 299), b"{}", now=now)


def test_missing_or_malformed_headers_are_refused() -> None:
    secret = generate_secret()
    headers = _signed(secret, b"{}")
    with pytest.raises(WebhookVerificationError, match="missing header 'webhook-signature'"):
        verify(secret, {k: v for k, v in headers.items() if k != "webhook-signature"}, b"{}")
    with pytest.raises(WebhookVerificationError, match=r"invalid webhook-timestamp '12\.5'"):
        verify(secret, {**headers, "webhook-timestamp": "12.5"}, b"{}")


def test_any_of_several_signatures_may_match_during_rotation() -> None:
    old, new = generate_secret(), generate_secret()
    body = b"{}"
    headers = _signed(new, body)
    stamp = int(headers["webhook-timestamp"])
    headers["webhook-signature"] = f"{sign(old, 'msg_1', stamp, body)} {headers['webhook-signature']}"
    verify(new, headers, body)
    verify(old, headers, body)


def test_secrets_must_be_base64_and_long_enough() -> None:
    with pytest.raises(ConfigError, match="not base64"):
        sign("whsec_not base64!", "m", 1, b"")
    with pytest.raises(ConfigError, match="at least 16 bytes, got 5"):
        sign("whsec_" + base64.b64encode(b"short").decode(), "m", 1, b"")


# ---------------------------------------------------------------- receiver


@dataclass
class Receiver:
    """A loopback HTTP server recording each request and answering from a script per path."""

    server: ThreadedServer
    script: dict[str, list[int]] = field(default_factory=dict)
    received: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, name: str) -> str:
        return f"{self.server.url}/hooks/{name}"

    def bodies(self, name: str) -> list[bytes]:
        with self.lock:
            return [body for path, _, body in self.received if path == name]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    holder: list[Receiver] = []

    async def hook(request: Request) -> Response:
        me = holder[0]
        name = request.path_params["name"]
        body = await request.body()
        with me.lock:
            me.received.append((name, dict(request.headers), body))
            script = me.script.get(name, [])
            status = script.pop(0) if script else 200
        headers = {"location": me.url("landing")} if 300 <= status < 400 else {}
        return Response(status_code=status, headers=headers)

    app = Starlette(routes=[Route("/hooks/{name}", hook, methods=["POST"])])
    me = Receiver(ThreadedServer(app))
    holder.append(me)
    me.server.start()
    yield me
    me.server.close()


def _endpoint(receiver: Receiver, name: str, topics: tuple[str, ...], secret: str,
              **options: Any) -> WebhookEndpoint:
    return WebhookEndpoint(name=name, url=receiver.url(name), secret=secret, topics=topics,
                           backoff=LinearBackoff(step=0.05, max_delay=0.1), timeout=5.0,
                           **options)


def _router(url: str, subscriptions: WebhookSubscriptions) -> tuple[Router, WebhookFanout]:
    router = Router()
    fanout = WebhookFanout(url, subscriptions)
    fanout.attach(router)
    WebhookDeliverer(subscriptions).attach(router)
    return router, fanout


def _deliveries(url: str) -> list[tuple[int, str, int, str]]:
    with psycopg.connect(url) as conn:
        return [(r[0], r[1], r[2], r[3]) for r in conn.execute(
            "SELECT id, payload->>'endpoint', attempts, state FROM conveyor.events "
            "WHERE topic = %s ORDER BY payload->>'endpoint'", (DELIVER_TOPIC,)).fetchall()]


async def _deliveries_done(url: str) -> bool:
    rows = await asyncio.to_thread(_deliveries, url)
    return bool(rows) and all(state in ("succeeded", "failed", "cancelled")
                              for _, _, _, state in rows)


async def test_each_subscribed_endpoint_gets_one_signed_request(
        fresh_db: str, receiver: Receiver) -> None:
    secrets = {name: generate_secret() for name in ("crm", "audit", "billing")}
    subscriptions = WebhookSubscriptions([
        _endpoint(receiver, "crm", ("order.*",), secrets["crm"]),
        _endpoint(receiver, "audit", ("order.created", "invoice.*"), secrets["audit"]),
        _endpoint(receiver, "billing", ("invoice.*",), secrets["billing"]),
    ])
    router, fanout = _router(fresh_db, subscriptions)
    with CommittingProducer(fresh_db) as producer:
        source = producer.enqueue("order.created", {"order": 7, "note": "grüße"}, tenant="acme")
    async with running(new_worker(fresh_db, router)):
        await wait_until(lambda: _deliveries_done(fresh_db), timeout=20, what="deliveries")
        await fanout.aclose()
    assert [(e, a, s) for _, e, a, s in _deliveries(fresh_db)] == \
        [("audit", 1, "succeeded"), ("crm", 1, "succeeded")]
    assert receiver.bodies("billing") == []
    for name in ("crm", "audit"):
        [(_, headers, body)] = [r for r in receiver.received if r[0] == name]
        assert independent_verify(secrets[name], headers, body)
        assert headers["webhook-id"] == f"msg_acme_{source}"
        assert json.loads(body)["type"] == "order.created"
        assert json.loads(body)["data"] == {"order": 7, "note": "grüße"}
        with pytest.raises(WebhookVerificationError):
            verify(secrets["billing"], headers, body)


async def test_fan_out_is_idempotent_under_redelivery(fresh_db: str, receiver: Receiver) -> None:
    subscriptions = WebhookSubscriptions([
        _endpoint(receiver, "crm", ("order.*",), generate_secret()),
        _endpoint(receiver, "audit", ("*",), generate_secret()),
    ])
    fanout = WebhookFanout(fresh_db, subscriptions)
    event = Event(id=41, topic="order.paid", tenant="acme", payload_text='{"order": 1}')
    try:
        first = await fanout.fan_out(event)
        again = await fanout.fan_out(event)     # the source event ran twice
    finally:
        await fanout.aclose()
    assert first == again and len(first) == 2
    with psycopg.connect(fresh_db) as conn:
        keys = [r[0] for r in conn.execute(
            "SELECT idempotency_key FROM conveyor.events ORDER BY idempotency_key")]
    assert keys == [fanout_key(41, "audit"), fanout_key(41, "crm")]


async def test_endpoints_retry_independently(fresh_db: str, receiver: Receiver) -> None:
    receiver.script["flaky"] = [500, 503]
    subscriptions = WebhookSubscriptions([
        _endpoint(receiver, "flaky", ("order.*",), generate_secret()),
        _endpoint(receiver, "steady", ("order.*",), generate_secret()),
    ])
    router, fanout = _router(fresh_db, subscriptions)
    with CommittingProducer(fresh_db) as producer:
        producer.enqueue("order.created", {"order": 8})
    async with running(new_worker(fresh_db, router)):
        await wait_until(lambda: _deliveries_done(fresh_db), timeout=20, what="deliveries")
        await fanout.aclose()
    rows = {e: (a, s) for _, e, a, s in _deliveries(fresh_db)}
    assert rows == {"flaky": (3, "succeeded"), "steady": (1, "succeeded")}
    [flaky_id] = [i for i, e, _, _ in _deliveries(fresh_db) if e == "flaky"]
    errors = [e.error for e in show(fresh_db, flaky_id).errors]
    assert errors == ["endpoint 'flaky' answered 500", "endpoint 'flaky' answered 503"]
    bodies = receiver.bodies("flaky")
    assert len(bodies) == 3 and len(set(bodies)) == 1   # the same body on every retry


async def test_redirects_are_never_followed_and_gone_stops_at_once(
        fresh_db: str, receiver: Receiver) -> None:
    receiver.script["moved"] = [302, 302, 302]
    receiver.script["gone"] = [410]
    subscriptions = WebhookSubscriptions([
        _endpoint(receiver, "moved", ("order.*",), generate_secret(), max_attempts=2),
        _endpoint(receiver, "gone", ("order.*",), generate_secret()),
    ])
    router, fanout = _router(fresh_db, subscriptions)
    with CommittingProducer(fresh_db) as producer:
        producer.enqueue("order.created", {"order": 9})
    async with running(new_worker(fresh_db, router)):
        await wait_until(lambda: _deliveries_done(fresh_db), timeout=20, what="deliveries")
        await fanout.aclose()
    rows = {e: (i, a, s) for i, e, a, s in _deliveries(fresh_db)}
    assert rows["moved"][1:] == (2, "failed")
    assert rows["gone"][1:] == (1, "failed")
    assert receiver.bodies("landing") == []
    moved = show(fresh_db, rows["moved"][0])
    assert "answered 302 redirecting to" in (moved.last_error or "")
    assert "redirects are not followed" in (moved.last_error or "")
    assert show(fresh_db, rows["gone"][0]).last_error == "endpoint 'gone' answered 410 (gone)"


async def test_an_unreachable_endpoint_spends_attempts_and_parks(fresh_db: str,
                                                                receiver: Receiver) -> None:
    down = ThreadedServer(Starlette())            # reserved port, never started: refused
    try:
        endpoint = WebhookEndpoint(name="down", url=f"{down.url}/hook", secret=generate_secret(),
                                   topics=("order.*",), max_attempts=2,
                                   backoff=LinearBackoff(step=0.05, max_delay=0.05))
        router, fanout = _router(fresh_db, WebhookSubscriptions([endpoint]))
        with CommittingProducer(fresh_db) as producer:
            producer.enqueue("order.created", {})
        async with running(new_worker(fresh_db, router)):
            await wait_until(lambda: _deliveries_done(fresh_db), timeout=20, what="parking")
            await fanout.aclose()
    finally:
        down.close()
    [(event_id, _, attempts, state)] = _deliveries(fresh_db)
    assert (attempts, state) == (2, "failed")
    assert (show(fresh_db, event_id).last_error or "").startswith(
        "endpoint 'down' unreachable: ConnectError")


async def test_a_delivery_for_an_endpoint_no_longer_declared_is_cancelled(fresh_db: str) -> None:
    with CommittingProducer(fresh_db) as producer:
        event_id = producer.enqueue(DELIVER_TOPIC, {"endpoint": "removed", "type": "order.created",
                                                    "data": {}})
    router = Router()
    WebhookDeliverer(WebhookSubscriptions([])).attach(router)
    async with running(new_worker(fresh_db, router)):
        await wait_until(lambda: _is(fresh_db, event_id, "cancelled"), timeout=20, what="cancel")
    assert "no longer declared" in (show(fresh_db, event_id).last_error or "")


async def _is(url: str, event_id: int, state: str) -> bool:
    return await state_of(url, event_id) == state


def test_endpoint_configuration_is_checked() -> None:
    secret = generate_secret()
    with pytest.raises(ConfigError, match="invalid webhook endpoint name 'CRM!'"):
        WebhookEndpoint(name="CRM!", url="http://x", secret=secret, topics=("a",))
    with pytest.raises(ConfigError, match="url to be http\\(s\\), got 'ftp://x'"):
        WebhookEndpoint(name="crm", url="ftp://x", secret=secret, topics=("a",))
    with pytest.raises(ConfigError, match="subscribes to no topics"):
        WebhookEndpoint(name="crm", url="http://x", secret=secret, topics=())
    with pytest.raises(ConfigError, match="declared twice"):
        e = WebhookEndpoint(name="crm", url="http://x", secret=secret, topics=("a",))
        WebhookSubscriptions([e, e])
