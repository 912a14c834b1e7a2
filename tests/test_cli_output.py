"""What the ``conveyor`` command prints: safe text, exact JSON, quiet pipes, one-line refusals.

The pipe and refusal tests run the real command in a subprocess: a closed
pipe and "no traceback" are about what an operator's shell sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from cli_support import no_conveyor_env, restore_logging
from conveyor.cli.main import EXIT_BROKEN_PIPE
from conveyor.cli.output import escape, escape_lines
from test_cli import (
    REPO,
    Run,
    assert_one_line_error,
    child_env,
    cli,
    conveyor,
    enqueue,
    error_db,
    execute,
)

__all__ = ["cli", "error_db", "no_conveyor_env", "restore_logging"]  # shared fixtures

HOSTILE = "\x1b]0;pwned\x07\x1b[2J\rconveyor: retry succeeded"
FORBIDDEN = ("\x1b", "\x07", "\r", "\x9b", "\u202e")


def _store_hostile_failure(url: str, event_id: int) -> None:
    attempt = {"attempt": 1, "at": "2026-01-01T00:00:00+00:00", "error": HOSTILE,
               "traceback": f"Traceback (most recent call last):\n  boom\nValueError: {HOSTILE}\n"
                            "conveyor: forged line\u202e",
               "worker": "w\x1b[31m"}
    execute(url, "UPDATE conveyor.events SET state = 'failed', attempts = 1, last_error = %s, "
                 "idempotency_key = %s, errors = %s::jsonb, finished_at = now() WHERE id = %s",
            HOSTILE, "key\x1b[2J\x9b", json.dumps([attempt]), event_id)


# ---------------------------------------------------------------- escaping

def test_escape_renders_controls_visibly() -> None:
    assert escape(HOSTILE) == "\\x1b]0;pwned\\x07\\x1b[2J\\rconveyor: retry succeeded"
    assert escape("a\nb\tc\x9b\u202e\u2028é✓") == "a\\nb\\tc\\x9b\\u202e\\u2028é✓"
    assert escape_lines("one\r\ntwo\x1b") == ["one\\r", "two\\x1b"]


def test_show_text_escapes_stored_errors_and_tracebacks(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "a.b", json.dumps({"note": HOSTILE}))
    _store_hostile_failure(fresh_db, event_id)
    code, out, err = cli("show", str(event_id))
    assert code == 0, err
    for forbidden in FORBIDDEN:
        assert forbidden not in out, repr(forbidden)
    assert "last_error: \\x1b]0;pwned\\x07\\x1b[2J\\rconveyor: retry succeeded" in out
    # The traceback keeps one output line per stored line, each indented: no
    # stored text can start a line of its own.
    assert not any(line.startswith("conveyor:") for line in out.splitlines())
    assert "  conveyor: forged line\\u202e" in out


def test_show_json_keeps_the_stored_text_exactly(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "a.b", json.dumps({"note": HOSTILE}))
    _store_hostile_failure(fresh_db, event_id)
    code, out, _ = cli("show", str(event_id), "--json")
    assert code == 0
    record = json.loads(out)
    assert record["last_error"] == HOSTILE
    assert record["errors"][0]["error"] == HOSTILE
    assert record["payload"] == {"note": HOSTILE}
    assert record["idempotency_key"] == "key\x1b[2J\x9b"


def test_status_text_escapes_worker_names(cli: Run, fresh_db: str) -> None:
    execute(fresh_db, "INSERT INTO conveyor.workers (id, name, host, pid, topics, concurrency) "
                      "VALUES (%s, %s, 'h', 1, ARRAY['a.*'], 1)", uuid.uuid4(), "w\x1b[2J\rx")
    code, out, _ = cli("status")
    assert code == 0
    assert "w\\x1b[2J\\rx (pid 1)" in out
    for forbidden in FORBIDDEN:
        assert forbidden not in out


def test_workflow_status_text_escapes_stored_errors(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "workflow.order.created", json.dumps({"note": "x"}))
    _store_hostile_failure(fresh_db, event_id)
    code, out, err = cli("workflow", "status", str(event_id))
    assert code == 0, err
    for forbidden in FORBIDDEN:
        assert forbidden not in out, repr(forbidden)
    assert "\\x1b]0;pwned" in out


def test_worker_multi_refuses_a_name_with_a_newline(tmp_path: Path) -> None:
    done = conveyor("worker-multi", "--dsn", "acme=postgresql://root@127.0.0.1/x", "--app",
                    "tests.acceptance.startup_apps:router", "--name", "a\nb")
    assert done.returncode == 2
    assert_one_line_error(done, "--name")


# ------------------------------------------------------------- closed pipes

def _into_closed_pipe(*args: str) -> tuple[int, str]:
    """Run the command with stdout a pipe whose reader has already gone away."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "conveyor.cli.main", *args], cwd=REPO,
                              env=child_env(), stdout=write, stderr=subprocess.PIPE,
                              timeout=60, check=False)
    finally:
        os.close(write)
    return proc.returncode, proc.stderr.decode()


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["show", "{id}"],
                                  ["show", "{id}", "--json"], ["--help"], ["migrate", "--sql"],
                                  ["enqueue", "a.b"], ["events"], ["events", "--json"]],
                         ids=["status", "status-json", "show", "show-json", "help", "migrate-sql",
                              "enqueue", "events", "events-json"])
