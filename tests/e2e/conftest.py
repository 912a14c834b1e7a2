"""End-to-end fixtures: the example engine on uvicorn, an SMTP sink, real worker processes.

Everything runs on 127.0.0.1 on free ports, against a real PostgreSQL:

* ``EngineProcess``: ``python -m examples.engine`` in a subprocess (so a test
  can stop it and start it again on the same port), ready when it answers HTTP.
* ``SmtpSink``: an aiosmtpd ``Controller`` (plain SMTP, no TLS) that keeps
  every message it accepts, raw.
* ``WorkerProc``: ``python -m conveyor.cli.main worker --app
  examples.engine.worker_app:build_router`` with the engine, files and SMTP
  settings in its environment.
* ``Api``: a small HTTP client of the engine minting user tokens per tenant.

Every process is killed at teardown and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import email
import email.policy
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
import psycopg
import pytest
from aiosmtpd.controller import Controller

from server_support import MakeDb
from waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
SECRET = "e2e-shared-secret-0123456789-abcdefghijklmnop"  # 45 bytes
TENANTS = ("acme", "globex")
DOMAIN = "app.test"
WORKER_APP = "examples.engine.worker_app:build_router"


# ------------------------------------------------------------------ helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A child's environment: no stray CONVEYOR_*/ENGINE_*/SMTP_* settings, the repo importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CONVEYOR_", "ENGINE_", "SMTP_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def query(url: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run one statement; its rows (none for a statement that returns none)."""
    with psycopg.connect(url, autocommit=True, application_name="e2e-test") as conn:
        cur = conn.execute(sql.encode() if params is None else sql, params)
        return cur.fetchall() if cur.description is not None else []


