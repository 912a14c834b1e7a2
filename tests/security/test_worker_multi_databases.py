"""worker-multi never runs silently on a database nobody named.

``conveyor worker`` refuses to start without ``--database-url`` /
``CONVEYOR_DATABASE_URL`` unless ``--embedded`` asks for the embedded server.
worker-multi serves tenant databases only: without ``--dsn`` or
``--tenants-dir`` (``CONVEYOR_TENANTS_DIR``) it refuses with one line saying
how to name them, never falls back to the embedded PostgreSQL or to the global
``--database-url``, and an empty tenants directory is reported, not served
silently. Real subprocesses, as an operator runs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
APP = "examples.quickstart:router"


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # Were the embedded server started, its data would land here.
    env["CONVEYOR_DATA_DIR"] = str(tmp_path / "embedded-data")
    env.update(extra)
    return env


def refusal(tmp_path: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conveyor.cli.main", *argv], cwd=REPO,
                          env=cli_env(tmp_path, **env), capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def assert_refused_in_one_line(done: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    line = done.stderr.strip()
    assert line.startswith("conveyor: error: no tenant databases for worker-multi"), line
    for hint in ("--dsn", "--tenants-dir", "CONVEYOR_TENANTS_DIR", "embedded"):
        assert hint in line, (hint, line)
    assert "using the embedded PostgreSQL" not in done.stderr
    assert not (tmp_path / "embedded-data").exists()


def test_without_tenant_databases_it_refuses_in_one_line(tmp_path: Path) -> None:
    assert_refused_in_one_line(refusal(tmp_path, "worker-multi", "--app", APP), tmp_path)


def test_the_global_database_url_is_not_taken_as_a_tenant(tmp_path: Path, server_url: str) -> None:
    for argv, env in ((["--database-url", server_url, "worker-multi", "--app", APP], {}),
                      (["worker-multi", "--app", APP], {"CONVEYOR_DATABASE_URL": server_url})):
        assert_refused_in_one_line(refusal(tmp_path, *argv, **env), tmp_path)


def test_the_refusal_comes_before_the_app_is_imported(tmp_path: Path) -> None:
    done = refusal(tmp_path, "worker-multi", "--app", "no_such_module_here:router")
    assert_refused_in_one_line(done, tmp_path)


def run_until(tmp_path: Path, action: str, *argv: str, then: float = 0.0, **env: str) -> str:
    """Run ``worker-multi`` until it logs ``action`` (then ``then`` seconds more), then
    SIGTERM it; its output. Waits on the log, not the clock: on a loaded machine the
    interpreter's start alone may take seconds."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli.main", "--log-format", "json", "worker-multi",
         "--app", APP, "--rescan-interval", "0.2", *argv],
        cwd=REPO, env=cli_env(tmp_path, **env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("{") and json.loads(line).get("action") == action:
                seen.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(60), "".join(lines)
        time.sleep(then)    # what must not happen again gets the time to
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    output = "".join(lines)
    assert proc.returncode == 0, output
    return output


def actions(output: str) -> list[str]:
    return [json.loads(line).get("action", "") for line in output.splitlines()
            if line.startswith("{")]


def test_an_empty_tenants_directory_is_reported_once_not_served_silently(tmp_path: Path) -> None:
    empty = tmp_path / "tenants"
    empty.mkdir()
    # Reported once, not at every rescan: five rescans (0.2 s) after the first report.
    output = run_until(tmp_path, "no_tenants", "--tenants-dir", str(empty), then=1.0)
    assert actions(output).count("no_tenants") == 1, output
    assert "no tenant databases to serve" in output
    assert not (tmp_path / "embedded-data").exists()


@pytest.fixture
def tenants_dir(tmp_path: Path, fresh_db: str) -> Path:
    path = tmp_path / "tenants"
    path.mkdir()
    (path / "acme.dsn").write_text(fresh_db + "\n")
    return path


def test_conveyor_tenants_dir_names_the_tenant_databases(tmp_path: Path, tenants_dir: Path) -> None:
    output = run_until(tmp_path, "tenants_synced", CONVEYOR_TENANTS_DIR=str(tenants_dir))
    assert "tenants_synced" in actions(output), output
    assert "no_tenants" not in actions(output), output
    assert not (tmp_path / "embedded-data").exists()


def test_dsn_flags_win_over_conveyor_tenants_dir(tmp_path: Path, fresh_db: str) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    output = run_until(tmp_path, "tenants_synced", "--dsn", f"acme={fresh_db}",
                       CONVEYOR_TENANTS_DIR=str(empty))
    assert "tenants_synced" in actions(output), output
    assert "no_tenants" not in actions(output), output
