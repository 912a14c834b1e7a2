"""A database URL that cannot parse stops a worker at once, in one line, without its password.

Retrying cannot make a URL parse: the worker used to log a redacted
"invalid database url" and retry for ever.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from conveyor import Event, Router, Worker
from conveyor.errors import InvalidDatabaseUrlError

from .helpers import REPO, cli_env

CANARY = "Canary%ZZsecret"
BAD_URL = f"postgresql://app:{CANARY}@127.0.0.1:5432/app"


def test_the_cli_worker_exits_1_with_one_line_and_no_password() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conveyor.cli.main", "--database-url", BAD_URL, "worker",
         "--app", "tests.acceptance.startup_apps:router"],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 1, done.stderr
    assert "CanarySecret" not in done.stderr + done.stdout and "ZZsecret" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("conveyor: error:")]
    assert errors == ["conveyor: error: invalid database url for app@127.0.0.1:5432 "
                      "(could not parse it; check quoting and percent-encoding)"], done.stderr
    assert "Traceback" not in done.stderr


async def test_worker_run_raises_instead_of_retrying() -> None:
    async def handler(event: Event) -> None:
        pass

    router = Router()
    router.add("x", handler)
    worker = Worker(BAD_URL, router)
    with pytest.raises(InvalidDatabaseUrlError):
        await asyncio.wait_for(worker.run(), 10)
