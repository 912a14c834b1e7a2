"""The example workflow engine: registrations and events over HTTP, verified by service JWT.

Routes (all JSON; the tenant is the Host subdomain, ``acme.workflow.test``)::

    PUT  /api/workflow/object-types/{name}  register an object type  201 | 200 | 409
    PUT  /api/workflow/triggers/{name}      register a trigger       201 | 200 | 409
    GET  /api/workflow/definitions          the catalogue
    POST /api/workflow/events               one event; Idempotency-Key required
                                            202 new | 200 duplicate | 422 invalid
    GET  /api/workflow/events               this tenant's recorded events
    POST /_control/fail-next                {"count": N, "status": 500}: answer the next
                                            N event deliveries with that status
                                            (only with allow_control=True, for tests)
    GET  /healthz

Every /api call needs ``Authorization: Bearer <HS256 JWT>`` with the expected
audience and issuer, a role in ``roles`` and a ``tenant`` claim equal to the
Host's tenant. The algorithm is pinned; ``exp``, ``iat``, ``iss``, ``aud`` and
``sub`` are required.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import jwt
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from examples.workflow_engine.store import Conflict, WorkflowStore

LEEWAY_SECONDS = 5
_TENANT_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_NAME_RE = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*")


@dataclass(frozen=True, kw_only=True)
class WorkflowEngineSettings:
    """How the example engine authenticates and where it keeps its records.

    Attributes:
        jwt_secret: shared HS256 secret (at least 32 bytes).
        tenant_domain: tenant ``acme`` is ``Host: acme.<tenant_domain>``. Defaults to
            ``"workflow.test"``.
        audience: required ``aud``. Defaults to ``"workflow"``.
        issuers: accepted ``iss``. Defaults to ``("conveyor",)``.
        roles: roles allowed to register and publish. Defaults to ``("conveyor-workflow",)``.
        state_file: JSON file of the records; ``None`` keeps them in memory. Defaults to ``None``.
        allow_control: serve ``/_control/fail-next``. Defaults to ``False``.
    """

    jwt_secret: str = field(repr=False)
    tenant_domain: str = "workflow.test"
    audience: str = "workflow"
    issuers: tuple[str, ...] = ("conveyor",)
    roles: tuple[str, ...] = ("conveyor-workflow",)
    state_file: str | None = None
    allow_control: bool = False


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class WorkflowEngine:
    """The engine's behaviour, independent of the HTTP framing."""

    def __init__(self, settings: WorkflowEngineSettings) -> None:
        if len(settings.jwt_secret.encode()) < 32:
            raise ValueError("expected jwt_secret to be at least 32 bytes")
        self.settings = settings
        self.store = WorkflowStore(settings.state_file)
        self._faults_lock = threading.Lock()
        self._fail_next = 0
        self._fail_status = 500
        self.calls = 0

    # --------------------------------------------------------------- knobs

    def fail_next(self, count: int, status: int = 500) -> None:
        """Answer the next ``count`` event deliveries with ``status`` (for tests)."""
        if count < 0 or not 400 <= status <= 599:
            raise ValueError(f"expected count >= 0 and a 4xx/5xx status, got {count}, {status}")
        with self._faults_lock:
            self._fail_next, self._fail_status = count, status

    def _injected_fault(self) -> int | None:
        with self._faults_lock:
            self.calls += 1
            if self._fail_next <= 0:
                return None
            self._fail_next -= 1
            return self._fail_status

    # ---------------------------------------------------------------- auth

    def tenant_of(self, request: Request) -> str:
        host = (request.headers.get("host") or "").split(":")[0].lower()
        suffix = "." + self.settings.tenant_domain
        tenant = host[: -len(suffix)] if host.endswith(suffix) else ""
        if not _TENANT_RE.fullmatch(tenant):
            raise HTTPError(404, "unknown tenant")
        return tenant

    def authorize(self, request: Request) -> str:
        tenant = self.tenant_of(request)
        header = request.headers.get("authorization", "")
        if not header.startswith("Bearer "):
            raise HTTPError(401, "missing bearer token")
        try:
            claims: dict[str, Any] = jwt.decode(
                header[7:], self.settings.jwt_secret, algorithms=["HS256"],
                audience=self.settings.audience, issuer=list(self.settings.issuers),
                leeway=LEEWAY_SECONDS, options={"require": ["exp", "iat", "iss", "aud", "sub"]})
        except jwt.PyJWTError as exc:
            raise HTTPError(401, f"invalid token: {exc}") from None
        if claims.get("tenant") != tenant:
            raise HTTPError(403, "token is for another tenant")
        if claims.get("role") not in self.settings.roles:
            raise HTTPError(403, f"role {claims.get('role')!r} may not use the workflow API")
        return tenant

    # ------------------------------------------------------------ handlers

    async def put_object_type(self, request: Request) -> JSONResponse:
        self.authorize(request)
        name = _name(request)
        body = await _json_body(request)
        definition = {"source": _text(body, "source", required=True),
                      "description": _text(body, "description"),
                      "id_field": _text(body, "id_field", required=True)}
        return self._register("object_types", name, definition)

    async def put_trigger(self, request: Request) -> JSONResponse:
        self.authorize(request)
        name = _name(request)
        body = await _json_body(request)
        fields = body.get("fields", [])
        if not isinstance(fields, list) or not all(
                isinstance(f, dict) and isinstance(f.get("name"), str) for f in fields):
            raise HTTPError(400, "fields must be a list of {name, description, required}")
        definition = {"source": _text(body, "source", required=True),
                      "object_type": _text(body, "object_type", required=True),
                      "description": _text(body, "description"),
                      "fields": [{"name": f["name"], "description": str(f.get("description", "")),
                                  "required": bool(f.get("required", True))} for f in fields]}
        return self._register("triggers", name, definition)

    def _register(self, kind: str, name: str, definition: dict[str, Any]) -> JSONResponse:
        try:
            result = self.store.register(kind, name, definition)
        except Conflict as exc:
            raise HTTPError(409, str(exc)) from None
        return JSONResponse({"result": result, "definition": definition},
                            status_code=201 if result == "created" else 200)

    async def definitions(self, request: Request) -> JSONResponse:
        self.authorize(request)
        return JSONResponse(self.store.definitions())

    async def post_event(self, request: Request) -> JSONResponse:
        tenant = self.authorize(request)
        fault = self._injected_fault()
        if fault is not None:
            return JSONResponse({"error": f"injected failure {fault}"}, status_code=fault)
        key = request.headers.get("idempotency-key", "")
        if not key or len(key) > 200:
            raise HTTPError(400, "Idempotency-Key header is required (at most 200 characters)")
        body = await _json_body(request)
        trigger_name = _text(body, "trigger", required=True)
        trigger = self.store.trigger(trigger_name)
        if trigger is None:
            raise HTTPError(422, f"trigger {trigger_name!r} is not registered")
        fields = body.get("fields")
        if not isinstance(fields, dict):
            raise HTTPError(422, "fields must be an object")
        missing = [f["name"] for f in trigger["fields"] if f["required"] and f["name"] not in fields]
        if missing:
            raise HTTPError(422, f"trigger {trigger_name!r} needs field(s): {', '.join(missing)}")
        is_new, record_id = self.store.record_event(tenant, key, {
            "trigger": trigger_name, "source": body.get("source"),
            "object_type": trigger["object_type"], "object_id": body.get("object_id"),
            "fields": fields, "event_id": body.get("event_id"), "attempt": body.get("attempt")})
        return JSONResponse({"result": "accepted" if is_new else "duplicate", "id": record_id},
                            status_code=202 if is_new else 200)

    async def list_events(self, request: Request) -> JSONResponse:
        tenant = self.authorize(request)
        return JSONResponse({"events": self.store.events(tenant),
                             "duplicates": self.store.duplicates(tenant)})

    async def control_fail_next(self, request: Request) -> JSONResponse:
        if not self.settings.allow_control:
            raise HTTPError(404, "not found")
        body = await _json_body(request)
        try:
            self.fail_next(int(body.get("count", 0)), int(body.get("status", 500)))
        except (TypeError, ValueError) as exc:
            raise HTTPError(400, str(exc)) from None
        return JSONResponse({"fail_next": body.get("count", 0)})


