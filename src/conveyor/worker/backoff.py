"""The delays a worker's connection or service loop waits after failures in a row."""

from __future__ import annotations

import random

from conveyor.retry import BackoffPolicy, RetryPolicy


class Backoff:
    """The delays of ``policy`` after 1, 2, 3 ... failures in a row; ``reset`` after a success.

    The one failure backoff of a worker's connections and service loops.
    ``Backoff.doubling(low, high)``: ``low`` seconds, doubling up to ``high``,
    each shortened by up to 25 %.
    """

    def __init__(self, policy: RetryPolicy, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.failures = 0
        self._rng = rng or random.Random()

    @classmethod
    def doubling(cls, low: float, high: float, rng: random.Random | None = None) -> Backoff:
        return cls(BackoffPolicy(base_delay=low, factor=2.0, max_delay=high, jitter=0.25), rng)

    def next_delay(self) -> float:
        self.failures += 1
        return float(self.policy.delay(self.failures, self._rng))

    def reset(self) -> None:
        self.failures = 0