class _Process:
    """A subprocess whose output goes to a log file; killed (never waited on unbounded) at stop."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def send(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGKILL, timeout: float = 10) -> int | None:
        """Send ``sig``, wait up to ``timeout`` s, then SIGKILL; returns the exit code."""
        self.send(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)
        finally:
            if not self._log.closed:
                self._log.close()


# ------------------------------------------------------------------ engine


class EngineProcess:
    """``python -m examples.engine`` on 127.0.0.1; ``start``/``stop`` may repeat on one port."""

    def __init__(self, database_url: str, log_path: Path, *, port: int | None = None,
                 tenants: tuple[str, ...] = TENANTS) -> None:
        self.database_url = database_url
        self.log_path = log_path
        self.port = port or free_port()
        self.tenants = tenants
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: _Process | None = None

    def __repr__(self) -> str:
        return f"<engine :{self.port}>"

    def start(self, timeout: float = 30) -> EngineProcess:
        argv = [sys.executable, "-m", "examples.engine", "--database-url", self.database_url,
                "--jwt-secret", SECRET, "--tenant-domain", DOMAIN, "--port", str(self.port)]
        for tenant in self.tenants:
            argv += ["--tenant", tenant]
        self._proc = _Process(argv, child_env(), self.log_path)
        wait_for(self.ready, timeout, f"the engine on port {self.port}", alive=[self])
        return self

    def ready(self) -> bool:
        try:
            # Any HTTP answer means uvicorn serves and the lifespan (migrations) is done.
            httpx.get(f"{self.url}/", timeout=1, trust_env=False)
        except httpx.HTTPError:
            return False
        return True

    def alive(self) -> bool:
        return self._proc is not None and self._proc.alive()

    def log(self) -> str:
        return self._proc.log() if self._proc else ""

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self._proc is not None:
            self._proc.stop(sig)
            self._proc = None
        # Down means down: nothing answers on the port any more.
        wait_for(lambda: not self.ready(), 10, f"the engine on port {self.port} to be down")


@pytest.fixture(scope="module")
def module_db(make_db: MakeDb, template_db: str) -> Iterator[str]:
    """A migrated database shared by one module (the engine tests without workers).

    Dropped by make_db's background thread (under xdist): a drop that the
    module's end waited for took 39 s of the parallel tier once (2026-12-05).
    """
    with make_db(prefix="conveyor_e2e_", template=template_db) as url:
        yield url


@pytest.fixture(scope="module")
def module_engine(module_db: str, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[EngineProcess]:
    engine = EngineProcess(module_db, tmp_path_factory.mktemp("engine") / "engine.log")
    try:
        yield engine.start()
    finally:
        engine.stop()


@pytest.fixture
def engine_factory(tmp_path: Path) -> Iterator[Callable[[str], EngineProcess]]:
    """Make (not start) engines on a database; every one is stopped at teardown."""
    made: list[EngineProcess] = []

    def make(database_url: str) -> EngineProcess:
        engine = EngineProcess(database_url, tmp_path / f"engine-{len(made)}.log")
        made.append(engine)
        return engine

    yield make
    for engine in made:
        with contextlib.suppress(AssertionError):
            engine.stop()


# ------------------------------------------------------------------ tokens and API


def token(tenant: str = "acme", role: str = "user", *, secret: str = SECRET,
          algorithm: str = "HS256", drop: tuple[str, ...] = (), now: float | None = None,
          **overrides: Any) -> str:
    """A user-style token; ``overrides`` replace claims, ``drop`` removes them."""
    issued = int(time.time() if now is None else now)
    claims: dict[str, Any] = {"iss": "engine", "aud": "engine", "sub": f"user:{tenant}:1",
                              "iat": issued, "exp": issued + 300, "tenant": tenant, "role": role}
    claims.update(overrides)
    for name in drop:
        claims.pop(name, None)
    return jwt.encode(claims, secret if algorithm != "none" else None, algorithm=algorithm)


class Api:
    """HTTP client of the engine for tests: Host per tenant, a fresh user token per call."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=10, trust_env=False,
                                 follow_redirects=False)

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, *, tenant: str = "acme", host: str | None = None,
             bearer: str | None = None, role: str = "user", json: Any = None,
             headers: dict[str, str] | None = None) -> httpx.Response:
        all_headers = {"Host": host or f"{tenant}.{DOMAIN}",
                       "Authorization": f"Bearer {bearer or token(tenant, role)}"}
        all_headers.update(headers or {})
        return self.http.request(method, path, json=json, headers=all_headers)

    def create(self, tenant: str, resource: str, value: str) -> dict[str, Any]:
        field_name = {"filejobs": "file", "tasks": "title"}[resource]
        reply = self.call("POST", f"/api/{resource}", tenant=tenant, json={field_name: value})
        assert reply.status_code == 201, reply.text
        body: dict[str, Any] = reply.json()
        return body

    def email(self, tenant: str, to: str, template: str, data: dict[str, Any]) -> int:
        reply = self.call("POST", "/api/emails", tenant=tenant,
                          json={"to": to, "template": template, "data": data})
        assert reply.status_code == 202, reply.text
        return int(reply.json()["event_id"])


@pytest.fixture
def api_factory() -> Iterator[Callable[[str], Api]]:
    made: list[Api] = []

    def make(base_url: str) -> Api:
        made.append(Api(base_url))
        return made[-1]

    yield make
    for api in made:
        api.close()


# ------------------------------------------------------------------ SMTP sink


@dataclass
class Mail:
    mail_from: str
    rcpt_tos: list[str]
    raw: bytes

    @property
    def message(self) -> email.message.EmailMessage:
        msg = email.message_from_bytes(self.raw, policy=email.policy.default)
        assert isinstance(msg, email.message.EmailMessage)
        return msg

    @property
    def message_id(self) -> str:
        return str(self.message["Message-ID"])


@dataclass
class SmtpSink:
    host: str
    port: int
    mails: list[Mail] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    delay: float = 0.0  # seconds between receiving the DATA and answering 250

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        with self.lock:
            self.mails.append(Mail(envelope.mail_from, list(envelope.rcpt_tos),
                                   bytes(envelope.original_content)))
        if self.delay:
            await asyncio.sleep(self.delay)
        return "250 Message accepted for delivery"

    def received(self) -> list[Mail]:
        with self.lock:
            return list(self.mails)