def test_a_closed_pipe_ends_the_command_quietly(error_db: str, args: list[str]) -> None:
    event_id = conveyor("--database-url", error_db, "enqueue", "a.b").stdout.strip()
    code, err = _into_closed_pipe("--database-url", error_db,
                                  *[a.format(id=event_id) for a in args])
    assert err == "", err
    assert code == EXIT_BROKEN_PIPE == 141


def test_head_reads_the_first_line_and_nothing_breaks(error_db: str) -> None:
    done = subprocess.run(
        f"{sys.executable} -m conveyor.cli.main --database-url '{error_db}' migrate --sql "
        "| head -1", shell=True, cwd=REPO, env=child_env(), capture_output=True, text=True,
        timeout=60, check=False)
    assert done.stderr == ""
    assert len(done.stdout.splitlines()) == 1


# ------------------------------------------------------------- --app targets

@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "raising_app.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "factory_app.py").write_text(textwrap.dedent("""\
        from conveyor import Router

        def needs_tenant(tenant):
            return Router()

        def breaks():
            raise ValueError("no config")

        def gives_int():
            return 7
        """))
    return tmp_path


@pytest.mark.parametrize(("target", "needles"), [
    ("raising_app:router", ["'raising_app:router'", "RuntimeError: boom at import"]),
    ("os:system", ["'os:system'", "needs arguments"]),
    ("factory_app:needs_tenant", ["'factory_app:needs_tenant'", "needs arguments"]),
    ("factory_app:breaks", ["'factory_app:breaks'", "ValueError: no config"]),
    ("factory_app:gives_int", ["'factory_app:gives_int'", "returned a int, not a conveyor.Router"]),
])
def test_an_app_that_fails_to_load_is_one_line(error_db: str, app_dir: Path, target: str,
                                               needles: list[str]) -> None:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(app_dir), env["PYTHONPATH"]])
    done = conveyor("--database-url", error_db, "worker", "--app", target, env=env)
    assert_one_line_error(done, "conveyor: error:", *needles)


# ------------------------------------------------------------- no database

def test_worker_without_a_database_url_refuses(tmp_path: Path) -> None:
    done = conveyor("--data-dir", str(tmp_path / "pg"), "worker", "--app",
                    "tests.acceptance.apps:router", timeout=30)
    assert_one_line_error(done, "--database-url", "CONVEYOR_DATABASE_URL", "--embedded")
    assert not (tmp_path / "pg").exists(), "the embedded server was started"


def test_workflow_help_names_its_actions() -> None:
    """L15: the top-level help promised "show" when the action was "status": every action
    it names must exist (there is a "show" now, for a workflow's steps)."""
    done = conveyor("--help")
    line = next(line for line in done.stdout.splitlines() if line.strip().startswith("workflow"))
    for action in ("show", "register", "status"):
        assert action in line, line
        assert conveyor("workflow", action, "--help").returncode == 0, action
