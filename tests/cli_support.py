"""Fixtures for tests that call ``conveyor.cli.main.main()`` in-process.

Both are autouse where imported: a test module takes them with
``from cli_support import no_conveyor_env, restore_logging  # noqa: F401``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """main() configures the root logger; give other tests theirs back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(autouse=True)
def no_conveyor_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CONVEYOR_* variable of the caller's leaks into the command (but the test database)."""
    for name in list(os.environ):
        if name.startswith("CONVEYOR_") and name != "CONVEYOR_TEST_DATABASE_URL":
            monkeypatch.delenv(name)
