"""The ``conveyor`` command's options: where they may stand, their variables, their help.

Each option is declared once with its ``CONVEYOR_*`` variable
(:mod:`conveyor.cli.options`); these tests hold what a user sees of that:
the help's default, the error for a bad variable, the version, and global
options accepted after the command name.
"""

from __future__ import annotations

import json
import re

import pytest

from cli_support import no_conveyor_env, restore_logging
from conveyor.cli.main import build_parser
from conveyor.cli.options import format_seconds
from conveyor.config import (
    CONCURRENCY_DEFAULT,
    HORIZON_ALERT_DEFAULT,
    LEASE_TTL_DEFAULT,
    POLL_INTERVAL_DEFAULT,
    RETENTION_DEFAULT,
)
from test_cli import (
    _invoke,
    assert_one_line_error,
    child_env,
    conveyor,
    error_db,
)

__all__ = ["error_db", "no_conveyor_env", "restore_logging"]  # fixtures shared with test_cli


def _help(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, out, err = _invoke(capsys, [*args, "--help"])
    assert code == 0, err
    return " ".join(out.split())    # argparse wraps lines: compare with single spaces


def _option_help(text: str, flag: str) -> str:
    """The help of one option: from its flag to the next option at the start of a line."""
    start = text.index(flag + " ", text.index(" options:"))
    found = re.search(r"\s--?[a-z]", text[start + len(flag) + 1:])
    return text[start: start + len(flag) + 1 + found.start()] if found else text[start:]


# ------------------------------------------------------------------- version

def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    code, out, _ = _invoke(capsys, ["--version"])
    assert (code, out) == (0, f"conveyor {version('conveyor')}\n")
    done = conveyor("--version")
    assert (done.returncode, done.stdout) == (0, f"conveyor {version('conveyor')}\n")


# ------------------------------------------------------- global options anywhere

def test_global_options_are_accepted_after_the_command(fresh_db: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _invoke(capsys, ["status", "--json", "--database-url", fresh_db,
                                      "--schema", "conveyor", "--log-level", "warning",
                                      "--log-format", "json"])
    assert code == 0, err
    assert json.loads(out)["counts"]["pending"] == 0


def test_global_options_are_still_accepted_before_the_command(
        fresh_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _invoke(capsys, ["--database-url", fresh_db, "--log-level", "warning",
                                      "status", "--json"])
    assert code == 0, err
    assert json.loads(out)["counts"]["pending"] == 0


def test_a_global_option_after_the_command_wins_over_one_before() -> None:
    args = build_parser().parse_args(["--schema", "before", "status", "--schema", "after"])
    assert args.schema == "after"
    args = build_parser().parse_args(["--schema", "before", "status"])
    assert args.schema == "before"


def test_global_options_after_a_nested_command() -> None:
    args = build_parser().parse_args(["workflow", "status", "7", "--schema", "jobs"])
    assert args.schema == "jobs"


# ------------------------------------------------------------ help defaults

@pytest.mark.parametrize(("variable", "value", "flag", "shown"), [
    # Regression: the template appended "s" to the variable's text: "1ms", "offs".
    ("CONVEYOR_POLL_INTERVAL", "1m", "--poll-interval", "(default: 1m, from CONVEYOR_POLL_INTERVAL)"),
    ("CONVEYOR_HORIZON_ALERT", "off", "--horizon-alert",
     "(default: off, from CONVEYOR_HORIZON_ALERT)"),
    ("CONVEYOR_LEASE_TTL", "90", "--lease-ttl", "(default: 1m30s, from CONVEYOR_LEASE_TTL)"),
    ("CONVEYOR_CONCURRENCY", "12", "--concurrency", "(default: 12, from CONVEYOR_CONCURRENCY)"),
])
def test_help_shows_the_default_a_variable_sets_once(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        variable: str, value: str, flag: str, shown: str) -> None:
    monkeypatch.setenv(variable, value)
    text = _option_help(_help(capsys, "worker"), flag)
    assert shown in text, text
    assert text.count("default:") == 1, text


@pytest.mark.parametrize(("flag", "shown"), [
    ("--poll-interval", f"(default: {format_seconds(POLL_INTERVAL_DEFAULT)})"),
    ("--lease-ttl", f"(default: {format_seconds(LEASE_TTL_DEFAULT)})"),
    ("--horizon-alert", f"(default: {format_seconds(HORIZON_ALERT_DEFAULT)})"),
    ("--retention", f"(default: {format_seconds(RETENTION_DEFAULT)})"),
    ("--concurrency", f"(default: {CONCURRENCY_DEFAULT})"),
])
def test_help_shows_the_built_in_default_with_its_unit(capsys: pytest.CaptureFixture[str],
                                                      flag: str, shown: str) -> None:
    assert format_seconds(90) == "1m30s" and format_seconds(0.5) == "0.5s"
    text = _option_help(_help(capsys, "worker"), flag)
    assert shown in text, text
    assert text.count("default:") == 1, text


def test_help_never_shows_the_database_url_of_the_environment(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", "postgresql://u:Canary-secret@db/x")
    text = _help(capsys)
    assert "Canary-secret" not in text
    assert "CONVEYOR_DATABASE_URL" in text


# ------------------------------------------------------- bad variable values

@pytest.mark.parametrize(("variable", "value", "needle"), [
    ("CONVEYOR_CONCURRENCY", "abc", "expected a positive integer, got 'abc'"),
    ("CONVEYOR_BATCH_SIZE", "0", "expected a positive integer, got '0'"),
    ("CONVEYOR_POLL_INTERVAL", "soon", "invalid duration 'soon'"),
    ("CONVEYOR_RETENTION", "later", "invalid duration 'later'"),
    ("CONVEYOR_HORIZON_ALERT", "never", "invalid duration 'never'"),
    ("CONVEYOR_LISTEN", "maybe", "expected true or false"),
    ("CONVEYOR_TRANSACTION_POOLER", "perhaps", "expected true or false"),
])
def test_a_bad_variable_is_named_not_its_flag(error_db: str, variable: str, value: str,
                                              needle: str) -> None:
    done = conveyor("--database-url", error_db, "worker", "--app", "tests.acceptance.apps:router",
                    env=child_env(**{variable: value}))
    assert_one_line_error(done, f"invalid {variable}={value!r}", needle)
    flag = "--" + variable.removeprefix("CONVEYOR_").lower().replace("_", "-")
    assert f"argument {flag}" not in done.stderr
    assert done.returncode == 2


def test_a_flag_overrides_a_bad_variable(error_db: str) -> None:
    """The variable is only a default: a flag given on the command line replaces it unread."""
    done = conveyor("--database-url", error_db, "worker", "--app", "x", "--concurrency", "3",
                    env=child_env(CONVEYOR_CONCURRENCY="abc"))
    assert_one_line_error(done, "invalid --app 'x'")


def test_a_bad_variable_of_another_command_is_not_read(error_db: str) -> None:
    done = conveyor("--database-url", error_db, "status",
                    env=child_env(CONVEYOR_POLL_INTERVAL="soon", CONVEYOR_LISTEN="maybe"))
    assert done.returncode == 0, done.stderr


def test_worker_name_with_a_control_character_is_refused(error_db: str) -> None:
    done = conveyor("--database-url", error_db, "worker", "--app", "tests.acceptance.apps:router",
                    "--name", "a\nb")
    assert_one_line_error(done, "--name", "'a\\nb'", "control character")
    done = conveyor("--database-url", error_db, "worker", "--app", "tests.acceptance.apps:router",
                    env=child_env(CONVEYOR_WORKER_NAME="w\x1b[2J"))
    assert_one_line_error(done, "invalid CONVEYOR_WORKER_NAME=", "control character")


def test_every_command_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("migrate", "enqueue", "status", "show", "retry", "cancel", "prune",
                    "worker"):
        code, out, _ = _invoke(capsys, [command, "--help"])
        assert code == 0, command
        assert "examples:" in out, command