@pytest.fixture
def smtp_sink() -> Iterator[SmtpSink]:
    """A plain SMTP server on 127.0.0.1 keeping every accepted message."""
    sink = SmtpSink("127.0.0.1", free_port())
    controller = Controller(sink, hostname=sink.host, port=sink.port, ready_timeout=10)
    controller.start()
    try:
        yield sink
    finally:
        controller.stop()


# ------------------------------------------------------------------ workers


class WorkerProc(_Process):
    def __init__(self, database_url: str, log_path: Path, env: dict[str, str], *args: str) -> None:
        super().__init__(
            [sys.executable, "-m", "conveyor.cli.main", "--database-url", database_url,
             "worker", "--app", WORKER_APP, *args], child_env(env), log_path)

    def __repr__(self) -> str:
        return f"<worker pid={self.pid}>"


FAST_WORKER = ("--backoff-base", "0.2", "--lease-ttl", "3", "--rescue-interval", "1",
               "--poll-interval", "1", "--shutdown-timeout", "5")


@dataclass
class Chain:
    """Everything one end-to-end test needs: database, engine, sink, files dir, workers."""

    db: str
    engine: EngineProcess
    sink: SmtpSink
    files: Path
    tmp: Path
    api: Api
    workers: list[WorkerProc] = field(default_factory=list)

    def worker_env(self) -> dict[str, str]:
        return {"ENGINE_URL": self.engine.url, "ENGINE_JWT_SECRET": SECRET,
                "ENGINE_TENANT_DOMAIN": DOMAIN, "ENGINE_FILES_DIR": str(self.files),
                "SMTP_HOST": self.sink.host, "SMTP_PORT": str(self.sink.port),
                "SMTP_STARTTLS": "0", "SMTP_FROM": "Example <no-reply@app.test>"}

    def start_worker(self, *args: str) -> WorkerProc:
        worker = WorkerProc(self.db, self.tmp / f"worker-{len(self.workers)}.log",
                            self.worker_env(), *FAST_WORKER, *args)
        self.workers.append(worker)
        return worker

    def workers_registered(self, n: int) -> bool:
        return query(self.db, "SELECT count(*) FROM conveyor.workers")[0][0] >= n


UPDATE_LOG_DDL = """
CREATE TABLE public.row_updates (
    seq        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    resource   text   NOT NULL,
    row_id     bigint NOT NULL,
    old_status text   NOT NULL,
    new_status text   NOT NULL
);
CREATE TABLE public.update_delay (seconds float8 NOT NULL);
INSERT INTO public.update_delay VALUES (0);
CREATE FUNCTION public.log_row_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A test may hold every update open for a while (to kill a worker meanwhile).
    PERFORM pg_sleep((SELECT seconds FROM public.update_delay));
    INSERT INTO public.row_updates (resource, row_id, old_status, new_status)
    VALUES (TG_TABLE_NAME, NEW.id, OLD.status, NEW.status);
    RETURN NULL;
END $$;
CREATE TRIGGER log_update AFTER UPDATE ON engine.filejobs
    FOR EACH ROW EXECUTE FUNCTION public.log_row_update();
CREATE TRIGGER log_update AFTER UPDATE ON engine.tasks
    FOR EACH ROW EXECUTE FUNCTION public.log_row_update();
"""


@pytest.fixture
def chain(fresh_db: str, engine_factory: Callable[[str], EngineProcess], smtp_sink: SmtpSink,
          api_factory: Callable[[str], Api], tmp_path: Path) -> Iterator[Chain]:
    """A started engine (with an update log on its tables), a sink, a files dir; no worker yet."""
    engine = engine_factory(fresh_db).start()
    # The test's own witness of every update the engine applies to a row.
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute(UPDATE_LOG_DDL.encode())
    files = tmp_path / "files"
    for tenant in TENANTS:      # the worker reads tenant T's uploads from files/T only
        (files / tenant).mkdir(parents=True)
    c = Chain(fresh_db, engine, smtp_sink, files, tmp_path, api_factory(engine.url))
    try:
        yield c
    finally:
        for worker in c.workers:
            worker.stop()
