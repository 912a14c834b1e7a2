"""``conveyor pause``, ``resume`` and the pauses in ``status``, on a real database.

Most run :func:`conveyor.cli.main.main` in-process; the refusals run the real
command, since "one line, no traceback" is about what a user sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from cli_support import no_conveyor_env, restore_logging  # noqa: F401 - autouse fixtures
from conveyor.cli.main import main

REPO = Path(__file__).resolve().parents[1]
Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(fresh_db: str, capsys: pytest.CaptureFixture[str]) -> Run:
    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main(["--database-url", fresh_db, *args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err
    return run


def _conveyor(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "conveyor.cli.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def _rows(url: str) -> list[tuple[str, str | None, str | None]]:
    with psycopg.connect(url) as conn:
        return [(r[0], r[1], r[2]) for r in conn.execute(
            "SELECT pattern, tenant, reason FROM conveyor.pauses ORDER BY 1, 2 NULLS FIRST")]


def test_pause_stores_the_pause_and_says_so(cli: Run, fresh_db: str) -> None:
    code, out, err = cli("pause", "email.*", "--reason", "smtp relay down")
    assert (code, out, err) == (0, "paused email.* (every tenant): smtp relay down\n", "")
    code, out, _ = cli("pause", "billing.invoice", "--tenant", "acme")
    assert (code, out) == (0, "paused billing.invoice (tenant acme)\n")
    assert _rows(fresh_db) == [("billing.invoice", "acme", None),
                               ("email.*", None, "smtp relay down")]


def test_pause_json_prints_the_pause(cli: Run) -> None:
    code, out, _ = cli("pause", "*", "--json")
    data = json.loads(out)
    assert (code, data["pattern"], data["tenant"], data["reason"]) == (0, "*", None, None)
    assert data["paused_at"]


def test_resume_lifts_the_pause_and_exits_1_when_there_was_none(cli: Run,
                                                                 fresh_db: str) -> None:
    cli("pause", "email.*", "--tenant", "acme")
    code, out, err = cli("resume", "email.*")
    assert (code, out) == (1, "")
    assert err == "conveyor: email.* (every tenant) is not paused; paused: email.* (tenant acme)\n"
    code, out, _ = cli("resume", "email.*", "--tenant", "acme")
    assert (code, out) == (0, "resumed email.* (tenant acme)\n")
    assert _rows(fresh_db) == []
    code, out, _ = cli("resume", "email.*", "--tenant", "acme", "--json")
    assert (code, json.loads(out)) == (1, {"pattern": "email.*", "tenant": "acme",
                                           "resumed": False})


def test_status_shows_what_is_paused_in_text_and_json(cli: Run) -> None:
    code, out, _ = cli("status")
    assert code == 0 and "paused" not in out
    cli("pause", "email.*", "--reason", "ops: relay")
    cli("pause", "sms.send", "--tenant", "acme")
    code, out, _ = cli("status")
    lines = out.splitlines()
    start = lines.index("paused (2): no worker claims these")
    assert lines[start + 1].startswith("  email.* (every tenant) since ")
    assert lines[start + 1].endswith(" UTC: ops: relay")
    assert lines[start + 2].startswith("  sms.send (tenant acme) since ")
    code, out, _ = cli("status", "--json")
    paused = json.loads(out)["paused"]
    assert [(p["pattern"], p["tenant"], p["reason"]) for p in paused] == [
        ("email.*", None, "ops: relay"), ("sms.send", "acme", None)]


def test_status_escapes_a_reason_written_around_the_cli(cli: Run, fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        conn.execute("INSERT INTO conveyor.pauses (pattern, reason) VALUES ('x', %s)",
                     ("evil\x1b[2Jreason",))
    code, out, _ = cli("status")
    assert code == 0 and "\x1b" not in out and "evil" in out


@pytest.mark.parametrize(("args", "message"), [
    (("pause", "email."), "malformed topic pattern 'email.'"),
    (("pause", "*.send"), "malformed topic pattern '*.send'"),
    (("resume", "a b"), "malformed topic pattern 'a b'"),
    (("pause", "email.*", "--tenant", "ACME"), "invalid tenant 'ACME'"),
    (("pause", "email.*", "--reason", "x" * 501), "reason is 501 characters, the limit is 500"),
])
def test_bad_input_is_refused_in_one_line_naming_the_value(fresh_db: str, args: tuple[str, ...],
                                                           message: str) -> None:
    done = _conveyor("--database-url", fresh_db, *args)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert _rows(fresh_db) == []
