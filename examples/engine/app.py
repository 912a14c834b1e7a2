"""The example engine: a multi-tenant HTTP API that enqueues its events in the same transaction.

* Tenants come from the Host subdomain (``acme.app.test`` is tenant ``acme``).
* Every request carries a JWT, verified pinned to HS256 with required claims
  and a small leeway; its ``tenant`` claim must match the Host's tenant.
* RBAC per role: the worker's scoped service role may only read and update
  file jobs, nothing else.
* ``POST /api/<resource>`` (``filejobs``, ``tasks``) inserts the row AND enqueues
  ``<resource>.created`` in one transaction: the canonical transactional-outbox
  integration. ``POST /api/emails`` enqueues ``email.send``.
* A file job's ``file`` names a file in **the tenant's own** uploads directory
  (the worker reads ``ENGINE_FILES_DIR/<tenant>/<file>`` only); names with
  ``..`` or ``.`` segments, a leading ``/``, backslashes or control characters
  are refused with 422.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from conveyor import AsyncProducer, InvalidInputError, ProducerConfig
from conveyor.schema.migrator import AsyncMigrator

# Each resource: its table and the one field a client sets on create. Table names
# come only from this dict, never from a request.
RESOURCES: dict[str, tuple[str, str]] = {
    "filejobs": ("engine.filejobs", "file"),
    "tasks": ("engine.tasks", "title"),
}
ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "admin": frozenset({f"{r}:{a}" for r in RESOURCES for a in ("create", "read", "update")}
                       | {"emails:send"}),
    "user": frozenset({f"{r}:{a}" for r in RESOURCES for a in ("create", "read")}
                      | {"emails:send"}),
    # The worker's role: exactly what the consumers need, nothing more.
    "conveyor-service": frozenset({f"{r}:{a}" for r in RESOURCES for a in ("read", "update")}),
}
STATUSES = ("pending", "done", "failed")
LEEWAY_SECONDS = 5


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    database_url: str
    jwt_secret: str = field(repr=False)
    tenant_domain: str = "app.test"
    audience: str = "engine"
    issuers: tuple[str, ...] = ("engine", "conveyor")
    conveyor_schema: str = "conveyor"
    tenants: tuple[str, ...] = ()


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _row(resource: str, row: Any) -> dict[str, Any]:
    field_name = RESOURCES[resource][1]
    return {"id": row[0], "tenant": row[1], field_name: row[2], "status": row[3],
            "result": row[4], "error": row[5], "created_at": row[6].isoformat(),
            "updated_at": row[7].isoformat()}


def _resource(request: Request) -> tuple[str, str, str]:
    name = request.path_params["resource"]
    if name not in RESOURCES:
        raise HTTPError(404, "no such resource")
    table, field_name = RESOURCES[name]
    return name, table, field_name


def _columns(field_name: str) -> str:
    return f"id, tenant, {field_name}, status, result, error, created_at, updated_at"


class Engine:
    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.pool = AsyncConnectionPool(settings.database_url, min_size=1, max_size=10, open=False)
        self.producer = AsyncProducer(ProducerConfig(schema=settings.conveyor_schema))

    async def startup(self) -> None:
        await self.pool.open()
        async with self.pool.connection() as conn:
            await AsyncMigrator(self.settings.conveyor_schema).apply(conn)
            await conn.execute((Path(__file__).parent / "schema.sql").read_text().encode())
            for tenant in self.settings.tenants:
                await conn.execute("INSERT INTO engine.tenants VALUES (%s) ON CONFLICT DO NOTHING",
                                   (tenant,))

    async def shutdown(self) -> None:
        await self.pool.close()

    # ------------------------------------------------------------------ auth

    async def tenant_of(self, request: Request) -> str:
        host = (request.headers.get("host") or "").split(":")[0].lower()
        suffix = "." + self.settings.tenant_domain
        tenant = host[: -len(suffix)] if host.endswith(suffix) else ""
        if not re.fullmatch(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?", tenant):
            raise HTTPError(404, "unknown tenant")
        async with self.pool.connection() as conn:
            found = await (await conn.execute(
                "SELECT 1 FROM engine.tenants WHERE name = %s", (tenant,))).fetchone()
        if found is None:
            raise HTTPError(404, "unknown tenant")
        return tenant

    def authorize(self, request: Request, tenant: str, permission: str) -> dict[str, Any]:
        header = request.headers.get("authorization", "")
        if not header.startswith("Bearer "):
            raise HTTPError(401, "missing bearer token")
        try:
            claims: dict[str, Any] = jwt.decode(
                header[7:], self.settings.jwt_secret, algorithms=["HS256"],
                audience=self.settings.audience, issuer=list(self.settings.issuers),
                leeway=LEEWAY_SECONDS,
                options={"require": ["exp", "iat", "iss", "aud", "sub"]})
        except jwt.PyJWTError as exc:
            raise HTTPError(401, f"invalid token: {exc}") from None
        if claims.get("tenant") != tenant:
            raise HTTPError(403, "token is for another tenant")
        if permission not in ROLE_PERMISSIONS.get(str(claims.get("role")), frozenset()):
            raise HTTPError(403, f"role {claims.get('role')!r} may not {permission}")
        return claims

    # ------------------------------------------------------------- handlers

    async def create(self, request: Request) -> JSONResponse:
        resource, table, field_name = _resource(request)
        tenant = await self.tenant_of(request)
        self.authorize(request, tenant, f"{resource}:create")
        body = await _json_body(request)
        value = body.get(field_name)
        if not isinstance(value, str) or not value or len(value) > 1024:
            raise HTTPError(422, f"'{field_name}' must be a non-empty string")
        if resource == "filejobs" and not _plain_file_name(value):
            raise HTTPError(422, "'file' must be a relative name inside the tenant's uploads "
                                 "(no '..' or '.' segments, leading '/', backslashes or control "
                                 "characters)")
        async with self.pool.connection() as conn, conn.transaction():
            row = await (await conn.execute(
                f"INSERT INTO {table} (tenant, {field_name}) VALUES (%s, %s) "
                f"RETURNING {_columns(field_name)}", (tenant, value))).fetchone()
            # Same transaction: the event exists if and only if the row does.
            await self.producer.enqueue(conn, f"{resource}.created", {"id": row[0]}, tenant=tenant)
        return JSONResponse(_row(resource, row), status_code=201)

    async def get(self, request: Request) -> JSONResponse:
        resource, table, field_name = _resource(request)
        tenant = await self.tenant_of(request)
        self.authorize(request, tenant, f"{resource}:read")
        async with self.pool.connection() as conn:
            row = await (await conn.execute(
                f"SELECT {_columns(field_name)} FROM {table} WHERE tenant = %s AND id = %s",
                (tenant, _row_id(request)))).fetchone()
        if row is None:
            raise HTTPError(404, f"no such {resource} row")
        return JSONResponse(_row(resource, row))

    async def patch(self, request: Request) -> JSONResponse:
        resource, table, field_name = _resource(request)
        tenant = await self.tenant_of(request)
        self.authorize(request, tenant, f"{resource}:update")
        row_id = _row_id(request)
        body = await _json_body(request)
        status = body.get("status")
        if status not in STATUSES:
            raise HTTPError(422, f"'status' must be one of {', '.join(STATUSES)}")
        key = request.headers.get("idempotency-key")
        # A key answers for one request only: replaying it on another row is an error,
        # not that row's update silently skipped.
        target = f"PATCH /api/{resource}/{row_id}"
        async with self.pool.connection() as conn, conn.transaction():
            if key:
                # One writer per (tenant, key) at a time: a retry racing the first
                # attempt waits for it, then gets its answer replayed (not a 500
                # from the primary key below).
                await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                                   (f"idempotency:{tenant}:{key}",))
                seen = await (await conn.execute(
                    "SELECT status, response, request FROM engine.idempotency "
                    "WHERE tenant = %s AND key = %s", (tenant, key))).fetchone()
                if seen is not None:
                    if seen[2] is not None and seen[2] != target:
                        raise HTTPError(422, "Idempotency-Key already used for another request")
                    return JSONResponse(seen[1], status_code=seen[0],
                                        headers={"Idempotent-Replayed": "true"})
            row = await (await conn.execute(
                f"UPDATE {table} SET status = %s, result = COALESCE(%s, result), "
                f"error = %s, updated_at = now() WHERE tenant = %s AND id = %s "
                f"RETURNING {_columns(field_name)}",
                (status, Jsonb(body["result"]) if "result" in body else None,
                 body.get("error"), tenant, row_id))).fetchone()
            if row is None:
                raise HTTPError(404, f"no such {resource} row")
            response = _row(resource, row)
            if key:
                await conn.execute(
                    "INSERT INTO engine.idempotency (tenant, key, status, response, request) "
                    "VALUES (%s, %s, 200, %s, %s)", (tenant, key, Jsonb(response), target))
        return JSONResponse(response)

    async def send_email(self, request: Request) -> JSONResponse:
        tenant = await self.tenant_of(request)
        self.authorize(request, tenant, "emails:send")
        body = await _json_body(request)
        payload = {k: body[k] for k in ("to", "template", "data", "reply_to") if k in body}
        async with self.pool.connection() as conn, conn.transaction():
            try:
                event_id = await self.producer.enqueue(conn, "email.send", payload, tenant=tenant)
            except InvalidInputError as exc:
                raise HTTPError(422, str(exc)) from None
        return JSONResponse({"event_id": event_id}, status_code=202)


def _plain_file_name(name: str) -> bool:
    """A name the worker can only resolve inside the tenant's own uploads directory.

    The worker enforces that anyway (each tenant has its own root); refusing
    traversal-looking names here tells the user at once instead of failing the job.
    """
    if name.startswith("/") or "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _row_id(request: Request) -> int:
    raw = request.path_params["row_id"]
    if not raw.isdigit() or len(raw) > 18:
        raise HTTPError(404, "no such row")
    return int(raw)


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise HTTPError(400, "body is not JSON") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "body must be a JSON object")
    return body


def create_app(settings: EngineSettings) -> Starlette:
    engine = Engine(settings)

    def endpoint(handler: Any) -> Any:
        async def wrapped(request: Request) -> JSONResponse:
            try:
                response: JSONResponse = await handler(request)
            except HTTPError as exc:
                return _error(exc.status, str(exc))
            except psycopg.DataError as exc:
                # A value PostgreSQL refuses (NUL in text or JSON, ...) is the
                # client's error; the transaction was rolled back with it.
                return _error(422, f"invalid value: {(exc.diag.message_primary or str(exc))[:200]}")
            return response
        return wrapped

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.startup()
        try:
            yield
        finally:
            await engine.shutdown()

    app = Starlette(routes=[
        Route("/api/emails", endpoint(engine.send_email), methods=["POST"]),
        Route("/api/{resource}", endpoint(engine.create), methods=["POST"]),
        Route("/api/{resource}/{row_id}", endpoint(engine.get), methods=["GET"]),
        Route("/api/{resource}/{row_id}", endpoint(engine.patch), methods=["PATCH"]),
    ], lifespan=lifespan)
    app.state.engine = engine
    return app
