"""Run an ASGI app on a loopback socket in a background thread: start, stop, start again.

The port is reserved (bound, not listening) before the first start, so a client
pointed at it sees "connection refused" while the server is stopped, exactly
like an engine that is down, and the same URL works once it starts.

Example::

    server = ThreadedServer(create_app(settings))
    print(server.url)          # http://127.0.0.1:<port>, refused for now
    server.start()
    ...
    server.stop()
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class ThreadedServer:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.host = host
        self._sock = self._bind(port)
        self.port: int = self._sock.getsockname()[1]
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _bind(self, port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, port))
        return sock

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 10.0) -> None:
        if self.running:
            return
        if self._sock.fileno() == -1:
            self._sock = self._bind(self.port)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="workflow-engine", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving; the port stays reserved, so connections are refused."""
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout)
        self._server = None
        self._thread = None
        self._sock.close()
        self._sock = self._bind(self.port)

    def close(self) -> None:
        self.stop()
        self._sock.close()
