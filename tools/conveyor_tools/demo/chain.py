"""The demo's second part: the whole chain, from an HTTP request to a delivered mail.

On the same server as the first part, in a database of its own that is
recreated on every run (``conveyor_demo_chain`` by default), it starts:

* the example engine (``python -m examples.engine``, Starlette on uvicorn) on a
  free loopback port, which migrates the ``conveyor`` and ``engine`` schemas;
* a local SMTP sink (aiosmtpd, plain SMTP on loopback) keeping every mail it
  receives;
* a real worker process for ``examples.engine.worker_app:build_router``.

It writes a few workbooks (and one truncated file) to a files directory,
creates file jobs, a task and mails through the engine's API with a user
token, shows live progress while the worker runs, and prints what came out:
each job's aggregate or failure reason, the task's status and the received
mails.

The example engine lives in the repository (``examples/``), not in the
installed package, and needs the ``demo`` extra (Starlette, uvicorn,
psycopg-pool, aiosmtpd, XlsxWriter). Without them the part is skipped with a
one-line note.
"""

from __future__ import annotations

import contextlib
import email
import email.message
import email.policy
import importlib.util
import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import IO, Any, TextIO

import httpx
import jwt
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from conveyor.db.connect import connect
from conveyor_tools.demo.progress import Progress, take_snapshot
from conveyor_tools.demo.worker_process import WorkerProcess, _die_with_parent

DEFAULT_DATABASE = "conveyor_demo_chain"
SCHEMA = "conveyor"  # the example engine migrates Conveyor's default schema
TENANT = "acme"
DOMAIN = "app.test"
WORKER_APP = "examples.engine.worker_app:build_router"
WORKER_FLAGS = ["--concurrency", "10", "--backoff-base", "0.5", "--shutdown-timeout", "5"]
SMTP_FROM = "Acme <no-reply@acme.app.test>"
NEEDED_MODULES = ("starlette", "uvicorn", "psycopg_pool", "aiosmtpd", "xlsxwriter")
ENGINE_START_TIMEOUT = 30.0
WATCH_TIMEOUT = 60.0
REFRESH_INTERVAL = 0.2
MAIL_LINES = 3

# Runs ``python -m examples.engine`` with the database URL and the secret taken
# from the environment, so neither shows in ``ps``. The "--flag=value" form,
# because a random secret may begin with "-", which argparse would take for a flag.
_ENGINE_LAUNCHER = (
    "import os, runpy, sys; "
    "sys.argv[1:1] = ['--database-url=' + os.environ.pop('DEMO_ENGINE_DATABASE_URL'), "
    "'--jwt-secret=' + os.environ.pop('DEMO_ENGINE_JWT_SECRET')]; "
    "runpy.run_module('examples.engine', run_name='__main__', alter_sys=True)"
)


def find_examples_root() -> tuple[Path | None, str]:
    """The directory holding ``examples/engine`` and the reason when there is none."""
    import conveyor

    candidates = [Path.cwd(), Path(conveyor.__file__).resolve().parents[2]]
    root = next((c for c in candidates if (c / "examples" / "engine" / "__main__.py").is_file()), None)
    if root is None:
        return None, ("the example engine (examples/engine) is not here; run the demo from a "
                      "checkout of the repository (bash scripts/demo.sh)")
    missing = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return None, (f"{', '.join(missing)} not installed; install the demo extra "
                      "(pip install -e '.[demo]', as scripts/demo.sh does)")
    return root, ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ the files


@dataclass(frozen=True, slots=True)
class Upload:
    name: str
    how: str
    rows: int = 0
    total: Decimal = Decimal(0)
    by_type: dict[str, Decimal] = field(default_factory=dict)


def _sales(seed: int, rows: int) -> list[tuple[str, Decimal]]:
    rng = random.Random(seed)
    kinds = ("tienda", "online", "mayorista")
    return [(rng.choice(kinds), Decimal(rng.randint(500, 250_000)) / 100) for _ in range(rows)]


