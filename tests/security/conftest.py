"""Fixtures of the security suite."""

from __future__ import annotations

from typing import Any


class Tripwire:
    """Stands in for a connection: any use at all is recorded and fails loudly.

    Passing it where Conveyor expects a connection proves a refusal happened
    before any SQL: a value that reached the database layer would touch it.
    """

    def __init__(self) -> None:
        self.touched: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.touched.append(name)
        raise AssertionError(f"the connection was touched ({name}) for an input that must be refused")
