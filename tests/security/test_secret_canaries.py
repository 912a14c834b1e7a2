"""S4: secret hygiene. The email consumer, the engine client and the worker run
through success, retry (server down, 5xx) and park paths with canary secrets;
no canary (nor its base64 form) may appear in event rows, worker rows, logs
(messages, structured extras, tracebacks) or NOTIFY payloads."""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
import trustme
import uvicorn
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from conveyor import AsyncCommittingProducer, BackoffPolicy, Event, Router, Worker, WorkerConfig
from conveyor.consumers.email import EmailConsumer, SmtpConfig
from conveyor.consumers.engine_client import AsyncEngineClient, EngineConfig
from conveyor.db.named_queries import queries_for
from conveyor.db.wake_gate import WakeGate

SMTP_USER = "mailer-canary-user"
SMTP_PASSWORD = "CANARY-smtp-pw-5d1e0c7a9b"
JWT_SECRET = "CANARY-jwt-secret-3f8a1b2c4d5e6f708192a3b4"
RECIPIENT = "canary.recipient.77@example.com"
DOMAIN = "app.test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Smtp:
    port: int
    data_reply: str | None = None
    received: list[bytes] = field(default_factory=list)


class _Handler:
    def __init__(self, state: Smtp) -> None:
        self.state = state

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        if self.state.data_reply is not None:
            return self.state.data_reply
        self.state.received.append(bytes(envelope.original_content))
        return "250 OK"


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ssl.SSLContext]]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    path = tmp_path_factory.mktemp("tls") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    yield str(path), ctx


def _authenticate(server: Any, session: Any, envelope: Any, mechanism: str,
                  auth_data: Any) -> AuthResult:
    ok = (isinstance(auth_data, LoginPassword) and auth_data.login == SMTP_USER.encode()
          and auth_data.password == SMTP_PASSWORD.encode())
    return AuthResult(success=True) if ok else AuthResult(success=False, handled=False)


@pytest.fixture
def smtp_servers(ca_file: tuple[str, ssl.SSLContext]) -> Iterator[dict[str, Smtp]]:
    servers: dict[str, Smtp] = {}
    controllers = []
    try:
        for name, reply in (("ok", None), ("bounce", "554 5.7.1 rejected by policy")):
            state = Smtp(port=_free_port(), data_reply=reply)
            c = Controller(_Handler(state), hostname="127.0.0.1", port=state.port, ready_timeout=5,
                           tls_context=ca_file[1], require_starttls=True, auth_required=True,
                           auth_require_tls=True, authenticator=_authenticate)
            c.start()
            controllers.append(c)
            servers[name] = state
        yield servers
    finally:
        for c in controllers:
            c.stop()


@dataclass
class EngineSeen:
    tokens: list[str] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)


@pytest.fixture
def engine() -> Iterator[tuple[str, EngineSeen]]:
    seen = EngineSeen()

    async def anything(request: Request) -> Response:
        seen.tokens.append(request.headers.get("authorization", "").removeprefix("Bearer "))
        seen.keys.append(request.headers.get("idempotency-key"))
        if request.url.path.startswith("/fail"):
            return JSONResponse({"error": "engine exploded"}, status_code=500)
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/{path:path}", anything, methods=["GET", "POST", "PATCH"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _forms(secret: str) -> list[str]:
    raw = secret.encode()
    return [secret, base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode().rstrip("="),
            raw.hex()]


def _record_text(record: logging.LogRecord) -> str:
    parts = [record.getMessage()]
    parts += [f"{k}={v!r}" for k, v in record.__dict__.items() if k not in ("msg", "args")]
    if record.exc_info:
        parts.append(logging.Formatter().formatException(record.exc_info))
    return "\n".join(parts)


