"""Serves ``/metrics``, ``/healthz`` and ``/readyz``: as an ASGI app, or on a port.

The port is served by prometheus_client's exposition and the stdlib's
threading HTTP server, from threads of their own: no new dependency, and a
handler that blocks the worker's event loop cannot block ``/healthz`` too,
which must then say 503, not time out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from conveyor.errors import InvalidInputError
from conveyor.metrics.health import Check, checks_for

if TYPE_CHECKING:
    from conveyor.multitenant import MultiTenantWorker
    from conveyor.worker import Worker

Checks = dict[str, Callable[[], Check]]


def _checks(target: Worker | MultiTenantWorker) -> Checks:
    alive, ready = checks_for(target)
    return {"/healthz": alive, "/readyz": ready}


def _answer(path: str, checks: Checks, registry: CollectorRegistry
            ) -> tuple[int, str, bytes] | None:
    """Status, content type and body for one path; None for an unknown path."""
    if path == "/metrics":
        return 200, CONTENT_TYPE_LATEST, generate_latest(registry)
    if path not in checks:
        return None
    check = checks[path]()
    return (200 if check.ok else 503), "text/plain; charset=utf-8", f"{check.reason}\n".encode()


def metrics_app(worker: Worker | MultiTenantWorker,
                registry: CollectorRegistry | None = None) -> Starlette:
    """A Starlette app serving ``/metrics``, ``/healthz`` and ``/readyz`` for ``worker``
    (a :class:`~conveyor.Worker`, or a :class:`~conveyor.multitenant.MultiTenantWorker`:
    healthy and ready when every tenant's worker is).

    Example::

        app.mount("/conveyor", metrics_app(worker, registry))

    ``registry``: what ``/metrics`` exports. Defaults to prometheus_client's ``REGISTRY``.
    """
    registry = REGISTRY if registry is None else registry
    checks = _checks(worker)

    def endpoint(path: str) -> Any:
        async def answer(request: Request) -> Response:
            status, content_type, body = _answer(path, checks, registry) or (404, "", b"")
            return Response(body, status_code=status, media_type=content_type)
        return answer

    return Starlette(routes=[Route(path, endpoint(path))
                             for path in ("/metrics", "/healthz", "/readyz")])


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port``, from a daemon thread.

    ``port`` 0 picks a free port (read it back from :attr:`port`).
    ``host``: defaults to ``127.0.0.1``; metrics name your topics, so binding
    beyond the machine is a choice to make explicitly.
    """

    def __init__(self, worker: Worker | MultiTenantWorker, registry: CollectorRegistry, *, port: int,
                 host: str = "127.0.0.1") -> None:
        if not 0 <= port <= 65535:
            raise InvalidInputError(f"expected the metrics port to be 0-65535, got {port}")
        handler = _handler_class(_checks(worker), registry)
        try:
            self._server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise InvalidInputError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        self._server.daemon_threads = True
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="conveyor-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()


def _handler_class(checks: Checks, registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            answer = _answer(self.path.split("?", 1)[0], checks, registry)
            status, content_type, body = answer or (404, "text/plain", b"not found\n")
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass   # one line per scrape would drown the worker's own log

    return Handler
