"""The engine client against a real HTTP server on loopback.

A small Starlette app, served by uvicorn in a thread on 127.0.0.1, verifies
every token with PyJWT (pinned to HS256, required claims) and records what it
received.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jwt
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from conveyor.consumers.engine_client import AsyncEngineClient, EngineClient, EngineConfig, mint_service_token
from conveyor.errors import (
    ConfigError,
    EngineError,
    EngineHTTPError,
    EngineTransportError,
    InvalidInputError,
)

from .conftest import Silent

SECRET = "s3cret-for-tests-0123456789-abcdef"  # 34 bytes
DOMAIN = "app.test"
ROLE = "svc-filejobs"


@dataclass
class Seen:
    method: str
    path: str
    raw_path: bytes
    host: str
    headers: dict[str, str]
    claims: dict[str, Any] | None
    auth_error: str | None
    body: bytes


@dataclass
class Engine:
    url: str
    port: int
    requests: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def make_app(engine: Engine) -> Starlette:
    async def anything(request: Request) -> Response:
        auth = request.headers.get("authorization", "")
        claims: dict[str, Any] | None = None
        error: str | None = None
        try:
            token = auth.removeprefix("Bearer ")
            claims = jwt.decode(token, SECRET, algorithms=["HS256"], audience="engine", issuer="conveyor",
                                leeway=5, options={"require": ["exp", "iat", "iss", "aud", "sub"]})
        except jwt.PyJWTError as exc:
            error = f"{type(exc).__name__}: {exc}"
        body = await request.body()
        with engine.lock:
            engine.requests.append(Seen(request.method, request.url.path, request.scope["raw_path"],
                                        request.headers.get("host", ""), dict(request.headers),
                                        claims, error, body))
        if error is not None:
            return JSONResponse({"error": "unauthorized", "detail": error}, status_code=401)
        path = request.url.path
        if path.startswith("/status/"):
            code = int(path.rsplit("/", 1)[1])
            return JSONResponse({"error": f"status {code}"}, status_code=code)
        if path == "/text":
            return PlainTextResponse("plain words", status_code=503)
        if path == "/redirect-away":
            return RedirectResponse("http://evil.invalid/steal", status_code=302)
        if path == "/redirect-here":
            return RedirectResponse("/landed", status_code=302)
        if path == "/slow":
            import asyncio

            await asyncio.sleep(5)
        return JSONResponse({"ok": True, "path": path, "host": request.headers.get("host")})

    return Starlette(routes=[Route("/{path:path}", anything,
                                   methods=["GET", "POST", "PUT", "PATCH", "DELETE"])])


@pytest.fixture(scope="module")
def engine_server() -> Iterator[Engine]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    engine = Engine(url=f"http://127.0.0.1:{port}", port=port)
    server = uvicorn.Server(uvicorn.Config(make_app(engine), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def engine(engine_server: Engine) -> Engine:
    with engine_server.lock:
        engine_server.requests.clear()
    return engine_server


def config(base_url: str, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = dict(base_url=base_url, tenant_domain=DOMAIN, jwt_secret=SECRET, role=ROLE,
                                  timeout=5)
    values.update(overrides)
    return EngineConfig(**values)


# --------------------------------------------------------------- the calls


async def test_request_carries_host_token_and_json(engine: Engine) -> None:
    async with AsyncEngineClient(config(engine.url)) as client:
        reply = await client.request("acme", "PATCH", "/api/filejobs/7", json={"status": "done"},
                                     idempotency_key="event-42")
    assert reply.ok and reply.status == 200
    assert reply.body == {"ok": True, "path": "/api/filejobs/7", "host": "acme.app.test"}
    (seen,) = engine.requests
    assert seen.auth_error is None and seen.claims is not None
    assert seen.method == "PATCH" and seen.path == "/api/filejobs/7"
    assert seen.host == "acme.app.test"
    assert seen.headers["idempotency-key"] == "event-42"
    assert seen.headers["content-type"] == "application/json"
    assert seen.body == b'{"status":"done"}' or seen.body == b'{"status": "done"}'
    claims = seen.claims
    assert claims["role"] == ROLE and claims["tenant"] == "acme"
    assert claims["iss"] == "conveyor" and claims["aud"] == "engine" and claims["sub"] == "service:conveyor"
    assert claims["exp"] - claims["iat"] == 60
    assert abs(claims["iat"] - time.time()) < 5
    assert jwt.get_unverified_header(seen.headers["authorization"].removeprefix("Bearer "))["alg"] == "HS256"


async def test_fresh_token_per_call_with_configured_ttl(engine: Engine) -> None:
    async with AsyncEngineClient(config(engine.url, token_ttl=90)) as client:
        for tenant in ("acme", "acme", "globex"):
            await client.request(tenant, "GET", "/api/filejobs/1")
    claims = [s.claims for s in engine.requests]
    assert all(c is not None for c in claims)
    assert len({c["jti"] for c in claims}) == 3  # type: ignore[index]
    assert len({s.headers["authorization"] for s in engine.requests}) == 3
    assert all(c["exp"] - c["iat"] == 90 for c in claims)  # type: ignore[index]
    assert [s.host for s in engine.requests] == ["acme.app.test", "acme.app.test", "globex.app.test"]
    assert [c["tenant"] for c in claims] == ["acme", "acme", "globex"]  # type: ignore[index]
    assert "idempotency-key" not in engine.requests[0].headers


def test_sync_client_mirrors_the_async_one(engine: Engine) -> None:
    with EngineClient(config(engine.url)) as client:
        reply = client.request("acme", "POST", "/api/filejobs", json={"file": "x.xlsx"},
                               idempotency_key="k-1")
        missing = client.request("acme", "GET", "/status/404")
    assert reply.ok and reply.body["host"] == "acme.app.test"
    assert missing.status == 404 and not missing.ok
    first = engine.requests[0]
    assert first.headers["idempotency-key"] == "k-1" and first.claims and first.claims["role"] == ROLE


async def test_same_idempotency_key_on_every_retry(engine: Engine) -> None:
    async with AsyncEngineClient(config(engine.url)) as client:
        for _ in range(3):
            await client.request("acme", "PATCH", "/status/503", json={"status": "done"},
                                 idempotency_key="event-9")
    assert [s.headers["idempotency-key"] for s in engine.requests] == ["event-9"] * 3
    assert len({s.claims["jti"] for s in engine.requests if s.claims}) == 3


@pytest.mark.parametrize(("status", "retryable"), [(500, True), (503, True), (429, True), (408, True),
                                                   (404, False), (400, False), (409, False), (422, False)])
async def test_non_2xx_is_returned_then_raised_on_request(engine: Engine, status: int,
                                                          retryable: bool) -> None:
    async with AsyncEngineClient(config(engine.url)) as client:
        reply = await client.request("acme", "GET", f"/status/{status}")
    assert reply.status == status and not reply.ok
    assert reply.body == {"error": f"status {status}"}
    with pytest.raises(EngineHTTPError) as info:
        reply.raise_for_status()
    assert info.value.status == status
    assert info.value.retryable is retryable
    assert info.value.body == {"error": f"status {status}"}
    assert "\n" not in str(info.value)


async def test_non_json_body_is_text(engine: Engine) -> None:
    async with AsyncEngineClient(config(engine.url)) as client:
        reply = await client.request("acme", "GET", "/text")
    assert reply.status == 503 and reply.body == "plain words"
    assert reply.ok is False


async def test_redirects_are_not_followed(engine: Engine) -> None:
    async with AsyncEngineClient(config(engine.url)) as client:
        away = await client.request("acme", "GET", "/redirect-away")
        here = await client.request("acme", "GET", "/redirect-here")
    assert away.status == 302 and away.headers["location"] == "http://evil.invalid/steal"
    assert here.status == 302
    assert [s.path for s in engine.requests] == ["/redirect-away", "/redirect-here"]  # no /landed
    with pytest.raises(EngineHTTPError):
        away.raise_for_status()


def test_sync_redirects_are_not_followed(engine: Engine) -> None:
    with EngineClient(config(engine.url)) as client:
        assert client.request("acme", "GET", "/redirect-away").status == 302
    assert [s.path for s in engine.requests] == ["/redirect-away"]


async def test_transport_error_on_closed_port(closed_port: int) -> None:
    # A 30 s timeout, a 10 s bound: the refusal ended it, not the timeout (the bound
    # was 3 s against a 5 s timeout, which a loaded machine can use up).
    start = time.monotonic()
    async with AsyncEngineClient(config(f"http://127.0.0.1:{closed_port}", timeout=30)) as client:
        with pytest.raises(EngineTransportError) as info:
            await client.request("acme", "GET", "/api/filejobs/1")
    assert isinstance(info.value, EngineError)
    assert time.monotonic() - start < 10
    with EngineClient(config(f"http://127.0.0.1:{closed_port}")) as sync_client, \
            pytest.raises(EngineTransportError):
        sync_client.request("acme", "GET", "/api/filejobs/1")


async def test_timeout_is_a_transport_error(silent_server: Silent) -> None:
    start = time.monotonic()
    async with AsyncEngineClient(config(f"http://127.0.0.1:{silent_server.port}", timeout=1)) as client:
        with pytest.raises(EngineTransportError):
            await client.request("acme", "GET", "/api/filejobs/1")
    # The 1 s timeout ended it, not the silent server (which never answers); the
    # margin leaves a loaded machine room (it was 1.5 s).
    assert time.monotonic() - start < 1 + 5


# ------------------------------------------------------------- refusals


@pytest.mark.parametrize("secret", ["x" * 31, b"x" * 31, "", "ñ" * 15])
def test_config_refuses_short_secrets(secret: str | bytes) -> None:
    with pytest.raises(ConfigError):
        config("http://127.0.0.1:1", jwt_secret=secret)
    config("http://127.0.0.1:1", jwt_secret="ñ" * 16)  # 32 bytes in UTF-8 is enough


@pytest.mark.parametrize("role", ["admin", "Admin", "ADMINISTRATOR", "root", "superuser", "owner", ""])
def test_config_refuses_admin_roles(role: str) -> None:
    with pytest.raises(ConfigError):
        config("http://127.0.0.1:1", role=role)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/", "127.0.0.1:8000", "http://", "http:///x", "//127.0.0.1",
                                 "http://127.0.0.1:8000/?next=x", "http://127.0.0.1:8000/#frag", "",
                                 "file:///etc/passwd", "javascript:alert(1)"])
def test_config_refuses_bad_base_url(url: str) -> None:
    with pytest.raises(ConfigError):
        config(url)


@pytest.mark.parametrize("domain", ["", "app..test", ".app.test", "app.test.", "app test", "app_test",
                                    "evil.test/x", "a.test:80"])
def test_config_refuses_bad_tenant_domain(domain: str) -> None:
    with pytest.raises(ConfigError):
        config("http://127.0.0.1:1", tenant_domain=domain)


def test_config_refuses_bad_ttl_and_timeout() -> None:
    for bad in (0, -1, 3601):
        with pytest.raises(ConfigError):
            config("http://127.0.0.1:1", token_ttl=bad)
    with pytest.raises(ConfigError):
        config("http://127.0.0.1:1", timeout=0)


def test_secret_is_not_in_repr() -> None:
    assert SECRET not in repr(config("http://127.0.0.1:1"))


BAD_PATHS = ["http://evil.test/x", "https://evil.test/x", "//evil.test/x", "relative/path", "",
             "/api/../admin", "/api/filejobs/..", "/./api",
             "/api/x\r\nHost: evil.test", "/api/x y", "/api/\x00", "\\\\evil.test/x"]


@pytest.mark.parametrize("path", BAD_PATHS)
async def test_request_refuses_bad_paths_before_any_request(engine: Engine, path: str) -> None:
    async with AsyncEngineClient(config(engine.url)) as client:
        with pytest.raises(InvalidInputError):
            await client.request("acme", "GET", path)
    with EngineClient(config(engine.url)) as sync_client, pytest.raises(InvalidInputError):
        sync_client.request("acme", "GET", path)
    assert engine.requests == []


@pytest.mark.parametrize("path", ["/api/%2e%2e/admin", "/api/filejobs/%2E%2E/%2e%2e/admin",
                                  "/api/filejobs/1%2f..%2f..%2fadmin", "/api/.%2e/admin"])
async def test_request_refuses_encoded_dot_segments(engine: Engine, path: str) -> None:
    async with AsyncEngineClient(config(engine.url)) as client:
        try:
            await client.request("acme", "GET", path)
        except InvalidInputError:
            pass
    assert [s.path for s in engine.requests if ".." in s.path] == []


BAD_TENANTS: list[Any] = ["", "Acme", "acme.evil", "evil.test/x", "a b", "-acme", "acme-", "a" * 64,
                          "acme\r\nx", "../acme", 7, "acme:80", "acme@evil"]


@pytest.mark.parametrize("tenant", BAD_TENANTS)
async def test_request_refuses_bad_tenants_before_any_request(engine: Engine, tenant: Any) -> None:
    async with AsyncEngineClient(config(engine.url)) as client:
        with pytest.raises(InvalidInputError):
            await client.request(tenant, "GET", "/api/filejobs/1")
    assert engine.requests == []


async def test_request_refuses_a_missing_tenant(engine: Engine) -> None:
    async with AsyncEngineClient(config(engine.url)) as client:
        with pytest.raises(InvalidInputError):
            await client.request(None, "GET", "/api/filejobs/1")  # type: ignore[arg-type]
    assert engine.requests == []


@pytest.mark.parametrize("key", ["", "a\r\nX-Evil: 1", "a\nb", "a\x00b"])
async def test_request_refuses_bad_idempotency_keys(engine: Engine, key: str) -> None:
    async with AsyncEngineClient(config(engine.url)) as client:
        with pytest.raises(InvalidInputError):
            await client.request("acme", "GET", "/api/filejobs/1", idempotency_key=key)
    assert engine.requests == []


def test_minted_token_verifies_and_is_pinned() -> None:
    cfg = config("http://127.0.0.1:1", token_ttl=30)
    token = mint_service_token(cfg, "acme", now=1_700_000_000)
    claims = jwt.decode(token, SECRET, algorithms=["HS256"], audience="engine", issuer="conveyor",
                        options={"require": ["exp", "iat", "iss", "aud", "sub"], "verify_exp": False})
    assert claims["exp"] - claims["iat"] == 30 and claims["iat"] == 1_700_000_000
    assert jwt.get_unverified_header(token)["alg"] == "HS256"
    with pytest.raises(jwt.InvalidSignatureError):
        jwt.decode(token, SECRET + "x", algorithms=["HS256"], audience="engine",
                   options={"verify_exp": False})
