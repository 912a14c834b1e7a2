"""Racing a test's threads: each gets ready on its own, then all go at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_together(count: int, work: Callable[[Callable[[], None]], T], *,
                 timeout: float = 60.0) -> list[T]:
    """Run ``work(go)`` in ``count`` threads; each calls ``go()`` once ready (its
    connection open), and none goes on until all have. Returns what each
    returned, in the order they finished; an exception in any fails the test
    with every one of them."""
    barrier = threading.Barrier(count)
    results: list[T] = []
    errors: list[BaseException] = []

    def go() -> None:
        barrier.wait(timeout=timeout / 2)

    def run() -> None:
        try:
            results.append(work(go))
        except BaseException as exc:  # noqa: BLE001 - reported below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a racing thread did not finish"
    return results
