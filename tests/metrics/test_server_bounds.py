"""The metrics port closes idle and half-sent connections and serves a bounded number
at once (adversary finding N12)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from conveyor import Event, Router, Worker
from conveyor.metrics import MetricsConfig, MetricsServer
from waiting import wait_for
from worker_support import fast_config

HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"   # no blank line: never ends


def _worker(db: str) -> Worker:
    async def noop(event: Event) -> None:
        pass
    router = Router()
    router.add("metrics.noop", noop)
    return Worker(db, router, fast_config())


# Run in a child process: a client in the server's own process competes with it
# for the GIL, and the kernel's accept queue (5) overflows into 1 s SYN retries.
CLIENT = """
import json, selectors, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
conns = []
for _ in range(n):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(HALF_SENT)
    sock.setblocking(False)
    conns.append(sock)
opened = time.monotonic()
print("opened", flush=True)
selector = selectors.DefaultSelector()
for sock in conns:
    selector.register(sock, selectors.EVENT_READ)
left = len(conns)
while left and time.monotonic() - opened < 60:
    for key, _ in selector.select(1):
        try:
            data = key.fileobj.recv(65536)
        except OSError:
            data = b""
        if not data:
            selector.unregister(key.fileobj)
            left -= 1
print(json.dumps({"left": left, "closed_in": time.monotonic() - opened}), flush=True)
""".replace("HALF_SENT", repr(HALF_SENT))


def test_idle_half_sent_connections_are_capped_and_closed_within_the_timeout(db: str) -> None:
    config = MetricsConfig(request_timeout=1.0, max_connections=8)
    server = MetricsServer(_worker(db), CollectorRegistry(), port=0, config=config).start()
    before = threading.active_count()
    most = before
    child = subprocess.Popen([sys.executable, "-c", CLIENT, str(server.port), "300"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        # Sample the server's threads while the connections are opened, held and closed.
        sampler_stop = threading.Event()

        def sample() -> None:
            nonlocal most
            while not sampler_stop.wait(0.01):
                most = max(most, threading.active_count())
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            assert child.stdout.readline().strip() == "opened"
            outcome = json.loads(child.stdout.readline())
        finally:
            sampler_stop.set()
            sampler.join()
        # The sampler is one thread of its own.
        assert most - before - 1 <= config.max_connections, (before, most)
        assert outcome["left"] == 0, outcome
        # Each held connection is closed at its deadline (plus the server's
        # half-second poll); the loaded machine gets a generous margin on top.
        assert outcome["closed_in"] < 20, outcome
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics",
                                    timeout=10) as response:
            assert response.status == 200
    finally:
        child.kill()
        child.wait()
        server.stop()


def test_a_connection_past_the_cap_is_answered_503_at_once(db: str) -> None:
    config = MetricsConfig(request_timeout=30.0, max_connections=1)
    worker = _worker(db)
    server = MetricsServer(worker, CollectorRegistry(), port=0, config=config).start()
    holder = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        holder.sendall(HALF_SENT)
        wait_for(lambda: server.connections == 1, timeout=10, what="the first connection held")
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as second:
            second.sendall(HALF_SENT)
            answer = second.recv(1024)
        assert answer.startswith(b"HTTP/1.0 503 "), answer
    finally:
        holder.close()
        server.stop()


def test_a_connection_that_trickles_its_request_is_closed_at_its_deadline(db: str) -> None:
    """Each byte within the socket timeout, so only the whole-connection deadline ends it."""
    config = MetricsConfig(request_timeout=1.0)
    server = MetricsServer(_worker(db), CollectorRegistry(), port=0, config=config).start()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    stop = threading.Event()
    sent: list[int] = []

    def trickle() -> None:
        for byte in HALF_SENT * 1000:
            if stop.wait(0.2):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                return
            sent.append(byte)
    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        sock.settimeout(30)
        # EOF (or a reset) from the server, while the client is still sending.
        try:
            while sock.recv(65536):
                pass
        except TimeoutError:
            pytest.fail("the trickling connection was still open after 30 s")
        except OSError:
            pass
        assert sender.is_alive() and len(sent) < len(HALF_SENT) * 1000
    finally:
        stop.set()
        sender.join()
        sock.close()
        server.stop()
