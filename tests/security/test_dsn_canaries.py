"""A database URL that fails to parse never echoes its password (finding F5).

psycopg's parse errors quote the offending token, and the token is often the
password: ``invalid percent-encoded token: "Canary%ZZsecret"``. Every DSN form
below carries a canary where the password goes; the canary must appear in no
message, traceback, CLI output (a real subprocess, stdout and stderr, flag and
CONVEYOR_DATABASE_URL) or worker-multi JSON log line (``--dsn`` and
``--tenants-dir``, across several rescans).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conveyor.db.connect import connect, connect_async, describe
from conveyor.errors import ConveyorError, DatabaseUnavailableError
from conveyor.multitenant import StaticTenants, TenantDatabase
from waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
CANARY = "Canary"

# (label, DSN): each one malformed around the password, which holds the canary.
MALFORMED = [
    ("url-bad-percent", "postgresql://app:Canary%ZZsecret@127.0.0.1:5432/db"),
    ("url-lone-percent", "postgresql://app:Can%ary@127.0.0.1:5432/db"),
    ("url-space", "postgresql://app:Canary secret@127.0.0.1:5432/db"),
    ("url-bad-port", "postgresql://app:CanaryPort@127.0.0.1:notaport/db"),
    # An unencoded '/' ends the authority: libpq takes "app" as the host and the
    # password's head as the port, its tail as part of the database name.
    ("url-slash-in-password", "postgresql://app:CanarySlash/tail@127.0.0.1:5432/db"),
    ("url-numeric-password-with-slash", "postgresql://app:7531902468/Canary@127.0.0.1:5432/db"),
    ("url-question-in-password", "postgresql://app:Can?ary@127.0.0.1:5432/db"),
    ("url-bad-ipv6", "postgresql://app:CanaryV6@[::1/db"),
    ("url-ipv6-junk", "postgresql://app:CanaryV6b@[::1]x/db"),
    ("query-bad-percent", "postgresql://app@127.0.0.1:5432/db?password=Canary%ZZq"),
    ("query-no-separator", "postgresql://app@127.0.0.1:5432/db?sslmode&password=Canary"),
    ("query-unknown-parameter", "postgresql://app@127.0.0.1:5432/db?password=CanaryQ&bogus=1"),
    ("keyword-missing-equals", "passwordCanarySecret3 host=127.0.0.1"),
    ("keyword-missing-equals-tail", "host=127.0.0.1 password=CanarySecret4 dbname"),
    ("keyword-glued", "host=127.0.0.1 passwordCanary5"),
    ("keyword-unterminated-quote", "host=127.0.0.1 password='CanaryQuote dbname=db"),
    ("keyword-unterminated-escape", "host=127.0.0.1 password='Canary\\'"),
    ("keyword-bad-option", "host=127.0.0.1 Canary=1 password=x"),
]
IDS = [label for label, _ in MALFORMED]
DSNS = [dsn for _, dsn in MALFORMED]


def assert_no_canary(text: str, where: str) -> None:
    assert CANARY not in text and "7531902468" not in text, f"password leaked in {where}:\n{text}"


def everything_about(exc: BaseException) -> str:
    """The message plus the whole formatted traceback, causes and contexts included."""
    return str(exc) + "\n" + "".join(traceback.format_exception(exc))


@pytest.mark.parametrize("dsn", DSNS, ids=IDS)
def test_connect_errors_and_tracebacks_never_quote_the_password(dsn: str) -> None:
    with pytest.raises(DatabaseUnavailableError) as caught:
        connect(dsn, connect_timeout=2).close()
    assert_no_canary(everything_about(caught.value), "the sync error")
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith("invalid database url") or \
        str(caught.value).startswith("cannot connect to database")


@pytest.mark.parametrize("dsn", DSNS, ids=IDS)
def test_async_connect_errors_never_quote_the_password(dsn: str) -> None:
    async def attempt() -> DatabaseUnavailableError:
        with pytest.raises(DatabaseUnavailableError) as caught:
            await (await connect_async(dsn, connect_timeout=2)).close()
        return caught.value

    assert_no_canary(everything_about(asyncio.run(attempt())), "the async error")


@pytest.mark.parametrize("dsn", DSNS, ids=IDS)
def test_describe_never_shows_the_password(dsn: str) -> None:
    assert_no_canary(describe(dsn), "describe()")


def test_unparseable_urls_say_what_to_check() -> None:
    with pytest.raises(DatabaseUnavailableError) as caught:
        connect("postgresql://app:Canary%ZZsecret@127.0.0.1:5432/db")
    assert str(caught.value) == ("invalid database url for db@127.0.0.1:5432 (could not parse "
                                 "it; check quoting and percent-encoding)")
    with pytest.raises(DatabaseUnavailableError) as caught:
        connect("host=127.0.0.1 password='CanaryQuote")
    assert str(caught.value) == ("invalid database url (could not parse it; check quoting and "
                                 "percent-encoding)")


def test_a_url_split_by_an_unencoded_slash_is_refused_before_connecting() -> None:
    with pytest.raises(DatabaseUnavailableError, match="could not parse it"):
        connect("postgresql://app:CanarySlash/tail@127.0.0.1:5432/db")


def test_well_formed_urls_are_still_described_and_connect(server_url: str) -> None:
    assert describe("postgresql://app:pw@db.internal:6432/shop") == "shop@db.internal:6432"
    assert describe("host=db.internal dbname=shop password=pw") == "shop@db.internal"
    # '@' in a query value (Azure-style user names) is not a split URL.
    assert describe("postgresql://db.internal/shop?user=app@srv") == "shop@db.internal"
    connect(server_url).close()


def test_a_connection_failure_never_echoes_the_password_either() -> None:
    # Well formed, nothing listening: libpq's message names host and port only,
    # and any echo of the password would be masked.
    dsn = "postgresql://app:CanaryOk@127.0.0.1:1/db"   # (not on the raising line: tracebacks quote it)
    with pytest.raises(DatabaseUnavailableError) as caught:
        connect(dsn, connect_timeout=2)
    assert_no_canary(everything_about(caught.value), "a connection failure")
    assert "db@127.0.0.1:1" in str(caught.value)


@pytest.mark.parametrize("dsn", DSNS, ids=IDS)
def test_tenant_specs_never_echo_the_password(dsn: str) -> None:
    for spec in (dsn, f"acme={dsn}"):
        try:
            tenant = TenantDatabase.parse(spec)
        except ConveyorError as exc:
            assert_no_canary(everything_about(exc), "TenantDatabase.parse")
            continue
        assert_no_canary(repr(tenant) + repr(StaticTenants([tenant]).scan()), "repr")


# ------------------------------------------------------------ real processes


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_cli(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conveyor.cli.main", *argv], cwd=REPO,
                          env=cli_env(**env), capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("dsn", DSNS, ids=IDS)
def test_cli_flag_never_prints_the_password(dsn: str) -> None:
    done = run_cli("--database-url", dsn, "status")
    assert_no_canary(done.stdout + done.stderr, "the CLI's output")
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("conveyor: error: "), \
        done.stderr


@pytest.mark.parametrize("dsn", [DSNS[0], DSNS[4], DSNS[11], DSNS[12], DSNS[15]],
                         ids=[IDS[0], IDS[4], IDS[11], IDS[12], IDS[15]])
def test_cli_environment_variable_never_prints_the_password(dsn: str) -> None:
    for argv in (("status",), ("migrate",), ("enqueue", "demo.topic", "{}")):
        done = run_cli(*argv, CONVEYOR_DATABASE_URL=dsn)
        assert_no_canary(done.stdout + done.stderr, f"'conveyor {argv[0]}' output")
        assert done.returncode == 1, done.stderr


def _failed_starts(lines: list[str]) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return [r for r in records if r.get("action") == "tenant_start_failed"]


def run_worker_multi(*source: str, until: Callable[[list[dict[str, Any]]], bool],
                     what: str) -> str:
    """worker-multi with JSON logs until ``until`` holds for its failed tenant starts
    logged so far (``what`` names it), then SIGTERM; returns its whole output. A wait
    on the log, not a fixed time: on a loaded machine a 2.5 s run ended before its
    first rescan."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli.main", "--log-format", "json", "--log-level", "debug",
         "worker-multi", "--app", "examples.quickstart:router", "--rescan-interval", "0.3",
         *source],
        cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL)
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: until(_failed_starts(list(lines))), 60, what)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    return "".join(lines)