def _upload(name: str, how: str, sales: list[tuple[str, Decimal]]) -> Upload:
    by_type: dict[str, Decimal] = {}
    for kind, amount in sales:
        by_type[kind] = by_type.get(kind, Decimal(0)) + amount
    return Upload(name, how, len(sales), sum(by_type.values(), Decimal(0)), by_type)


def write_uploads(files: Path) -> list[Upload]:
    """Two good workbooks, one without the ``monto`` column and one truncated file."""
    import xlsxwriter  # type: ignore[import-untyped]

    uploads = []
    january = _sales(1, 60)
    book = xlsxwriter.Workbook(str(files / "sales-january.xlsx"))
    sheet = book.add_worksheet("ventas")
    sheet.write_row(0, 0, ["tipo", "monto", "nota"])
    for i, (kind, amount) in enumerate(january, start=1):
        sheet.write_row(i, 0, [kind, float(amount), f"pedido {1000 + i}"])
    book.close()
    uploads.append(_upload("sales-january.xlsx", "shared strings", january))

    # Constant-memory mode writes inline strings; monto is a formula with its
    # cached value, and an empty row sits in the middle.
    february = _sales(2, 45)
    book = xlsxwriter.Workbook(str(files / "sales-february.xlsx"), {"constant_memory": True})
    sheet = book.add_worksheet("ventas")
    sheet.write_row(0, 0, ["Fecha", "Tipo", "Cantidad", "Precio", "Monto"])
    row = 1
    for i, (kind, amount) in enumerate(february):
        if i == 20:
            row += 1  # an empty row
        sheet.write_row(row, 0, [f"2026-02-{i % 28 + 1:02d}", kind, 1, float(amount)])
        sheet.write_formula(row, 4, f"=C{row + 1}*D{row + 1}", None, float(amount))
        row += 1
    book.close()
    uploads.append(_upload("sales-february.xlsx", "inline strings, formulas", february))

    book = xlsxwriter.Workbook(str(files / "no-amount.xlsx"))
    sheet = book.add_worksheet()
    sheet.write_row(0, 0, ["tipo", "importe"])
    sheet.write_row(1, 0, ["tienda", 12.5])
    book.close()
    uploads.append(Upload("no-amount.xlsx", "no monto column"))

    whole = (files / "sales-january.xlsx").read_bytes()
    (files / "truncated.xlsx").write_bytes(whole[: len(whole) // 2])
    uploads.append(Upload("truncated.xlsx", "cut in half"))
    return uploads


EMAILS: list[dict[str, Any]] = [
    {"to": "ana@example.com", "template": "welcome",
     "data": {"name": "Ana", "product": "Acme", "login_url": "https://acme.app.test/login"}},
    {"to": "bob@example.com", "template": "verification",
     "data": {"name": "Bob", "link": "https://acme.app.test/verify/7f3a", "expires_in": "24 hours"}},
    # A header injection attempt: refused before any SMTP connection, and not retried.
    {"to": "eve@example.com\r\nBcc: everyone@example.com", "template": "welcome", "data": {}},
]


# ------------------------------------------------------------------ the SMTP sink


@dataclass
class SmtpSink:
    """aiosmtpd handler keeping every accepted message, raw."""

    mails: list[bytes] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        with self.lock:
            self.mails.append(bytes(envelope.original_content or envelope.content))
        return "250 Message accepted for delivery"

    def received(self) -> list[bytes]:
        with self.lock:
            return list(self.mails)


@contextlib.contextmanager
def smtp_sink(port: int) -> Iterator[SmtpSink]:
    from aiosmtpd.controller import Controller

    sink = SmtpSink()
    controller = Controller(sink, hostname="127.0.0.1", port=port, ready_timeout=10)
    controller.start()
    try:
        yield sink
    finally:
        controller.stop()


# ------------------------------------------------------------------ the engine


class EngineProcess:
    """``python -m examples.engine`` in a subprocess on 127.0.0.1."""

    def __init__(self, root: Path, database_url: str, secret: str, port: int, log_path: Path) -> None:
        self.root = root
        self.database_url = database_url
        self.secret = secret
        self.port = port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[Any] | None = None

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc else 0

    def start(self) -> None:
        env = dict(os.environ, DEMO_ENGINE_DATABASE_URL=self.database_url,
                   DEMO_ENGINE_JWT_SECRET=self.secret, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.root), env.get("PYTHONPATH")]))
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _ENGINE_LAUNCHER, "--tenant-domain", DOMAIN,
             "--tenant", TENANT, "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=self.root, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)

    def wait_ready(self, timeout: float) -> str | None:
        """None once it answers HTTP (the lifespan, with its migrations, is done); else why not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return "the engine exited while starting"
            try:
                httpx.get(f"{self.url}/", timeout=1, trust_env=False)
                return None
            except httpx.HTTPError:
                time.sleep(0.1)
        return f"the engine did not answer within {timeout:.0f}s"

    def stop(self, timeout: float = 10.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Api:
    """The engine's HTTP API as a user of tenant ``acme`` sees it."""

    def __init__(self, base_url: str, secret: str) -> None:
        self.secret = secret
        self.http = httpx.Client(base_url=base_url, timeout=10, trust_env=False,
                                 follow_redirects=False)

    def close(self) -> None:
        self.http.close()

    def token(self) -> str:
        now = int(time.time())
        claims = {"iss": "engine", "aud": "engine", "sub": f"user:{TENANT}:demo", "iat": now,
                  "exp": now + 300, "tenant": TENANT, "role": "user"}
        return jwt.encode(claims, self.secret, algorithm="HS256")

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        headers = {"Host": f"{TENANT}.{DOMAIN}", "Authorization": f"Bearer {self.token()}"}
        return self.http.request(method, path, json=body, headers=headers)


