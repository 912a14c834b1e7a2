"""The relay under faults, against private brokers (a nats-server with JetStream on a
file store, a redis-server with an fsync-always append-only file, each on its own
port and directory) that the tests kill, restart, fill and cut off through a TCP
proxy; the machine's servers are never touched.

A ledger on the consumer side (every message the stream holds, by its
``Nats-Msg-Id``) is set against every committed event: nothing lost, nothing
published that was never committed, nothing stored twice (the relay's retries
and the replays of a restarted relay are dropped by the stream's duplicate
window).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from conveyor import BrokerUnavailableError, NewEvent, Producer
from conveyor.relay import NatsPublisher

REPO = Path(__file__).resolve().parents[2]
STREAM = "FAULTS"

# light: kills, restarts and fills private brokers (own ports and directories) and
# relay processes, mostly waiting on them: a storm is counted in kills, not seconds,
# and what is checked (nothing lost, doubled or reordered) holds on a loaded machine;
# the only bounds are the drain's 120-180 s. They ran 257 s of the serial tier's 662 s
# (2026-12-03), at under half a core.
pytestmark = [pytest.mark.slow, pytest.mark.light]

APP = '''
from conveyor.relay import NatsPublisher, Relay

relay = Relay()
relay.route("order.*", NatsPublisher({url!r}, stream="FAULTS", subjects=["faults.>"],
                                     timeout=1.0),
            destination="faults.{{topic}}"{options})
'''


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateServer:
    """A broker process of the test's own: started on its port, SIGKILLed, started again."""

    name = ""
    process: subprocess.Popen[bytes] | None = None

    def __init__(self, directory: Path) -> None:
        self.port = _free_port()
        self.directory = directory

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        self.process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        self.wait_for_port()

    def wait_for_port(self, seconds: float = 15, exited: Callable[[], str] | None = None) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert self.process is not None
                if exited is not None:
                    assert self.process.poll() is None, f"{self.name} exited at start: {exited()}"
                assert time.monotonic() < deadline, f"{self.name} did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class NatsServer(PrivateServer):
    """A private nats-server with JetStream on a file store, restartable on the same data."""

    name = "nats-server"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return ["nats-server", "-js", "-a", "127.0.0.1", "-p", str(self.port),
                "-sd", str(self.directory)]


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.kill()


class RedisServer(PrivateServer):
    """A private redis-server whose acknowledged writes survive a SIGKILL (AOF, fsync always)."""

    name = "redis-server"

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        directory.mkdir()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.directory), "--appendonly", "yes", "--appendfsync", "always",
                "--save", ""]

    def config_set(self, name: str, value: str) -> None:
        import redis

        with redis.Redis(port=self.port) as client:
            client.config_set(name, value)