async def test_no_canary_in_rows_errors_logs_or_notifications(
        fresh_db: str, smtp_servers: dict[str, Smtp], engine: tuple[str, EngineSeen],
        ca_file: tuple[str, ssl.SSLContext], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    base_url, seen = engine

    def smtp(port: int) -> SmtpConfig:
        return SmtpConfig(host="127.0.0.1", port=port, from_address="Shop <no-reply@shop.test>",
                          username=SMTP_USER, password=SMTP_PASSWORD, ca_file=ca_file[0], timeout=5)

    mail_ok = EmailConsumer(smtp(smtp_servers["ok"].port))
    mail_bounce = EmailConsumer(smtp(smtp_servers["bounce"].port))
    mail_down = EmailConsumer(smtp(_free_port()))
    eng_cfg = EngineConfig(base_url=base_url, tenant_domain=DOMAIN, jwt_secret=JWT_SECRET,
                           role="svc-canary", timeout=3)
    eng_down_cfg = EngineConfig(base_url=f"http://127.0.0.1:{_free_port()}", tenant_domain=DOMAIN,
                                jwt_secret=JWT_SECRET, role="svc-canary", timeout=3)
    for cfg in (mail_ok.config, eng_cfg):
        assert SMTP_PASSWORD not in repr(cfg) and JWT_SECRET not in repr(cfg)
    client = AsyncEngineClient(eng_cfg)
    down_client = AsyncEngineClient(eng_down_cfg)

    async def call_engine(event: Event) -> None:
        c = down_client if event.topic == "engine.down" else client
        path = "/fail/now" if event.topic == "engine.fail" else "/api/things"
        reply = await c.request(event.tenant or "acme", "POST", path, json=event.payload,
                                idempotency_key=f"evt-{event.id}")
        reply.raise_for_status()

    router = Router()
    router.add("mail.ok", mail_ok)
    router.add("mail.bounce", mail_bounce)
    router.add("mail.down", mail_down)
    router.add("engine.*", call_engine)
    config = WorkerConfig(concurrency=10, batch_size=10, poll_interval=0.2, lease_ttl=5.0,
                          heartbeat_interval=1.0, rescue_interval=1.0, shutdown_timeout=3.0,
                          backoff=BackoffPolicy(base_delay=0.05, max_delay=0.1, jitter=0.0))
    mail = {"to": RECIPIENT, "template": "verification",
            "data": {"name": "Ana", "link": "https://shop.test/v?t=1", "product": "", "expires_in": ""}}
    listen = await psycopg.AsyncConnection.connect(fresh_db, autocommit=True)
    await listen.execute('LISTEN "conveyor.events"')
    # Waiting as a worker does, so every enqueue sends its wake-up (the wake gate).
    await WakeGate(queries_for("conveyor")).hold(listen)
    worker = Worker(fresh_db, router, config)
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.started.wait(), 10)
        async with AsyncCommittingProducer(fresh_db) as producer:
            for topic in ("mail.ok", "mail.bounce", "mail.down"):
                await producer.enqueue(topic, mail, tenant="acme", max_attempts=3)
            for topic in ("engine.ok", "engine.fail", "engine.down"):
                await producer.enqueue(topic, {"n": 1}, tenant="acme", max_attempts=3)

        async def settled() -> bool:
            async with await psycopg.AsyncConnection.connect(fresh_db) as conn:
                row = await (await conn.execute(
                    "SELECT count(*) FROM conveyor.events WHERE state IN ('pending', 'running')"
                )).fetchone()
            return row == (0,)
        for _ in range(300):
            if await settled():
                break
            await asyncio.sleep(0.1)
        assert await settled(), "every event succeeded or was parked"
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 15)
        await worker.close()
        await client.aclose()
        await down_client.aclose()
        for c in (mail_ok, mail_bounce, mail_down):
            await c.aclose()
    notes = [n.payload async for n in listen.notifies(timeout=0.2)]
    await listen.close()
    async with await psycopg.AsyncConnection.connect(fresh_db) as conn:
        rows = await (await conn.execute(
            "SELECT topic, state, attempts, e::text FROM conveyor.events AS e ORDER BY id")).fetchall()
        workers = await (await conn.execute("SELECT w::text FROM conveyor.workers AS w")).fetchall()
    states = {r[0]: (r[1], r[2]) for r in rows}
    assert states["mail.ok"][0] == "succeeded" and states["engine.ok"][0] == "succeeded"
    assert states["mail.bounce"] == ("failed", 1)
    assert states["mail.down"] == ("failed", 3) and states["engine.down"] == ("failed", 3)
    assert states["engine.fail"] == ("failed", 3)
    assert smtp_servers["ok"].received, "the success path really sent a mail"
    tokens = sorted(set(seen.tokens))
    assert len(tokens) >= 4, "the engine saw the minted tokens"
    canaries = {"smtp password": _forms(SMTP_PASSWORD), "jwt secret": _forms(JWT_SECRET)}
    canaries |= {f"minted token {i}": [t, t.split(".")[2]] for i, t in enumerate(tokens)}
    haystacks = {
        "event rows": "\n".join(r[3] for r in rows),
        "worker rows": "\n".join(r[0] for r in workers),
        "notifications": "\n".join(notes),
        # mail.log is the test's own SMTP sink (aiosmtpd), not Conveyor.
        "logs": "\n".join(_record_text(r) for r in caplog.records if r.name != "mail.log"),
    }
    found = [(name, where) for name, forms in canaries.items() for where, text in haystacks.items()
             if any(f in text for f in forms)]
    pii_in_logs = RECIPIENT in haystacks["logs"]
    print(f"\nS4: {len(rows)} events through success/retry/park, {len(caplog.records)} log records, "
          f"{len(notes)} notifications, {len(tokens)} minted tokens checked; canaries found: {found}; "
          f"recipient in logs: {pii_in_logs}")
    assert found == []
    assert not pii_in_logs