# ------------------------------------------------------------------ the part itself


class ChainError(Exception):
    """The chain could not run; the message says why."""


def recreate_database(url: str, name: str) -> str:
    """Drop and create database ``name`` on ``url``'s server; its URL."""
    with connect(url, autocommit=True) as conn:
        ident = sql.Identifier(name)
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(ident))
    return make_conninfo(url, dbname=name)


def _money(value: Any) -> str:
    return f"{Decimal(str(value)):,.2f}"


class ChainDemo:
    """Part two of ``conveyor demo``, written to ``out`` as it happens."""

    def __init__(self, url: str, out: TextIO, *, database: str = DEFAULT_DATABASE) -> None:
        self.url = url
        self.out = out
        self.database = database

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def run(self, root: Path) -> int:
        self.say("\nPart 2: the whole chain, HTTP request -> outbox -> worker -> SMTP and write-back")
        self.say(f"  in database {self.database!r} on the same server, recreated on every run")
        work = Path(tempfile.mkdtemp(prefix="conveyor-demo-chain-"))
        try:
            return self._run(root, work)
        except ChainError as exc:
            self.say(f"\n  the chain part stopped: {exc}")
            return 1
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _run(self, root: Path, work: Path) -> int:
        self.say("\n5. the pieces")
        try:
            db_url = recreate_database(self.url, self.database)
        except psycopg.Error as exc:
            raise ChainError(f"cannot create database {self.database!r}: "
                             f"{(exc.diag.message_primary or str(exc)).strip()}") from None
        self.say(f"  created database {self.database}")
        secret = secrets.token_urlsafe(32)
        files = work / "files"
        files.mkdir()
        smtp_port = free_port()
        with smtp_sink(smtp_port) as sink:
            self.say(f"  SMTP sink listening on 127.0.0.1:{smtp_port} (aiosmtpd, keeps what it receives)")
            engine = EngineProcess(root, db_url, secret, free_port(), work / "engine.log")
            self.say(f"  $ python -m examples.engine --database-url URL --jwt-secret SECRET "
                     f"--tenant {TENANT} --port {engine.port}")
            engine.start()
            try:
                problem = engine.wait_ready(ENGINE_START_TIMEOUT)
                if problem:
                    self.say("  " + engine.log_tail().replace("\n", "\n  "))
                    raise ChainError(problem)
                self.say(f"  engine pid {engine.pid} on {engine.url} (migrated schemas "
                         f"'conveyor' and 'engine'; tenant {TENANT!r} is Host {TENANT}.{DOMAIN})")
                api = Api(engine.url, secret)
                try:
                    return self._requests_and_work(db_url, api, engine, sink, smtp_port, files, work)
                finally:
                    api.close()
            finally:
                engine.stop()

    def _requests_and_work(self, db_url: str, api: Api, engine: EngineProcess, sink: SmtpSink,
                           smtp_port: int, files: Path, work: Path) -> int:
        self.say("\n6. requests through the engine's HTTP API (a user's HS256 token for tenant "
                 f"{TENANT!r})")
        # The worker reads tenant T's uploads from ENGINE_FILES_DIR/T and nowhere else.
        tenant_files = files / TENANT
        tenant_files.mkdir(exist_ok=True)
        uploads = write_uploads(tenant_files)
        self.say(f"  wrote to tenant {TENANT!r}'s uploads directory: "
                 + "; ".join(f"{u.name} ({u.how})" for u in uploads[:2]))
        self.say("    and two that must fail: "
                 + "; ".join(f"{u.name} ({u.how})" for u in uploads[2:]))
        jobs: list[tuple[Upload, int]] = []
        for upload in uploads:
            reply = self._post(api, "/api/filejobs", {"file": upload.name}, 201)
            jobs.append((upload, int(reply["id"])))
            self.say(f"  POST /api/filejobs {json.dumps({'file': upload.name})}  -> 201, job "
                     f"{reply['id']} {reply['status']}")
        task = self._post(api, "/api/tasks", {"title": "Call the supplier about March"}, 201)
        self.say(f"  POST /api/tasks {json.dumps({'title': task['title']})}  -> 201, task "
                 f"{task['id']} {task['status']}")
        for mail in EMAILS:
            reply = self._post(api, "/api/emails", mail, 202)
            shown = json.dumps({"to": mail["to"], "template": mail["template"]})
            self.say(f"  POST /api/emails {shown}  -> 202, event {reply['event_id']}")
        total = len(jobs) + 1 + len(EMAILS)
        self.say(f"  each POST wrote its row and its event in one transaction: {total} events "
                 "waiting in the outbox")

        worker = WorkerProcess(db_url, SCHEMA, work / "worker.log", app=WORKER_APP,
                               flags=WORKER_FLAGS, name="demo-chain-worker", env={
                                   "PYTHONPATH": os.pathsep.join(filter(None, [
                                       str(engine.root), os.environ.get("PYTHONPATH")])),
                                   "ENGINE_URL": engine.url, "ENGINE_JWT_SECRET": api.secret,
                                   "ENGINE_TENANT_DOMAIN": DOMAIN, "ENGINE_FILES_DIR": str(files),
                                   "SMTP_HOST": "127.0.0.1", "SMTP_PORT": str(smtp_port),
                                   "SMTP_STARTTLS": "0", "SMTP_FROM": SMTP_FROM})
        self.say("\n7. working: a worker process with the engine's consumers")
        self.say(f"  $ conveyor worker --app {WORKER_APP} {' '.join(WORKER_FLAGS)}")
        worker.start()
        self.say(f"  worker pid {worker.pid} started\n")
        progress = Progress(self.out, expected=total)
        try:
            outcome = self._watch(db_url, worker, progress)
        finally:
            progress.close()
            code, took = worker.stop()
        if outcome:
            self.say(f"\n  {outcome}\n  last lines of the worker log:")
            self.say("    " + worker.log_tail().replace("\n", "\n    "))
            return 1
        self.say(f"\n  sent SIGTERM: the worker exited {'gracefully' if code == 0 else 'with an error'} "
                 f"(exit code {code}) in {took:.1f}s")
        self._results(db_url, api, jobs, int(task["id"]), sink)
        return 0 if code == 0 else 1

    def _post(self, api: Api, path: str, body: dict[str, Any], status: int) -> dict[str, Any]:
        reply = api.call("POST", path, body)
        if reply.status_code != status:
            raise ChainError(f"POST {path} answered {reply.status_code}: {reply.text[:200]}")
        answer: dict[str, Any] = reply.json()
        return answer

    def _watch(self, db_url: str, worker: WorkerProcess, progress: Progress) -> str | None:
        started = time.monotonic()
        with connect(db_url, autocommit=True) as conn:
            while True:
                elapsed = time.monotonic() - started
                snap = take_snapshot(conn, SCHEMA)
                left = snap.total("pending") + snap.total("running")
                progress.update(snap, elapsed, force=left == 0)
                if left == 0:
                    self.say(f"\n  all done in {elapsed:.1f}s")
                    return None
                if worker.exit_code() is not None:
                    return f"the worker exited early with code {worker.exit_code()}"
                if elapsed > WATCH_TIMEOUT:
                    return f"gave up after {WATCH_TIMEOUT:.0f}s with {left} events unfinished"
                time.sleep(REFRESH_INTERVAL)

    def _results(self, db_url: str, api: Api, jobs: list[tuple[Upload, int]], task_id: int,
                 sink: SmtpSink) -> None:
        self.say("\n8. results")
        self.say("  file jobs (GET /api/filejobs/<id>):")
        width = max(len(u.name) for u, _ in jobs)
        for upload, job_id in jobs:
            job = api.call("GET", f"/api/filejobs/{job_id}").json()
            head = f"    job {job_id}  {upload.name:<{width}}  {job['status']:<7}"
            result = job.get("result")
            if job["status"] == "done" and isinstance(result, dict):
                same = (int(result["rows"]) == upload.rows
                        and Decimal(str(result["total"])) == upload.total)
                self.say(f"{head} rows {result['rows']}  total {_money(result['total'])}"
                         f"{'  (matches what was written)' if same else '  (NOT what was written)'}")
                by_type = result.get("by_type") or {}
                self.say(" " * (len(head) + 1) + "by tipo: " + ", ".join(
                    f"{k} {_money(v)}" for k, v in sorted(by_type.items())))
            else:
                self.say(f"{head} {job.get('error') or ''}")
        task = api.call("GET", f"/api/tasks/{task_id}").json()
        self.say(f"  task {task_id} {task['title']!r}: {task['status']} (the write-back consumer)")

        with connect(db_url, autocommit=True) as conn:
            refused = conn.execute(
                f"SELECT id, attempts, last_error FROM {SCHEMA}.events "
                "WHERE topic = 'email.send' AND state = 'failed' ORDER BY id").fetchall()
        mails = sink.received()
        self.say(f"\n  mails received by the SMTP sink ({len(mails)}):")
        for raw in mails:
            msg = email.message_from_bytes(raw, policy=email.policy.default)
            assert isinstance(msg, email.message.EmailMessage)
            self.say(f"    From: {msg['From']}\n    To: {msg['To']}\n    Subject: {msg['Subject']}"
                     f"\n    Message-ID: {msg['Message-ID']}")
            body = msg.get_body(preferencelist=("plain",))
            text = body.get_content() if isinstance(body, email.message.EmailMessage) else ""
            lines = [line for line in str(text).splitlines() if line.strip()][:MAIL_LINES]
            for line in lines:
                self.say(f"      | {line}")
            self.say("")
        for event_id, attempts, error in refused:
            self.say(f"  email event {event_id} failed after {attempts} attempt "
                     f"(bad input is permanent, no retries): {error}")


def run_chain(url: str, out: TextIO, *, database: str = DEFAULT_DATABASE) -> int:
    """Part two of the demo; 0 when it ran (or was skipped), 1 when it failed."""
    # The HTTP client and the SMTP sink log every request and SMTP line at INFO;
    # the demo's own output says what matters.
    for name in ("httpx", "httpcore", "mail.log"):
        logging.getLogger(name).setLevel(logging.WARNING)
    demo = ChainDemo(url, out, database=database)
    root, why = find_examples_root()
    if root is None:
        demo.say(f"\nPart 2 (the example engine chain) skipped: {why}.")
        return 0
    return demo.run(root)
