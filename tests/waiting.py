"""Waiting for a condition in a test: bounded, so a misbehaving worker fails instead of hanging."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


async def wait_until(check: Callable[[], Awaitable[bool]], *, timeout: float,
                     interval: float = 0.02, what: str = "condition") -> float:
    """Poll the async ``check`` until it holds; returns the seconds it took. Fails on timeout."""
    start = time.monotonic()
    while True:
        if await check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.1, *,
             alive: Sequence[Any] = ()) -> T:
    """Call ``check`` until it returns something truthy, and return that. Fails on timeout.

    ``alive``: processes (with ``alive()`` and ``log()``) that must not die
    meanwhile; one that does fails the wait at once, with the end of its log.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        for process in alive:
            assert process.alive(), \
                f"{process!r} died while waiting for {what}:\n{process.log()[-3000:]}"
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
