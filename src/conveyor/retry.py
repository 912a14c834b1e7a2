"""Backoff policy for failed attempts. Pure: no I/O, no clock.

The delay before attempt ``n + 1`` after attempt ``n`` failed is::

    base = min(max_delay, base_delay * factor ** (n - 1))
    delay = base * (1 - jitter * r)        where r is uniform in [0, 1)

With the defaults (2 s, x2, capped at 1 h, 10 % jitter) the waits after
attempts 1, 2, 3, 4 are about 2, 4, 8, 16 seconds. The jitter only ever
shortens a delay, so ``max_delay`` stays a true upper bound.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

from conveyor.errors import ConfigError

BASE_DELAY_DEFAULT = 2.0
FACTOR_DEFAULT = 2.0
MAX_DELAY_DEFAULT = 3600.0
JITTER_DEFAULT = 0.1


class RetryPolicy(Protocol):
    """Anything that tells how long to wait after failed attempt ``attempt`` (1-based)."""

    def delay(self, attempt: int, rng: random.Random | None = None) -> float: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearBackoff:
    """``min(max_delay, step * attempt)`` seconds, no jitter: 10, 20, 30 ... with the defaults.

    Attributes:
        step: seconds added per failed attempt. Defaults to 10.0.
        max_delay: cap on any delay. Defaults to 100.0.
    """

    step: float = 10.0
    max_delay: float = 100.0

    def __post_init__(self) -> None:
        if not self.step >= 0:
            raise ConfigError(f"expected step to be >= 0, got {self.step!r}")
        if not (math.isfinite(self.step) and math.isfinite(self.max_delay)):
            raise ConfigError(f"expected finite step and max_delay, got {self.step!r}, {self.max_delay!r}")
        if not self.max_delay >= 0:
            raise ConfigError(f"expected max_delay to be >= 0, got {self.max_delay!r}")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        return float(min(self.max_delay, self.step * max(attempt, 1)))


@dataclass(frozen=True, kw_only=True, slots=True)
class BackoffPolicy:
    """Exponential backoff with jitter.

    Attributes:
        base_delay: seconds before the second attempt. Defaults to 2.0.
        factor: growth per attempt. Defaults to 2.0.
        max_delay: cap on any delay, in seconds. Defaults to 3600.0.
        jitter: fraction of the delay that may be randomly removed. Defaults to 0.1.
    """

    base_delay: float = BASE_DELAY_DEFAULT
    factor: float = FACTOR_DEFAULT
    max_delay: float = MAX_DELAY_DEFAULT
    jitter: float = JITTER_DEFAULT

    def __post_init__(self) -> None:
        for name in ("base_delay", "factor", "max_delay"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"expected {name} to be finite, got {getattr(self, name)!r}")
        if not self.base_delay >= 0:
            raise ConfigError(f"expected base_delay to be >= 0, got {self.base_delay!r}")
        if not self.factor >= 1:
            raise ConfigError(f"expected factor to be >= 1, got {self.factor!r}")
        if not self.max_delay >= self.base_delay:
            raise ConfigError(
                f"expected max_delay to be >= base_delay ({self.base_delay}), got {self.max_delay!r}"
            )
        if not 0 <= self.jitter <= 1:
            raise ConfigError(f"expected jitter to be between 0 and 1, got {self.jitter!r}")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        exponent = max(attempt - 1, 0)
        try:
            raw = self.base_delay * self.factor ** min(exponent, 1024)
        except OverflowError:
            raw = math.inf  # past any cap anyway
        capped = min(self.max_delay, raw)
        r = (rng or random).random()
        return capped * (1.0 - self.jitter * r)