URLS = [(i, dsn) for i, dsn in enumerate(DSNS) if "://" in dsn]
KEYWORDS = [(i, dsn) for i, dsn in enumerate(DSNS) if "://" not in dsn]


def test_worker_multi_dsn_flags_never_log_the_password(tmp_path: Path) -> None:
    # URLs are taken as given and fail when their tenant starts, at every rescan.
    flags = [part for i, dsn in URLS for part in ("--dsn", f"t{i}={dsn}")]
    tenants = {f"t{i}" for i, _ in URLS}
    output = run_worker_multi(*flags, until=lambda failed: {r["tenant"] for r in failed} >= tenants,
                              what="every tenant's failed start")
    assert_no_canary(output, "worker-multi's logs")
    failed = _failed_starts(output.splitlines())
    assert {r["tenant"] for r in failed} == tenants, output[-3000:]
    assert all("invalid database url" in r["message"] or "cannot connect" in r["message"]
               for r in failed)


@pytest.mark.parametrize("dsn", [dsn for _, dsn in KEYWORDS],
                         ids=[IDS[i] for i, _ in KEYWORDS])
def test_worker_multi_refuses_an_unparseable_keyword_dsn_flag_without_echoing_it(dsn: str) -> None:
    for spec in (dsn, f"acme={dsn}"):
        done = run_cli("worker-multi", "--app", "examples.quickstart:router", "--dsn", spec)
        assert_no_canary(done.stdout + done.stderr, "worker-multi's refusal")
        assert done.returncode in (1, 2) and done.stderr.count("\n") == 1, done.stderr


def test_worker_multi_tenant_files_never_log_the_password(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants"
    tenants.mkdir()
    for i, dsn in enumerate(DSNS):
        (tenants / f"t{i}.dsn").write_text(f"# tenant {i}\n{dsn}\n")
    # Retried at every rescan, and every repetition is clean.
    output = run_worker_multi("--tenants-dir", str(tenants),
                              until=lambda failed: len(failed) > len(DSNS),
                              what="a second round of failed starts (a rescan)")
    assert_no_canary(output, "worker-multi's logs")
    failed = _failed_starts(output.splitlines())
    assert len(failed) > len(DSNS), output[-3000:]
