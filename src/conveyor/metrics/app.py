"""Serves ``/metrics``, ``/healthz`` and ``/readyz``: as an ASGI app, or on a port.

The port is served by prometheus_client's exposition and the stdlib's
threading HTTP server, from threads of their own: no new dependency, and a
handler that blocks the worker's event loop cannot block ``/healthz`` too,
which must then say 503, not time out.

The port is bounded (adversary finding N12): at most
``MetricsConfig.max_connections`` connections are served at once (one more is
answered 503 and closed), and each is closed ``request_timeout`` seconds after
it was accepted, however slowly it sends its request or reads the answer.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from conveyor.errors import InvalidInputError
from conveyor.metrics.config import MetricsConfig
from conveyor.metrics.health import Check, checks_for

if TYPE_CHECKING:
    from conveyor.multitenant import MultiTenantWorker
    from conveyor.worker import Worker

Checks = dict[str, Callable[[], Check]]

log = logging.getLogger(__name__)


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
    ``config``: ``max_connections`` and ``request_timeout`` bound the port.
    Defaults to ``MetricsConfig()`` (16 connections, 10 s each).
    """

    def __init__(self, worker: Worker | MultiTenantWorker, registry: CollectorRegistry, *, port: int,
                 host: str = "127.0.0.1", config: MetricsConfig | None = None) -> None:
        if not 0 <= port <= 65535:
            raise InvalidInputError(f"expected the metrics port to be 0-65535, got {port}")
        config = config or MetricsConfig()
        handler = _handler_class(_checks(worker), registry, config.request_timeout)
        try:
            self._server = _BoundedServer((host, port), handler, config)
        except OSError as exc:
            raise InvalidInputError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port/metrics``, as a scraper would be configured."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def connections(self) -> int:
        """Connections being served now (at most ``max_connections``)."""
        return self._server.open_connections()

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


_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
         b"Content-Length: 25\r\nConnection: close\r\n\r\ntoo many connections, later\n")


class _BoundedServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a thread per connection, but ``max_connections`` at most,
    each shut down ``request_timeout`` after it was accepted."""

    daemon_threads = True
    # The kernel's queue of connections not yet accepted (socketserver's
    # default is 5): a burst past it waits for SYN retries, a second each.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 config: MetricsConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        # Accepted connection -> its deadline (time.monotonic()).
        self._open: dict[socket.socket, float] = {}
        super().__init__(address, handler)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = len(self._open) >= self._config.max_connections
            if not full:
                self._open[request] = time.monotonic() + self._config.request_timeout
        if full:
            # Answered from the accepting thread without waiting: a client
            # that does not read gets a closed socket instead.
            with contextlib.suppress(OSError):
                request.setblocking(False)
                request.send(_BUSY)
                # What the client sent, read so the close is a FIN: an unread
                # request would make it a reset, which may drop the answer.
                request.recv(65536)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: socket.socket) -> None:
        with self._lock:
            self._open.pop(request, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client gone, or cut at its deadline, is routine: socketserver's
        # default would print a traceback on stderr for each.
        log.debug("metrics connection from %s ended early", client_address, exc_info=True,
                  extra={"action": "metrics_connection_ended"})

    def service_actions(self) -> None:
        # serve_forever calls this between polls (every half second): the
        # socket timeout bounds each read and write, this the whole
        # connection, which a client trickling a byte at a time would stretch.
        now = time.monotonic()
        with self._lock:
            late = [request for request, deadline in self._open.items() if deadline <= now]
        for request in late:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)


def _handler_class(checks: Checks, registry: CollectorRegistry,
                   timeout: float) -> type[BaseHTTPRequestHandler]:
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

    Handler.timeout = timeout   # each read and write; StreamRequestHandler applies it
    return Handler
