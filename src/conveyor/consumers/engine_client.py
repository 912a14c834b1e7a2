"""HTTP client for the application's own API ("the engine"), with scoped service JWTs.

Consumers write results back through the engine's API instead of its tables,
so every write passes the engine's validation and RBAC like any other client.
For every call the client mints a fresh, short-lived HS256 token for a scoped
service role (never an admin role), sets the tenant's ``Host`` header
(``<tenant>.<tenant_domain>``), and sends JSON. It never follows redirects,
and base URL and domain come only from configuration, never from a payload.

Example::

    config = EngineConfig(base_url="http://127.0.0.1:8000", tenant_domain="app.test",
                          jwt_secret=secret, role="svc-filejobs")
    async with AsyncEngineClient(config) as engine:
        reply = await engine.request("acme", "PATCH", "/api/filejobs/7",
                                     json={"status": "done"}, idempotency_key="event-42")
        reply.raise_for_status()
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self
from urllib.parse import unquote, urlsplit

from conveyor.errors import (
    ConfigError,
    EngineHTTPError,
    EngineTransportError,
    InvalidInputError,
    MissingExtraError,
)

try:
    import httpx
    import jwt
except ImportError as exc:
    raise MissingExtraError("the engine client", "http", module=exc.name) from exc
from conveyor.validation import check_tenant

TOKEN_TTL_DEFAULT = 60.0
TIMEOUT_DEFAULT = 10.0
MIN_SECRET_BYTES = 32
# Roles a service token may never carry, whatever the configuration says.
FORBIDDEN_ROLES = frozenset({"admin", "administrator", "owner", "root", "superuser", "superadmin"})


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """Where the engine is and how to authenticate to it.

    Attributes:
        base_url: scheme, host and port of the engine, e.g. ``"http://127.0.0.1:8000"``.
        tenant_domain: the engine's tenant domain; tenant ``acme`` is addressed as
            ``Host: acme.<tenant_domain>``.
        jwt_secret: the shared HS256 secret, at least 32 bytes.
        role: the scoped service role put in every token; never an admin role.
            Defaults to ``"conveyor-service"``.
        issuer: ``iss`` claim. Defaults to ``"conveyor"``.
        audience: ``aud`` claim. Defaults to ``"engine"``.
        subject: ``sub`` claim. Defaults to ``"service:conveyor"``.
        token_ttl: seconds a minted token stays valid. Defaults to 60.
        timeout: seconds one HTTP call may take in all. Defaults to 10.
    """

    base_url: str
    tenant_domain: str
    jwt_secret: str | bytes = field(repr=False)
    role: str = "conveyor-service"
    issuer: str = "conveyor"
    audience: str = "engine"
    subject: str = "service:conveyor"
    token_ttl: float = TOKEN_TTL_DEFAULT
    timeout: float = TIMEOUT_DEFAULT

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
            raise ConfigError(f"expected base_url to be an http(s) URL, got {self.base_url!r}")
        labels = self.tenant_domain.split(".")
        if not self.tenant_domain or not all(labels) or any(
                not lbl.replace("-", "").isalnum() for lbl in labels):
            raise ConfigError(f"expected tenant_domain to be a domain name, got {self.tenant_domain!r}")
        secret = self.jwt_secret.encode() if isinstance(self.jwt_secret, str) else self.jwt_secret
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"expected jwt_secret to be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        if not self.role or self.role.lower() in FORBIDDEN_ROLES:
            raise ConfigError(f"service role must be a scoped role, never {self.role!r}")
        if not 0 < self.token_ttl <= 3600:
            raise ConfigError(f"expected token_ttl to be in (0, 3600], got {self.token_ttl!r}")
        if not self.timeout > 0:
            raise ConfigError(f"expected timeout to be > 0, got {self.timeout!r}")

    @property
    def secret_bytes(self) -> bytes:
        return self.jwt_secret.encode() if isinstance(self.jwt_secret, str) else self.jwt_secret


def mint_service_token(config: EngineConfig, tenant: str, *, now: float | None = None) -> str:
    """A fresh HS256 token for ``tenant`` with the configured scoped role."""
    issued = int(time.time() if now is None else now)
    claims = {
        "iss": config.issuer,
        "aud": config.audience,
        "sub": config.subject,
        "iat": issued,
        "nbf": issued,
        "exp": issued + int(config.token_ttl),
        "jti": uuid.uuid4().hex,
        "role": config.role,
        "tenant": tenant,
    }
    return jwt.encode(claims, config.secret_bytes, algorithm="HS256")


@dataclass(frozen=True, slots=True)
class EngineReply:
    """What the engine answered. ``body`` is decoded JSON when the reply is JSON."""

    status: int
    body: Any
    headers: dict[str, str]

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def raise_for_status(self) -> EngineReply:
        if not self.ok:
            detail = json.dumps(self.body)[:200] if self.body is not None else ""
            raise EngineHTTPError(f"engine answered {self.status}: {detail}",
                                  status=self.status, body=self.body)
        return self


def _check_path(path: str) -> str:
    parts = urlsplit(path)
    decoded = unquote(parts.path)
    lowered = path.lower()
    if (not path.startswith("/") or path.startswith("//") or parts.scheme or parts.netloc
            or any(seg in ("..", ".") for seg in decoded.split("/"))
            or "%2f" in lowered or "%5c" in lowered or "\\" in path
            or any(ord(ch) < 33 for ch in path)):
        raise InvalidInputError(f"engine path must be an absolute path on the engine, got {path!r:.80}")
    return path


def _tenant(tenant: object) -> str:
    # A tenant-less call would otherwise go to "None.<domain>" with tenant=None in the token.
    if tenant is None:
        raise InvalidInputError("engine calls need a tenant, got None")
    checked = check_tenant(tenant)
    assert checked is not None
    return checked


def _headers(config: EngineConfig, tenant: str, idempotency_key: str | None) -> dict[str, str]:
    headers = {
        "Host": f"{tenant}.{config.tenant_domain}",
        "Authorization": f"Bearer {mint_service_token(config, tenant)}",
        "Accept": "application/json",
    }
    if idempotency_key is not None:
        if not idempotency_key or any(ord(ch) < 32 for ch in idempotency_key):
            raise InvalidInputError(f"invalid idempotency key {idempotency_key!r:.80}")
        headers["Idempotency-Key"] = idempotency_key
    return headers


def _reply(response: httpx.Response) -> EngineReply:
    body: Any
    if response.headers.get("content-type", "").startswith("application/json"):
        try:
            body = response.json()
        except ValueError:
            body = response.text
    else:
        body = response.text or None
    return EngineReply(response.status_code, body, dict(response.headers))


def _client_kwargs(config: EngineConfig) -> dict[str, Any]:
    return {
        "base_url": config.base_url,
        "timeout": httpx.Timeout(config.timeout),
        "follow_redirects": False,
        "limits": httpx.Limits(max_connections=50, max_keepalive_connections=20),
        "trust_env": False,  # no proxies from the environment
    }


class AsyncEngineClient:
    """Pooled async client; use ``async with`` or call :meth:`aclose`."""

    def __init__(self, config: EngineConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self._http = httpx.AsyncClient(transport=transport, **_client_kwargs(config))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(self, tenant: str, method: str, path: str, *, json: Any = None,
                      idempotency_key: str | None = None) -> EngineReply:
        """Call the engine for ``tenant``; a non-2xx is returned, a transport failure raised."""
        headers = _headers(self.config, _tenant(tenant), idempotency_key)
        try:
            response = await self._http.request(method, _check_path(path), json=json,
                                                headers=headers)
        except httpx.HTTPError as exc:
            raise EngineTransportError(
                f"engine unreachable for {method} {path}: {type(exc).__name__}: {exc}") from exc
        return _reply(response)


class EngineClient:
    """The sync mirror of :class:`AsyncEngineClient`."""

    def __init__(self, config: EngineConfig, *, transport: httpx.BaseTransport | None = None) -> None:
        self.config = config
        self._http = httpx.Client(transport=transport, **_client_kwargs(config))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(self, tenant: str, method: str, path: str, *, json: Any = None,
                idempotency_key: str | None = None) -> EngineReply:
        """Call the engine for ``tenant``; a non-2xx is returned, a transport failure raised."""
        headers = _headers(self.config, _tenant(tenant), idempotency_key)
        try:
            response = self._http.request(method, _check_path(path), json=json, headers=headers)
        except httpx.HTTPError as exc:
            raise EngineTransportError(
                f"engine unreachable for {method} {path}: {type(exc).__name__}: {exc}") from exc
        return _reply(response)