def _name(request: Request) -> str:
    name = str(request.path_params["name"])
    if not _NAME_RE.fullmatch(name) or len(name) > 200:
        raise HTTPError(400, f"invalid name {name[:80]!r}")
    return name


def _text(body: dict[str, Any], key: str, *, required: bool = False) -> str:
    value = body.get(key, "")
    if not isinstance(value, str) or (required and not value):
        raise HTTPError(400, f"{key} must be a{' non-empty' if required else ''} string")
    return value


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise HTTPError(400, "body is not JSON") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "body must be a JSON object")
    return body


def create_app(settings: WorkflowEngineSettings) -> Starlette:
    """The Starlette application; ``app.state.engine`` is the :class:`WorkflowEngine`."""
    engine = WorkflowEngine(settings)

    def endpoint(handler: Any) -> Any:
        async def wrapped(request: Request) -> JSONResponse:
            try:
                response: JSONResponse = await handler(request)
            except HTTPError as exc:
                return JSONResponse({"error": str(exc)}, status_code=exc.status)
            return response
        return wrapped

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    app = Starlette(routes=[
        Route("/healthz", healthz, methods=["GET"]),
        Route("/api/workflow/object-types/{name}", endpoint(engine.put_object_type), methods=["PUT"]),
        Route("/api/workflow/triggers/{name}", endpoint(engine.put_trigger), methods=["PUT"]),
        Route("/api/workflow/definitions", endpoint(engine.definitions), methods=["GET"]),
        Route("/api/workflow/events", endpoint(engine.post_event), methods=["POST"]),
        Route("/api/workflow/events", endpoint(engine.list_events), methods=["GET"]),
        Route("/_control/fail-next", endpoint(engine.control_fail_next), methods=["POST"]),
    ])
    app.state.engine = engine
    return app
