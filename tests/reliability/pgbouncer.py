"""A private PgBouncer in transaction mode in front of the test PostgreSQL (R19).

:class:`PgBouncer` runs the machine's ``pgbouncer`` binary in a temporary
directory of its own, listening on a free loopback port, with
``pool_mode = transaction`` and a small pool, so a handful of client
connections really share fewer server connections. It reaches the server the
way libpq does for the test URL: over TCP, or through the Unix socket
directory of the embedded server.

PgBouncer refuses to run as root. Under root it runs as the owner of the
server's socket directory (the embedded server's directory is private to its
system user), or as ``nobody`` for a TCP server; its directory is handed to
that user. Every wait is bounded, and ``stop`` never leaves the process behind.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import ClientCursor
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

CANDIDATES = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer", "/usr/local/bin/pgbouncer")
START_TIMEOUT = 15.0
STOP_TIMEOUT = 5.0
ADMIN_DB = "pgbouncer"


def find_pgbouncer() -> str | None:
    """The pgbouncer executable on PATH or in the usual sbin directories."""
    found = shutil.which("pgbouncer")
    if found:
        return found
    return next((path for path in CANDIDATES if os.access(path, os.X_OK)), None)


@dataclass(frozen=True)
class ServerTarget:
    """Where PgBouncer dials: a host (or a Unix socket directory), a port, a user."""

    host: str
    port: int
    user: str

    @property
    def is_socket(self) -> bool:
        return self.host.startswith("/")


def server_target(url: str) -> ServerTarget:
    """Ask libpq where ``url`` goes (it resolves PGHOST, PGPORT, socket defaults)."""
    with psycopg.connect(url, connect_timeout=10) as conn:
        info = conn.info
        host = info.host if info.host.startswith("/") else (info.hostaddr or info.host)
        return ServerTarget(host, int(info.port), info.user)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as(target: ServerTarget) -> pwd.struct_passwd | None:
    """The unprivileged user PgBouncer runs as under root; None when not root."""
    if os.geteuid() != 0:
        return None
    if target.is_socket:
        return pwd.getpwuid(os.stat(target.host).st_uid)
    return pwd.getpwnam("nobody")


class PgBouncer:
    """One private PgBouncer process. ``start()``, ``url(db_url)``, ``admin(...)``, ``stop()``.

    Args:
        server_url: any URL of the PostgreSQL server to pool (its host, port and user
            are used; every database name is passed through).
        pool_size: server connections per (database, user). Defaults to 4.
        max_client_conn: client connections accepted at most. Defaults to 200.
        pool_mode: ``transaction`` or ``session``. Defaults to ``transaction``.
    """

    def __init__(self, server_url: str, *, pool_size: int = 4, max_client_conn: int = 200,
                 pool_mode: str = "transaction") -> None:
        binary = find_pgbouncer()
        if binary is None:
            raise RuntimeError(
                "pgbouncer is not installed (looked on PATH and in /usr/sbin): the R19 tests "
                "need it; install it with 'apt-get install pgbouncer' (scripts/test.sh and "
                ".ci/run do so when they run as root)")
        self.binary = binary
        self.server_url = server_url
        self.target = server_target(server_url)
        self.pool_size = pool_size
        self.max_client_conn = max_client_conn
        self.pool_mode = pool_mode
        self.dir = Path(tempfile.mkdtemp(prefix="conveyor-pgbouncer-"))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------- lifecycle

    def _config(self) -> str:
        d, t = self.dir, self.target
        return "\n".join([
            "[databases]",
            # The fallback entry: any database name goes to the same name on the server.
            f"* = host={t.host} port={t.port}",
            "",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            f"pidfile = {d / 'pgbouncer.pid'}",
            "auth_type = trust",
            f"auth_file = {d / 'users.txt'}",
            f"admin_users = {t.user}",
            f"stats_users = {t.user}",
            f"pool_mode = {self.pool_mode}",
            f"default_pool_size = {self.pool_size}",
            "min_pool_size = 0",
            "reserve_pool_size = 0",
            f"max_client_conn = {self.max_client_conn}",
            "ignore_startup_parameters = extra_float_digits,options",
            "server_tls_sslmode = disable",
            "query_wait_timeout = 60",
            "server_connect_timeout = 5",
            "server_login_retry = 1",
            "log_connections = 0",
            "log_disconnections = 0",
            "",
        ])

    def start(self) -> None:
        """Start the process and wait until its admin console answers (bounded)."""
        runner = _run_as(self.target)
        (self.dir / "users.txt").write_text(f'"{self.target.user}" ""\n')
        if runner is not None:
            for path in (self.dir, self.dir / "users.txt"):
                os.chown(path, runner.pw_uid, runner.pw_gid)
        last_error = ""
        for _ in range(3):      # a free port may be taken between the probe and the bind
            self.port = free_port()
            (self.dir / "pgbouncer.ini").write_text(self._config())
            if runner is not None:
                os.chown(self.dir / "pgbouncer.ini", runner.pw_uid, runner.pw_gid)
            with open(self.dir / "stderr.log", "ab") as err:
                kwargs: dict[str, Any] = {}
                if runner is not None:
                    kwargs = {"user": runner.pw_uid, "group": runner.pw_gid, "extra_groups": []}
                self.proc = subprocess.Popen(
                    [self.binary, str(self.dir / "pgbouncer.ini")], cwd=self.dir,
                    stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT, **kwargs)
            last_error = self._wait_ready()
            if not last_error:
                return
            self._terminate()
        raise RuntimeError(f"pgbouncer did not start: {last_error}\n{self.log_tail()}")

    def _wait_ready(self) -> str:
        """'' once the admin console answers; otherwise why it never did."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        error = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited with code {self.proc.returncode}"
            try:
                self.admin("SHOW VERSION")
                return ""
            except psycopg.Error as exc:
                error = str(exc).strip()
            time.sleep(0.1)
        return f"no answer within {START_TIMEOUT:g}s: {error}"

    def _terminate(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)       # immediate shutdown (SIGINT would wait for clients)
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT)

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and remove its directory."""
        try:
            self._terminate()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- access

    def url(self, db_url: str) -> str:
        """``db_url`` rewritten to go through this PgBouncer (same database and user)."""
        return make_conninfo(db_url, host="127.0.0.1", port=str(self.port),
                             sslmode="disable", gssencmode="disable")

    def admin(self, command: str) -> list[dict[str, Any]]:
        """Rows of one admin console command (``SHOW POOLS``, ``SHOW SERVERS``...).

        The console speaks the simple query protocol only: a client-side cursor.
        """
        url = make_conninfo(self.url(self.server_url), dbname=ADMIN_DB, connect_timeout="5")
        with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn, \
                ClientCursor(conn, row_factory=dict_row) as cur:
            cur.execute(command)
            return cur.fetchall() if cur.description else []

    def servers(self, dbname: str) -> list[dict[str, Any]]:
        """The server connections PgBouncer holds for ``dbname``."""
        return [r for r in self.admin("SHOW SERVERS") if r["database"] == dbname]

    def clients(self, dbname: str) -> list[dict[str, Any]]:
        """The client connections PgBouncer holds for ``dbname``."""
        return [r for r in self.admin("SHOW CLIENTS") if r["database"] == dbname]

    def log_tail(self, size: int = 3000) -> str:
        text = ""
        with contextlib.suppress(OSError):
            text = (self.dir / "stderr.log").read_text(errors="replace")[-size:]
        return text
