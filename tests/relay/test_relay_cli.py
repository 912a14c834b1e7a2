"""``conveyor relay`` as a real process: relays into NATS, drains on SIGTERM, replays a
window, and refuses what it cannot do in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conveyor import NewEvent, Producer

REPO = Path(__file__).resolve().parents[2]
NATS_URL = "nats://127.0.0.1:4222"

APP = '''
from conveyor.relay import NatsPublisher, Relay

relay = Relay()
relay.route("order.*", NatsPublisher({url!r}, stream={stream!r}, subjects=[{stream!r} + ".>"]),
            destination={stream!r} + ".{{topic}}")
not_a_relay = 42
empty = Relay()
ordered = Relay()
ordered.route("order.*", NatsPublisher({url!r}, stream={stream!r}, subjects=[{stream!r} + ".>"]),
              destination={stream!r} + ".{{topic}}", mode="ordered")
'''


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO / "src")])
    return env


def _conveyor(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conveyor.cli.main", "--database-url", url,
                           *args], cwd=REPO, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def stream(tmp_path: Path) -> Iterator[str]:
    import asyncio

    import nats

    name = f"T{uuid.uuid4().hex[:12]}"
    (tmp_path / "relay_app.py").write_text(APP.format(url=NATS_URL, stream=name))
    yield name

    async def delete() -> None:
        nc = await nats.connect(NATS_URL)
        try:
            await nc.jetstream().delete_stream(name)
        except Exception:  # noqa: BLE001 - a test that never created it
            pass
        await nc.close()
    asyncio.run(delete())


def _messages(name: str) -> int:
    import asyncio

    import nats

    async def count() -> int:
        nc = await nats.connect(NATS_URL)
        try:
            return int((await nc.jetstream().stream_info(name)).state.messages)
        finally:
            await nc.close()
    return asyncio.run(count())


def test_relay_process_publishes_drains_on_sigterm_and_replays(
        fresh_db: str, tmp_path: Path, stream: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        Producer().enqueue_bulk(conn, [NewEvent(topic="order.created", payload=n)
                                       for n in range(200)])
    relay = subprocess.Popen([sys.executable, "-m", "conveyor.cli.main", "--database-url",
                              fresh_db, "relay", "--app", "relay_app:relay"], cwd=REPO,
                             env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 30
        with psycopg.connect(fresh_db, autocommit=True) as conn:
            while conn.execute("SELECT count(*) FROM conveyor.events"
                               " WHERE state <> 'succeeded'").fetchone() != (0,):
                assert time.monotonic() < deadline, "the relay did not relay every event"
                assert relay.poll() is None, relay.communicate()
                time.sleep(0.1)
        relay.send_signal(signal.SIGTERM)
        _, err = relay.communicate(timeout=30)
    finally:
        if relay.poll() is None:
            relay.kill()
    assert relay.returncode == 0, err
    assert "200 succeeded" in err
    assert _messages(stream) == 200
    # A queue that relays makes its history replayable (0027): the partitions
    # the worker made as it started have the replay's index.
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        assert conn.execute("SELECT replayable FROM conveyor.history").fetchone() == (True,)
        indexed = conn.execute("SELECT count(*) FROM pg_class"
                               " WHERE relname LIKE 'events_done_%%_finished_idx'").fetchone()
        assert indexed is not None and indexed[0] >= 2
    done = _conveyor(fresh_db, tmp_path, "relay", "--app", "relay_app:relay", "--replay",
                     "--since", "1h")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "replayed 200 events"
    assert _messages(stream) == 200                 # within the duplicate window: nothing new
    none = _conveyor(fresh_db, tmp_path, "relay", "--app", "relay_app:relay", "--replay",
                     "--since", "2031-01-01T00:00:00Z")
    assert none.stdout.strip() == "replayed 0 events"


def _stream_ids(name: str) -> list[int]:
    import asyncio

    import nats

    async def read() -> list[int]:
        nc = await nats.connect(NATS_URL)
        try:
            js = nc.jetstream()
            count = (await js.stream_info(name)).state.messages
            return [int((await js.get_msg(name, seq)).headers["Nats-Msg-Id"])
                    for seq in range(1, count + 1)]
        finally:
            await nc.close()
    return asyncio.run(read())


def test_ordered_relay_processes_hand_the_stream_over_after_a_kill_and_keep_its_order(
        fresh_db: str, tmp_path: Path, stream: str) -> None:
    def start() -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "conveyor.cli.main", "--database-url",
                                 fresh_db, "relay", "--app", "relay_app:ordered"], cwd=REPO,
                                env=_env(tmp_path), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def relayed(conn: psycopg.Connection[Any]) -> int:
        return int(conn.execute("SELECT count(*) FROM conveyor.events"
                                " WHERE state = 'succeeded'").fetchone()[0])

    first = start()
    second = None
    try:
        with psycopg.connect(fresh_db, autocommit=True) as conn:
            producer = Producer()
            for round_ in range(60):
                with conn.transaction():
                    for n in range(5):
                        producer.enqueue(conn, f"order.r{round_ % 3}", {"n": n})
                if round_ == 20:
                    deadline = time.monotonic() + 30
                    while relayed(conn) == 0:      # the first leads
                        assert time.monotonic() < deadline, first.communicate()
                        time.sleep(0.05)
                    second = start()
                    time.sleep(1.0)
                if round_ == 40:
                    first.send_signal(signal.SIGKILL)
                    first.wait(10)
                time.sleep(0.03)
            deadline = time.monotonic() + 40
            while relayed(conn) < 300:
                assert time.monotonic() < deadline, "the second relay did not take over"
                time.sleep(0.1)
            order = [r[0] for r in conn.execute("SELECT id FROM conveyor.events"
                                                " ORDER BY xid, id").fetchall()]
        assert second is not None
        second.send_signal(signal.SIGTERM)
        _, err = second.communicate(timeout=30)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
    assert second.returncode == 0, err
    assert "ordered stream order.*: " in err and "events relayed" in err
    # The broker dropped what the killed relay had published but not yet marked
    # (the same Nats-Msg-Id): each event once, in transaction order.
    assert _stream_ids(stream) == order


@pytest.mark.parametrize(("args", "message"), [
    (["--app", "relay_app:not_a_relay"], "--app 'relay_app:not_a_relay' is a int, not a "
                                         "conveyor.relay.Relay"),
    (["--app", "relay_app:empty"], "--app 'relay_app:empty' relays no topic"),
    (["--app", "relay_app:relay", "--retention", "0"], "--retention 0 deletes each event as "
                                                       "it is relayed"),
    (["--app", "relay_app:relay", "--replay"], "--replay needs --since"),
    (["--app", "relay_app:ordered", "--metrics-port", "9"], "--metrics-port needs a route the "
                                                            "worker serves"),
    (["--app", "relay_app:ordered", "--tenant", "acme"], "--tenant limits a worker's claims; an "
                                                         "ordered stream is every tenant's"),
    (["--app", "relay_app:relay", "--since", "1h"], "--since and --until go with --replay"),
    (["--app", "relay_app:relay", "--replay", "--since", "yesterday"],
     "invalid time 'yesterday': expected ISO 8601 with an offset"),
])
def test_relay_refuses_in_one_line(fresh_db: str, tmp_path: Path, stream: str,
                                   args: list[str], message: str) -> None:
    done = _conveyor(fresh_db, tmp_path, "relay", *args)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