class RabbitServer(PrivateServer):
    """A private rabbitmq-server: its own node name, ports, config and data directory."""

    name = "rabbitmq-server"

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        for sub in ("data", "log"):
            (directory / sub).mkdir(parents=True)
        # The server drops to the rabbitmq user: its directories must be writable by it.
        for path in (directory, directory / "data", directory / "log"):
            path.chmod(0o777)
        (directory / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\nloopback_users = none\n")
        (directory / "enabled_plugins").write_text("[].\n")
        self.node = f"conveyor-test-{self.port}@localhost"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def start(self) -> None:
        env = {**os.environ, "RABBITMQ_NODENAME": self.node,
               "RABBITMQ_NODE_PORT": str(self.port), "RABBITMQ_DIST_PORT": str(_free_port()),
               "RABBITMQ_CONFIG_FILE": str(self.directory / "rabbitmq.conf"),
               "RABBITMQ_MNESIA_BASE": str(self.directory / "data"),
               "RABBITMQ_LOG_BASE": str(self.directory / "log"),
               "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.directory / "enabled_plugins"),
               "RABBITMQ_PID_FILE": str(self.directory / "pid")}
        out = self.directory / "server.out"
        with out.open("ab") as sink:
            self.process = subprocess.Popen(["rabbitmq-server"], env=env, start_new_session=True,
                                            stdout=sink, stderr=subprocess.STDOUT)
        self.wait_for_port(60, lambda: out.read_text()[-1500:])
        self.wait_for_broker(60, lambda: out.read_text()[-1500:])

    def wait_for_broker(self, seconds: float, log: Callable[[], str]) -> None:
        """Wait until a client can open a connection, not only the port.

        A booting broker listens before it serves: it accepted the test's first
        connection and closed it before the first frame (CI, 2026-12-03).
        """
        import aio_pika
        import aiormq

        # Every way a half-booted broker says no: a refused or reset socket, a
        # connection closed before its first frame, a handshake that times out.
        refusals = (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                    aiormq.exceptions.AMQPError)

        async def attempt() -> None:
            await (await aio_pika.connect(self.url, timeout=5)).close()
        deadline = time.monotonic() + seconds
        while True:
            try:
                asyncio.run(attempt())
                return
            except refusals as error:
                assert self.process is not None and self.process.poll() is None, \
                    f"{self.name} exited at start: {log()}"
                assert time.monotonic() < deadline, f"{self.name} did not serve: {error!r}"
                time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the whole server (the start script, the Erlang VM and its helpers).

        Debian's start script drops to the rabbitmq user through `su`, whose child
        starts a session of its own: killing the started process group leaves the
        Erlang VM running (each test left one behind, 125 MB apiece). Every process
        of the server carries its node name in its environment, so that finds them.
        """
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def processes(self) -> list[int]:
        """The live processes of this server: those with its node name in their environment."""
        marker = f"RABBITMQ_NODENAME={self.node}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:   # gone meanwhile, or not ours to read
                continue
            if marker in environ.split(b"\0") and state != "Z":
                found.append(int(entry.name))
        return found


class TcpProxy:
    """A TCP proxy on its own thread that can cut every connection or stop forwarding.

    ``hold``: whether to keep a chunk of what a client sends (and what follows
    it) from the server, for as long as it says so.
    """

    def __init__(self, target_port: int) -> None:
        self.port = _free_port()
        self.target_port = target_port
        self.stalled = threading.Event()
        self.hold: Callable[[bytes], bool] | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def serve() -> None:
            await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            self._ready.set()
        self._loop.run_until_complete(serve())
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       upstream: bool) -> None:
            try:
                while data := await src.read(65536):
                    while self.stalled.is_set() or (
                            upstream and self.hold is not None and self.hold(data)):
                        await asyncio.sleep(0.01)
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()
        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))
        self._writers -= {writer, up_writer}

    def cut(self) -> None:
        """Close every connection through the proxy, both sides, at once."""
        def close_all() -> None:
            for writer in list(self._writers):
                writer.transport.abort()
        self._loop.call_soon_threadsafe(close_all)

    def stop(self) -> None:
        async def shut() -> None:
            # Every connection cut and its task ended, none left pending for the
            # stopped loop to report as destroyed.
            for writer in list(self._writers):
                writer.transport.abort()
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


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


def _write(url: str, committed: list[int], n: int) -> None:
    producer = Producer()
    with psycopg.connect(url) as conn:
        committed.extend(producer.enqueue_many(
            conn, [NewEvent(topic="order.created", payload={"n": i}) for i in range(n)]))
    with psycopg.connect(url) as conn:     # rolled back: must never reach the broker
        producer.enqueue_bulk(conn, [NewEvent(topic="order.created", payload="rolled back")
                                     for _ in range(20)])
        conn.rollback()


class SteadyWriter:
    """Commits 20 events every 20 ms on its own thread, so every fault hits publishes in flight."""

    def __init__(self, url: str, committed: list[int]) -> None:
        self._url = url
        self._committed = committed
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SteadyWriter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(10)

    def _run(self) -> None:
        producer = Producer()
        with psycopg.connect(self._url) as conn:
            while not self._done.wait(0.02):
                # Twenty tenants: the per-key run relays each one's events in order.
                # t0 comes twice, first: its second event must wait for its first
                # to be confirmed, while t1..t19's, written after it, are relayed
                # beside that first one; so per-key order is never id order. (With
                # one event per tenant and transaction, the heads of all keys are
                # one transaction's events, and a run relayed them in id order.)
                ids = producer.enqueue_many(conn, [
                    NewEvent(topic="order.created", payload={"steady": i}, tenant=f"t{i}")
                    for i in (0, *range(20))])
                conn.commit()
                self._committed.extend(ids)


def _stop(relays: list[subprocess.Popen[bytes]]) -> None:
    for r in relays:
        r.send_signal(signal.SIGTERM)
    for r in relays:
        try:
            r.wait(timeout=30)
        except subprocess.TimeoutExpired:
            r.kill()


def _drained(url: str, relays: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _unrelayed(url):
        assert time.monotonic() < deadline, f"{_unrelayed(url)} events never relayed"
        assert all(r.poll() is None for r in relays), [r.stderr.read() for r in relays
                                                        if r.stderr and r.poll() is not None]
        time.sleep(0.2)


def _storm(url: str, app_dir: Path, committed: list[int], rng: random.Random,
           fault: Callable[[int], None], kills: int) -> int:
    """Two relays, one SIGKILLed (no drain, leases left behind) and replaced every 0.5-1.5 s
    under the steady writer, ``fault(kill)`` after each kill, until ``kills`` were; then every
    event relayed and the relays stopped. Returns how many were killed.

    The storm is counted in kills, not seconds: a fixed 12 s storm got as few as
    4 kills on a loaded machine, where each broker restart took seconds of it.
    """
    killed = 0
    relays = [_relay(url, app_dir), _relay(url, app_dir)]
    try:
        with SteadyWriter(url, committed):
            while killed < kills:
                time.sleep(rng.uniform(0.5, 1.5))
                victim = rng.randrange(len(relays))
                relays[victim].kill()
                relays[victim].wait()
                relays[victim] = _relay(url, app_dir)
                killed += 1
                fault(killed)
        _drained(url, relays, 180)
    finally:
        _stop(relays)
    return killed


def _exactly_once(ledger: list[int], committed: list[int]) -> None:
    assert sorted(ledger) == sorted(committed), (
        f"lost {sorted(set(committed) - set(ledger))[:10]}, never committed "
        f"{sorted(set(ledger) - set(committed))[:10]}, stored twice "
        f"{len(ledger) - len(set(ledger))}")


def _none_parked(url: str) -> None:
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT count(*) FROM conveyor.events WHERE state = 'failed'"
                            ).fetchone() == (0,)


def _nats_storm(url: str, server: NatsServer, app_dir: Path, seed: int, options: str = "",
                initial: int = 0) -> tuple[list[int], list[int]]:
    """The kill storm against a relay into the private nats-server (the route's extra
    ``options`` appended to its Relay.route call), the broker killed and restarted every
    fifth kill; (committed ids, the stream's ledger), every committed event in it once."""
    (app_dir / "fault_app.py").write_text(APP.format(url=server.url, options=options))
    rng = random.Random(seed)
    committed: list[int] = []
    if initial:
        _write(url, committed, initial)
    restarts = 0

    def fault(kills: int) -> None:
        nonlocal restarts
        if kills % 5 == 0:
            server.kill()                          # the broker dies mid-stream
            time.sleep(rng.uniform(0.5, 1.5))
            server.start()
            restarts += 1

    kills = _storm(url, app_dir, committed, rng, fault, kills=10)
    ledger = _ledger(server.url)
    print(f"\n{len(committed)} events committed, {kills} relays SIGKILLed, the broker killed "
          f"and restarted {restarts} times: {len(ledger)} messages in the stream")
    assert kills >= 8 and restarts >= 1, (kills, restarts)
    _exactly_once(ledger, committed)
    return committed, ledger


def test_a_relay_killed_again_and_again_and_a_broker_restarted_lose_and_double_nothing(
        fresh_db: str, nats_server: NatsServer, tmp_path: Path) -> None:
    _nats_storm(fresh_db, nats_server, tmp_path, 7, initial=1500)
    _none_parked(fresh_db)


def test_an_ordered_stream_through_kills_and_broker_restarts_keeps_its_order(
        fresh_db: str, nats_server: NatsServer, tmp_path: Path) -> None:
    _, ledger = _nats_storm(fresh_db, nats_server, tmp_path, 13, ', mode="ordered"',
                            initial=500)
    with psycopg.connect(fresh_db) as conn:
        order = [r[0] for r in conn.execute(
            "SELECT id FROM conveyor.events ORDER BY xid, id").fetchall()]
    # The stream holds them in transaction order: never one before an earlier one.
    assert ledger == order


def test_per_key_through_kills_and_broker_restarts_keeps_each_tenants_order(
        fresh_db: str, nats_server: NatsServer, tmp_path: Path) -> None:
    _, ledger = _nats_storm(fresh_db, nats_server, tmp_path, 17,
                            ', mode="per_key", key="tenant"')
    with psycopg.connect(fresh_db) as conn:
        tenant_of = dict(conn.execute("SELECT id, tenant FROM conveyor.events").fetchall())
    # Each tenant's events in the stream in their enqueue order.
    for tenant in {f"t{i}" for i in range(20)}:
        mine = [i for i in ledger if tenant_of[i] == tenant]
        assert len(mine) > 100, (tenant, len(mine))
        inverted = next(((a, b) for a, b in itertools.pairwise(mine) if a > b), None)
        assert inverted is None, _out_of_order(fresh_db, ledger, tenant, inverted)
    # Tenants interleave: the keys ran side by side, not as one stream in id order
    # (t0's second event of a transaction comes after t1..t19's; SteadyWriter).
    assert ledger != sorted(ledger)


def _out_of_order(url: str, ledger: list[int], tenant: str, pair: tuple[int, int]) -> str:
    """What the stream and the table say of two events of one key relayed out of order."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT id, state, attempts, limited, created_at, run_at, attempted_at, finished_at,"
            "       errors FROM conveyor.events WHERE id = ANY(%s) ORDER BY id",
            (list(pair),)).fetchall()
    return (f"tenant {tenant}: {pair[0]} was relayed before {pair[1]}, at stream positions "
            f"{ledger.index(pair[0])} and {ledger.index(pair[1])}; the rows: {rows}")


REDIS_APP = '''
from conveyor.relay import RedisStreamPublisher, Relay

relay = Relay()
relay.route("order.*", RedisStreamPublisher({url!r}, key_prefix="faults:relayed:", timeout=1.0),
            destination="faults:{{topic}}")
'''


def _redis_ledger(url: str) -> list[int]:
    import redis

    with redis.Redis.from_url(url) as client:
        return [int(fields[b"conveyor-event-id"])
                for _, fields in client.xrange("faults:order.created")]


def test_redis_killed_restarted_and_full_with_relays_killed_loses_and_doubles_nothing(
        fresh_db: str, tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    (tmp_path / "fault_app.py").write_text(REDIS_APP.format(url=server.url))
    rng = random.Random(11)
    committed: list[int] = []
    _write(fresh_db, committed, 1500)
    restarts = fills = 0

    def fault(kills: int) -> None:
        nonlocal restarts, fills
        if kills % 5 == 0:
            server.kill()                          # SIGKILL: only the append-only file remains
            time.sleep(rng.uniform(0.5, 1.5))
            server.start()
            restarts += 1
        if kills % 7 == 3:
            server.config_set("maxmemory", "1")    # full: every write refused (OOM)
            time.sleep(1.5)
            server.config_set("maxmemory", "0")
            fills += 1

    try:
        kills = _storm(fresh_db, tmp_path, committed, rng, fault, kills=10)
        ledger = _redis_ledger(server.url)
    finally:
        server.kill()
    print(f"\n{len(committed)} events committed, {kills} relays SIGKILLed, Redis killed and "
          f"restarted {restarts} times and full {fills} times: {len(ledger)} entries")
    assert kills >= 8 and restarts >= 1 and fills >= 1, (kills, restarts, fills)
    _exactly_once(ledger, committed)
    _none_parked(fresh_db)


async def test_a_stream_nats_does_not_create_in_time_is_a_broker_away_not_a_crash(
        nats_server: NatsServer) -> None:
    # Seen under load: a relay starting while the broker stalled found no
    # stream, and its request to create one timed out; that TimeoutError
    # escaped the start's check (only the lookup's was caught) and ended the
    # `conveyor relay` process instead of leaving its events to wait.
    import nats

    proxy = TcpProxy(nats_server.port)
    proxy.start()
    proxy.hold = lambda data: b"$JS.API.STREAM.CREATE." in data
    publisher = NatsPublisher(f"nats://127.0.0.1:{proxy.port}", stream="HELD",
                              subjects=["held.>"], timeout=0.5)
    try:
        with pytest.raises(BrokerUnavailableError,
                           match="NATS did not answer for stream 'HELD'"):
            await publisher.start()
        proxy.hold = None
        await publisher.start()     # the next try creates it
        nc = await nats.connect(nats_server.url)
        try:
            info = await nc.jetstream().stream_info("HELD")
        finally:
            await nc.close()
        assert info.config.subjects == ["held.>"]
    finally:
        await publisher.aclose()
        proxy.stop()


async def test_an_exchange_rabbitmq_does_not_declare_in_time_is_a_broker_away_not_a_crash(
) -> None:
    # The same for RabbitMQ: connected, a publisher whose exchange declaration
    # went unanswered raised asyncio's TimeoutError from its start, and from
    # a publish a failure that spent every event's attempt, not a wait. The
    # machine's broker, behind a proxy that holds the declaration back.
    import aio_pika

    from conveyor.relay import RabbitMQPublisher

    name = f"held-{os.getpid()}-{random.randrange(10**6)}"
    proxy = TcpProxy(5672)
    proxy.start()
    proxy.hold = lambda data: name.encode() in data
    publisher = RabbitMQPublisher(f"amqp://guest:guest@127.0.0.1:{proxy.port}/", exchange=name,
                                  timeout=0.5)
    connection = await aio_pika.connect("amqp://guest:guest@127.0.0.1:5672/")
    try:
        with pytest.raises(BrokerUnavailableError,
                           match=f"RabbitMQ did not set up exchange '{name}'"):
            await publisher.start()
        proxy.hold = None
        await publisher.start()     # the next try declares it
        await (await connection.channel()).get_exchange(name, ensure=True)
    finally:
        await publisher.aclose()
        proxy.stop()
        await (await connection.channel()).exchange_delete(name)
        await connection.close()


def test_nats_through_a_proxy_that_cuts_and_stalls_loses_and_doubles_nothing(
        fresh_db: str, nats_server: NatsServer, tmp_path: Path) -> None:
    proxy = TcpProxy(nats_server.port)
    proxy.start()
    (tmp_path / "fault_app.py").write_text(APP.format(url=f"nats://127.0.0.1:{proxy.port}",
                                                     options=""))
    rng = random.Random(5)
    committed: list[int] = []
    _write(fresh_db, committed, 1000)
    cuts = stalls = 0
    relays = [_relay(fresh_db, tmp_path), _relay(fresh_db, tmp_path)]
    try:
        with SteadyWriter(fresh_db, committed):
            for round_ in range(8):
                time.sleep(rng.uniform(0.5, 1.0))
                if round_ % 2:
                    proxy.stalled.set()            # half-open: nothing passes, nothing closes
                    time.sleep(rng.uniform(1.5, 2.5))
                    proxy.stalled.clear()
                    stalls += 1
                else:
                    proxy.cut()                    # every connection reset at once
                    cuts += 1
        _drained(fresh_db, relays, 120)
    finally:
        _stop(relays)
        proxy.stop()
    ledger = _ledger(nats_server.url)
    print(f"\n{len(committed)} events committed, the proxy cut {cuts} and stalled {stalls} "
          f"times: {len(ledger)} messages in the stream")
    _exactly_once(ledger, committed)
    _none_parked(fresh_db)


RABBIT_APP = '''
from conveyor.relay import RabbitMQPublisher, Relay

relay = Relay()
relay.route("order.*", RabbitMQPublisher({url!r}, exchange="faults", timeout=1.0),
            destination="faults.{{topic}}")
'''


def _rabbit(url: str, what: str) -> list[int]:
    """Declare the durable queue the relay's messages land in, or drain it: their ids."""
    import aio_pika

    async def run() -> list[int]:
        connection = await aio_pika.connect(url)
        try:
            channel = await connection.channel()
            exchange = await channel.declare_exchange("faults", "topic", durable=True)
            queue = await channel.declare_queue("faults", durable=True)
            await queue.bind(exchange, "faults.#")
            ids = []
            while what == "drain" and (message := await queue.get(no_ack=True, fail=False)):
                ids.append(int(message.message_id or 0))
            return ids
        finally:
            await connection.close()
    return asyncio.run(run())


def test_rabbitmq_killed_and_restarted_with_relays_killed_loses_nothing(
        fresh_db: str, tmp_path: Path) -> None:
    # Not under tmp_path: the server runs as the rabbitmq user, and pytest's
    # temporary directories are private to this one.
    home = Path(tempfile.mkdtemp(prefix="conveyor-rabbitmq-"))
    home.chmod(0o755)
    server = RabbitServer(home / "node")
    rng = random.Random(3)
    committed: list[int] = []
    restarts = 0

    def fault(kills: int) -> None:
        nonlocal restarts
        if kills % 4 == 0 and restarts < 2:
            server.kill()                          # the broker dies with confirms in flight
            time.sleep(rng.uniform(0.3, 1.0))
            server.start()
            restarts += 1

    try:
        server.start()
        _rabbit(server.url, "declare")
        (tmp_path / "fault_app.py").write_text(RABBIT_APP.format(url=server.url))
        _write(fresh_db, committed, 1000)
        kills = _storm(fresh_db, tmp_path, committed, rng, fault, kills=6)
        ledger = _rabbit(server.url, "drain")
    finally:
        server.kill()
        shutil.rmtree(home, ignore_errors=True)
    repeated = len(ledger) - len(set(ledger))
    print(f"\n{len(committed)} events committed, {kills} relays SIGKILLed, RabbitMQ killed and "
          f"restarted {restarts} times: {len(ledger)} messages, {repeated} repeated")
    assert kills >= 6 and restarts >= 1, (kills, restarts)
    # RabbitMQ keeps no ids: a message confirmed to a relay killed before it marked its
    # event, or confirmed while the broker died, may come twice, with the same message_id.
    _exactly_once(sorted(set(ledger)), committed)
    assert repeated <= len(committed) // 10, repeated
    _none_parked(fresh_db)
