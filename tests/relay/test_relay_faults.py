"""The relay under faults, against a private nats-server (JetStream, file storage, its
own port and directory) that the test kills and restarts; the machine's server on
4222 is never touched.

A ledger on the consumer side (every message the stream holds, by its
``Nats-Msg-Id``) is set against every committed event: nothing lost, nothing
published that was never committed, nothing stored twice (the relay's retries
and the replays of a restarted relay are dropped by the stream's duplicate
window).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from conveyor import NewEvent, Producer

REPO = Path(__file__).resolve().parents[2]
STREAM = "FAULTS"

pytestmark = pytest.mark.slow

APP = '''
from conveyor.relay import NatsPublisher, Relay

relay = Relay()
relay.route("order.*", NatsPublisher({url!r}, stream="FAULTS", subjects=["faults.>"],
                                     timeout=1.0),
            destination="faults.{{topic}}")
'''


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NatsServer:
    """A private nats-server with JetStream on a file store, restartable on the same data."""

    def __init__(self, directory: Path) -> None:
        self.port = _free_port()
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["nats-server", "-js", "-a", "127.0.0.1", "-p", str(self.port),
             "-sd", str(self.directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "nats-server did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.kill()


def _relay(url: str, app_dir: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(app_dir), str(REPO / "src")])
    return subprocess.Popen([sys.executable, "-m", "conveyor.cli.main", "--database-url", url,
                             "--log-level", "error", "relay", "--app", "fault_app:relay",
                             "--lease-ttl", "2", "--rescue-interval", "0.5",
                             "--concurrency", "50"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _ledger(url: str) -> list[int]:
    """Every message id the stream holds, one entry per stored message."""
    import nats

    async def read() -> list[int]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(STREAM)
            ids = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await js.get_msg(STREAM, seq)
                ids.append(int((msg.headers or {})["Nats-Msg-Id"]))
            return ids
        finally:
            await nc.close()
    return asyncio.run(read())


def _unrelayed(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM conveyor.events WHERE state <> 'succeeded'"
                           ).fetchone()
    return int(row[0]) if row else -1


def test_a_relay_killed_again_and_again_and_a_broker_restarted_lose_and_double_nothing(
        fresh_db: str, nats_server: NatsServer, tmp_path: Path) -> None:
    (tmp_path / "fault_app.py").write_text(APP.format(url=nats_server.url))
    rng = random.Random(7)
    committed: list[int] = []
    producer = Producer()

    def write(n: int) -> None:
        with psycopg.connect(fresh_db) as conn:
            committed.extend(producer.enqueue_many(
                conn, [NewEvent(topic="order.created", payload={"n": i}) for i in range(n)]))
        # A transaction that rolls back: its events must never reach the broker.
        with psycopg.connect(fresh_db) as conn:
            producer.enqueue_bulk(conn, [NewEvent(topic="order.created", payload="rolled back")
                                         for _ in range(20)])
            conn.rollback()

    write(1500)
    kills = restarts = 0
    relays = [_relay(fresh_db, tmp_path), _relay(fresh_db, tmp_path)]
    try:
        deadline = time.monotonic() + 120
        phase_end = time.monotonic() + 12
        while time.monotonic() < phase_end:
            time.sleep(rng.uniform(0.5, 1.5))
            victim = rng.randrange(len(relays))
            relays[victim].kill()                      # SIGKILL: no drain, leases left behind
            relays[victim].wait()
            relays[victim] = _relay(fresh_db, tmp_path)
            kills += 1
            if kills % 4 == 0:
                write(300)                             # more events while it all goes on
            if kills % 5 == 0:
                nats_server.kill()                     # the broker dies mid-stream
                time.sleep(rng.uniform(0.5, 2.0))
                nats_server.start()
                restarts += 1
        while _unrelayed(fresh_db):
            assert time.monotonic() < deadline, f"{_unrelayed(fresh_db)} events never relayed"
            assert all(r.poll() is None for r in relays), [r.stderr.read() for r in relays
                                                            if r.stderr and r.poll() is not None]
            time.sleep(0.2)
    finally:
        for r in relays:
            r.send_signal(signal.SIGTERM)
        for r in relays:
            try:
                r.wait(timeout=30)
            except subprocess.TimeoutExpired:
                r.kill()
    ledger = _ledger(nats_server.url)
    print(f"\n{len(committed)} events committed, {kills} relay processes SIGKILLed, the broker "
          f"killed and restarted {restarts} times: {len(ledger)} messages in the stream, "
          f"{len(set(ledger))} distinct")
    assert kills >= 8 and restarts >= 1, (kills, restarts)
    assert sorted(ledger) == sorted(committed), (
        f"lost {sorted(set(committed) - set(ledger))[:10]}, never committed "
        f"{sorted(set(ledger) - set(committed))[:10]}, stored twice "
        f"{len(ledger) - len(set(ledger))}")
